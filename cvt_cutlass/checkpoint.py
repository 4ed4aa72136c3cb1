"""``load_cvt``: a HF ``CvtForImageClassification`` from what a user has on disk, never the network.

Sources:

* a named config (``"cvt-13"``, ``"cvt-21"``, ``"cvt-w24"``): random init (seeded);
* a local HF directory (``config.json`` + weights, as ``save_pretrained`` writes it);
* a ``.safetensors`` file (HF names), its config from ``config=``, a ``config.json`` beside it, or
  inferred from the weights;
* an original CvT checkpoint (``.pth`` / ``.pt`` / ``.bin`` of microsoft/CvT, leoxiaobin's
  naming: ``stage0.patch_embed.proj.weight``, ``stage2.blocks.3.attn.conv_proj_q.bn.running_var``,
  ``head.weight``, ...), also wrapped in ``{"state_dict": ...}`` / ``{"model": ...}`` or with DDP's
  ``module.`` prefix; renamed to HF's names, config inferred.

A config inferred from weights takes every size from the tensors (embedding widths, patch sizes,
depths, MLP ratios, cls tokens, q/k/v biases, labels); the head counts are not in the weights and
come from ``num_heads=`` or the named config of the same widths. Every tensor of the model must
be in the checkpoint and every tensor of the checkpoint must land in the model (missing or
unexpected names raise, listing them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .models import CONFIGS, CvtShape, get_config

_Q = {"q": "query", "k": "key", "v": "value"}
_S = r"stage(\d+)\."
_B = _S + r"blocks\.(\d+)\."
_L = r"cvt.encoder.stages.{0}.layers.{1}."
# (original name pattern, HF name as a function of the match)
_ORIGINAL_RULES = (
    (_S + r"patch_embed\.proj\.(weight|bias)",
     lambda m: f"cvt.encoder.stages.{m[1]}.embedding.convolution_embeddings.projection.{m[2]}"),
    (_S + r"patch_embed\.norm\.(weight|bias)",
     lambda m: f"cvt.encoder.stages.{m[1]}.embedding.convolution_embeddings.normalization.{m[2]}"),
    (_S + r"cls_token", lambda m: f"cvt.encoder.stages.{m[1]}.cls_token"),
    (_B + r"attn\.conv_proj_([qkv])\.conv\.weight",
     lambda m: _L.format(m[1], m[2]) + f"attention.attention.convolution_projection_{_Q[m[3]]}."
                                       "convolution_projection.convolution.weight"),
    (_B + r"attn\.conv_proj_([qkv])\.bn\.(weight|bias|running_mean|running_var|num_batches_tracked)",
     lambda m: _L.format(m[1], m[2]) + f"attention.attention.convolution_projection_{_Q[m[3]]}."
                                       f"convolution_projection.normalization.{m[4]}"),
    (_B + r"attn\.proj_([qkv])\.(weight|bias)",
     lambda m: _L.format(m[1], m[2]) + f"attention.attention.projection_{_Q[m[3]]}.{m[4]}"),
    (_B + r"attn\.proj\.(weight|bias)", lambda m: _L.format(m[1], m[2]) + f"attention.output.dense.{m[3]}"),
    (_B + r"mlp\.fc1\.(weight|bias)", lambda m: _L.format(m[1], m[2]) + f"intermediate.dense.{m[3]}"),
    (_B + r"mlp\.fc2\.(weight|bias)", lambda m: _L.format(m[1], m[2]) + f"output.dense.{m[3]}"),
    (_B + r"norm1\.(weight|bias)", lambda m: _L.format(m[1], m[2]) + f"layernorm_before.{m[3]}"),
    (_B + r"norm2\.(weight|bias)", lambda m: _L.format(m[1], m[2]) + f"layernorm_after.{m[3]}"),
    (r"norm\.(weight|bias)", lambda m: f"layernorm.{m[1]}"),
    (r"head\.(weight|bias)", lambda m: f"classifier.{m[1]}"),
)


class CheckpointError(ValueError):
    """The checkpoint does not describe a CvT this loader can build."""


def hf_config(shape: CvtShape | str, **overrides):
    """A HF ``CvtConfig`` for one of our CvtShapes (or a config name)."""
    from transformers import CvtConfig

    s = get_config(shape) if isinstance(shape, str) else shape
    kw = dict(embed_dim=list(s.embed_dim), num_heads=list(s.num_heads), depth=list(s.depth),
              patch_sizes=list(s.patch_sizes), patch_stride=list(s.patch_stride),
              patch_padding=list(s.patch_padding), cls_token=list(s.cls_token), mlp_ratio=list(s.mlp_ratio),
              stride_kv=list(s.stride_kv), stride_q=list(s.stride_q), kernel_qkv=list(s.kernel_qkv),
              padding_kv=list(s.padding_kv), padding_q=list(s.padding_q), qkv_bias=list(s.qkv_bias),
              num_labels=s.num_labels)
    kw.update(overrides)
    return CvtConfig(**kw)


def original_to_hf(state: dict) -> dict:
    """Rename an original (microsoft/CvT) state dict to HF's names; unknown names raise."""
    out, unknown = {}, []
    for name, t in state.items():
        for pat, hf in _ORIGINAL_RULES:
            m = re.fullmatch(pat, name)
            if m:
                out[hf(m)] = t
                break
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"{len(unknown)} name(s) of the original checkpoint are not CvT's: {unknown[:8]}")
    return out


def _unwrap(obj) -> dict:
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state", "module"):
            if key in obj and isinstance(obj[key], dict):
                return _unwrap(obj[key])
    if not isinstance(obj, dict) or not all(hasattr(v, "shape") for v in obj.values()):
        raise CheckpointError("the file holds no state dict (a mapping of names to tensors)")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def infer_config(state: dict, num_heads=None, num_labels: int | None = None):
    """A CvtConfig from a HF-named state dict (see the module docstring for what is inferred)."""
    from transformers import CvtConfig

    pre = "cvt.encoder.stages."
    stages = sorted({int(k[len(pre):].split(".")[0]) for k in state if k.startswith(pre)})
    if not stages or stages != list(range(len(stages))):
        raise CheckpointError(f"no CvT stages found in the checkpoint (names like {pre}0...)")
    missing = [k for i in stages for k in (f"{pre}{i}.embedding.convolution_embeddings.projection.weight",
                                           f"{pre}{i}.layers.0.intermediate.dense.weight",
                                           f"{pre}{i}.layers.0.attention.attention.convolution_projection_query."
                                           "convolution_projection.convolution.weight") if k not in state]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s) the config is read from: "
                              f"{', '.join(missing)}")
    dims, patch, depth, ratio, cls, qkv_bias, kernel = [], [], [], [], [], [], []
    for i in stages:
        w = state[f"{pre}{i}.embedding.convolution_embeddings.projection.weight"]
        dims.append(int(w.shape[0]))
        patch.append(int(w.shape[2]))
        blocks = {int(k.split(".")[5]) for k in state if k.startswith(f"{pre}{i}.layers.")}
        depth.append(max(blocks) + 1 if blocks else 0)
        lay = f"{pre}{i}.layers.0."
        ratio.append(state[lay + "intermediate.dense.weight"].shape[0] / dims[-1])
        cls.append(f"{pre}{i}.cls_token" in state)
        qkv_bias.append(lay + "attention.attention.projection_query.bias" in state)
        kernel.append(int(state[lay + "attention.attention.convolution_projection_query.convolution_projection."
                                      "convolution.weight"].shape[2]))
    if num_heads is None:
        known = [c for c in CONFIGS.values() if list(c.embed_dim) == dims]
        if not known:
            raise CheckpointError(f"the checkpoint's widths {dims} match no known CvT config: pass num_heads= "
                                  "(or config=) to load_cvt")
        num_heads = list(known[0].num_heads)
    num_heads = list(num_heads)
    if len(num_heads) != len(dims) or any(h < 1 or d % h for d, h in zip(dims, num_heads, strict=False)):
        raise CheckpointError(f"num_heads {num_heads} does not fit the checkpoint's widths {dims}: one head count "
                              "per stage, each dividing its stage's width")
    base = CONFIGS["cvt-13"]
    if len(dims) != 3 or patch != list(base.patch_sizes):
        raise CheckpointError(f"patch sizes {patch} over {len(dims)} stages: strides and paddings are known only for "
                              "CvT's (7, 3, 3); pass config= to load_cvt")
    labels = state["classifier.weight"].shape[0] if "classifier.weight" in state else 0
    return CvtConfig(embed_dim=dims, num_heads=num_heads, depth=depth, patch_sizes=patch,
                     mlp_ratio=ratio, cls_token=cls, qkv_bias=qkv_bias, kernel_qkv=kernel,
                     num_labels=num_labels if num_labels is not None else int(labels))


WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
ACCEPTED = ("a local HF directory (config.json + model.safetensors / pytorch_model.bin), a .safetensors file, "
            "or an original CvT .pth / .pt / .bin")


def _load_tensors(path: Path) -> dict:
    if path.suffix.lower() not in WEIGHT_SUFFIXES:
        raise CheckpointError(f"load_cvt: {path} is not a checkpoint (expected {ACCEPTED})")
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:  # a truncated or foreign file
            raise CheckpointError(f"load_cvt: cannot read {path} as safetensors: {str(e).splitlines()[0]}") from e
    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, or a pickle with objects beyond tensors and plain containers
        raise CheckpointError(f"load_cvt: cannot read {path} as a weights-only torch checkpoint "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); expected {ACCEPTED}") from e
    return _unwrap(obj)


def _heads_agree(config, num_heads, where: str):
    """``config``, checked against the head counts a caller gave (they serve inference only)."""
    if num_heads is not None and list(config.num_heads) != list(num_heads):
        raise CheckpointError(f"load_cvt: num_heads {list(num_heads)} differs from {where}'s "
                              f"{list(config.num_heads)} (num_heads= is for weights without a config)")
    return config


def load_cvt(source: str | Path, *, config=None, num_heads=None, num_labels: int | None = None, seed: int = 0,
             dtype=None, device=None):
    """A ``CvtForImageClassification`` in eval mode from ``source`` (see the module docstring).

    ``config``: a HF CvtConfig or a config name, for weights without a config.json (or to
    override the inferred one). ``num_heads``: the head counts when inferring. ``seed``: for
    random init. ``dtype`` / ``device``: moved there before returning."""
    import torch
    from transformers import CvtForImageClassification

    if isinstance(config, str):
        config = hf_config(config)
    if config is not None:
        _heads_agree(config, num_heads, "config=")
    path = Path(source)
    if not path.exists():
        if str(source).lower() in CONFIGS:
            torch.manual_seed(seed)
            model = CvtForImageClassification(config or _heads_agree(hf_config(str(source).lower()), num_heads,
                                                                      str(source)))
            return _finish(model, dtype, device)
        raise FileNotFoundError(f"load_cvt: {source!r} is neither a local file or directory nor a config name "
                                f"({sorted(CONFIGS)}); nothing is downloaded")
    if path.is_dir():
        hf_names = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                    "pytorch_model.bin.index.json")
        if (path / "config.json").is_file() and config is None and any((path / n).is_file() for n in hf_names):
            model = CvtForImageClassification.from_pretrained(str(path), local_files_only=True)
            _heads_agree(model.config, num_heads, str(path / "config.json"))
            return _finish(model, dtype, device)
        files = sorted(p for ext in ("*.safetensors", "*.pth", "*.pt", "*.bin") for p in path.glob(ext))
        if len(files) != 1:
            raise CheckpointError(f"load_cvt: {path} has no config.json and {len(files)} weight files "
                                  "(expected one .safetensors / .pth / .pt / .bin)")
        path = files[0]
    state = _load_tensors(path)
    if any(re.match(r"stage\d+\.", k) for k in state):
        state = original_to_hf(state)
    if config is None and (path.parent / "config.json").is_file():
        from transformers import CvtConfig

        config = _heads_agree(CvtConfig(**json.loads((path.parent / "config.json").read_text())), num_heads,
                              str(path.parent / "config.json"))
    if config is None:
        config = infer_config(state, num_heads, num_labels)
    model = CvtForImageClassification(config)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(f"load_cvt: {path} does not fit the config: {len(missing)} missing "
                              f"({missing[:5]}), {len(unexpected)} unexpected ({unexpected[:5]})")
    bad = [k for k in state if tuple(state[k].shape) != tuple(expected[k].shape)]
    if bad:
        raise CheckpointError(f"load_cvt: shapes differ from the config for {bad[:5]}")
    model.load_state_dict(state, strict=False)
    return _finish(model, dtype, device)


def _finish(model, dtype, device):
    model.eval()
    if device is not None:
        model.to(device)
    if dtype is not None:
        model.to(dtype)
    return model


def random_cvt(name: str, num_labels: int = 1000):
    """A random-init HF CvtForImageClassification of a named config (seed 0), with randomised
    BatchNorm statistics and LayerNorm affines (fresh modules would make BatchNorm folding trivial
    and LayerNorm the identity): what benchmarks and ``cvt-cutlass run`` run without a checkpoint."""
    import torch
    from transformers import CvtForImageClassification

    torch.manual_seed(0)
    model = CvtForImageClassification(hf_config(name, num_labels=num_labels)).eval()
    return randomize_norms(model, torch.Generator().manual_seed(0))


def randomize_norms(model, generator, *, bn_affine: bool = False, ln_bias: bool = True):
    """``model`` with non-trivial BatchNorm running statistics (mean ~ N(0, 0.2^2), var in [0.5, 1.5);
    with ``bn_affine`` its weight and bias too) and LayerNorm affines (weight in [0.5, 1.5), bias
    ~ N(0, 0.1^2) unless ``ln_bias`` is false: affine weights like the BatchNorm weight, biases like
    its bias), drawn module by module from ``generator`` (a CPU torch.Generator)."""
    import torch

    def uniform(t):  # [0.5, 1.5)
        return torch.rand(t.shape, generator=generator) + 0.5

    def normal(t, scale: float):
        return torch.randn(t.shape, generator=generator) * scale

    with torch.no_grad():
        for m in model.modules():
            bn = isinstance(m, torch.nn.BatchNorm2d)
            if bn:
                m.running_mean.copy_(normal(m.running_mean, 0.2))
                m.running_var.copy_(uniform(m.running_var))
            if isinstance(m, torch.nn.LayerNorm) or (bn and bn_affine):
                m.weight.copy_(uniform(m.weight))
                if bn or ln_bias:
                    m.bias.copy_(normal(m.bias, 0.1))
    return model
