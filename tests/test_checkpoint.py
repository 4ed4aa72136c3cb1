"""load_cvt: named configs, HF directories, bare safetensors, original (microsoft/CvT) .pth
checkpoints written by the test itself; errors. CPU only, no network."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from cvt_cutlass.checkpoint import CheckpointError, infer_config, load_cvt  # noqa: E402

from .test_swap import _images, tiny_cvt  # noqa: E402


def _to_original(state: dict) -> dict:
    """HF names -> microsoft/CvT names, written independently of the loader's rules (plain
    substring replacements in the order the original modules nest)."""
    out = {}
    for k, v in state.items():
        o = k
        for a, b in (("cvt.encoder.stages.", "stage"), (".embedding.convolution_embeddings.projection.", ".patch_embed.proj."),
                     (".embedding.convolution_embeddings.normalization.", ".patch_embed.norm."),
                     (".layers.", ".blocks."), (".attention.attention.convolution_projection_query.convolution_projection.convolution.", ".attn.conv_proj_q.conv."),
                     (".attention.attention.convolution_projection_key.convolution_projection.convolution.", ".attn.conv_proj_k.conv."),
                     (".attention.attention.convolution_projection_value.convolution_projection.convolution.", ".attn.conv_proj_v.conv."),
                     (".attention.attention.convolution_projection_query.convolution_projection.normalization.", ".attn.conv_proj_q.bn."),
                     (".attention.attention.convolution_projection_key.convolution_projection.normalization.", ".attn.conv_proj_k.bn."),
                     (".attention.attention.convolution_projection_value.convolution_projection.normalization.", ".attn.conv_proj_v.bn."),
                     (".attention.attention.projection_query.", ".attn.proj_q."), (".attention.attention.projection_key.", ".attn.proj_k."),
                     (".attention.attention.projection_value.", ".attn.proj_v."), (".attention.output.dense.", ".attn.proj."),
                     (".intermediate.dense.", ".mlp.fc1."), (".output.dense.", ".mlp.fc2."),
                     (".layernorm_before.", ".norm1."), (".layernorm_after.", ".norm2.")):
            o = o.replace(a, b)
        o = {"layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias", "classifier.weight": "head.weight",
             "classifier.bias": "head.bias"}.get(o, o)
        out[o] = v.clone()
    return out


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def test_named_config_random_init():
    m = load_cvt("cvt-13", seed=3)
    assert not m.training and list(m.config.depth) == [1, 2, 10] and m.config.num_labels == 1000
    w24 = load_cvt("CvT-W24")
    assert list(w24.config.embed_dim) == [192, 768, 1024] and list(w24.config.num_heads) == [3, 12, 16]
    a, b = load_cvt("cvt-13", seed=3), load_cvt("cvt-13", seed=4)
    assert torch.equal(a.classifier.weight, m.classifier.weight) and not torch.equal(a.classifier.weight,
                                                                                      b.classifier.weight)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_cvt("microsoft/cvt-13")


def test_hf_directory_and_bare_safetensors(tmp_path):
    model = tiny_cvt()
    x = _images(2, 64)
    model.save_pretrained(tmp_path / "hf")
    got = load_cvt(tmp_path / "hf")
    torch.testing.assert_close(_logits(got, x), _logits(model, x), rtol=0, atol=0)
    # a lone .safetensors with HF names: config inferred from the weights (+ the heads)
    (tmp_path / "st").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "st" / "w.safetensors"))
    got = load_cvt(tmp_path / "st" / "w.safetensors", num_heads=model.config.num_heads)
    assert list(got.config.depth) == [1, 2, 3] and got.config.num_labels == 16
    torch.testing.assert_close(_logits(got, x), _logits(model, x), rtol=0, atol=0)
    # with a config.json beside it, that config is used
    (tmp_path / "st" / "config.json").write_text(json.dumps(model.config.to_dict()))
    torch.testing.assert_close(_logits(load_cvt(tmp_path / "st"), x), _logits(model, x), rtol=0, atol=0)


@pytest.mark.parametrize("wrap", ["plain", "state_dict", "ddp"])
def test_original_cvt_checkpoint(tmp_path, wrap):
    """A tiny checkpoint in microsoft/CvT's naming, written here, loads into the same model."""
    model = tiny_cvt()
    orig = _to_original(model.state_dict())
    assert "stage2.blocks.1.attn.conv_proj_k.bn.running_var" in orig and "stage2.cls_token" in orig
    assert "head.weight" in orig and "stage0.patch_embed.proj.weight" in orig
    obj = {"plain": orig, "state_dict": {"state_dict": orig, "epoch": 7},
           "ddp": {"module." + k: v for k, v in orig.items()}}[wrap]
    torch.save(obj, tmp_path / "CvT-tiny.pth")
    got = load_cvt(tmp_path / "CvT-tiny.pth", num_heads=[1, 3, 6])
    x = _images(2, 64)
    torch.testing.assert_close(_logits(got, x), _logits(model, x), rtol=0, atol=0)


def test_heads_come_from_the_named_config_of_the_same_widths():
    state = load_cvt("cvt-13").state_dict()
    cfg = infer_config(state)
    assert list(cfg.num_heads) == [1, 3, 6] and list(cfg.depth) == [1, 2, 10]
    state = {k: v for k, v in tiny_cvt(embed_dim=(64, 128, 256), num_heads=(1, 2, 4)).state_dict().items()}
    with pytest.raises(CheckpointError, match="pass num_heads"):
        infer_config(state)


def test_checkpoint_errors(tmp_path):
    model = tiny_cvt()
    orig = _to_original(model.state_dict())
    torch.save({**orig, "stage1.blocks.0.attn.weird.weight": torch.zeros(2)}, tmp_path / "a.pth")
    with pytest.raises(CheckpointError, match="not CvT's"):
        load_cvt(tmp_path / "a.pth", num_heads=[1, 3, 6])
    del orig["stage2.blocks.2.mlp.fc2.bias"]
    torch.save(orig, tmp_path / "b.pth")
    with pytest.raises(CheckpointError, match="1 missing"):
        load_cvt(tmp_path / "b.pth", num_heads=[1, 3, 6])
    torch.save([1, 2], tmp_path / "c.pth")
    with pytest.raises(CheckpointError, match="no state dict"):
        load_cvt(tmp_path / "c.pth")


def test_checkpoint_errors_name_what_is_missing_or_does_not_fit(tmp_path, capsys):
    """A tensor the config is read from missing, head counts that do not fit the widths or differ
    from a config.json's, --num-heads / --config without --checkpoint: CheckpointError (a
    ValueError: one line from the CLI), not a KeyError, an IndexError or a silent override."""
    from cvt_cutlass.cli import main

    state = {k: v.contiguous() for k, v in tiny_cvt().state_dict().items()}
    gone = "cvt.encoder.stages.1.embedding.convolution_embeddings.projection.weight"
    save_file({k: v for k, v in state.items() if k != gone}, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=f"lacks 1 tensor.*{gone}"):
        load_cvt(tmp_path / "a.safetensors")
    save_file(state, tmp_path / "b.safetensors")
    for heads in ([1, 3], [1, 5, 6], [0, 3, 6]):
        with pytest.raises(CheckpointError, match="does not fit the checkpoint's widths"):
            load_cvt(tmp_path / "b.safetensors", num_heads=heads)
    assert list(load_cvt(tmp_path / "b.safetensors", num_heads=[2, 3, 6]).config.num_heads) == [2, 3, 6]
    (tmp_path / "config.json").write_text(json.dumps(tiny_cvt().config.to_dict()))
    with pytest.raises(CheckpointError, match="differs from .*config.json"):
        load_cvt(tmp_path / "b.safetensors", num_heads=[2, 3, 6])
    with pytest.raises(CheckpointError, match="differs from config="):
        load_cvt("cvt-13", config="cvt-13", num_heads=[2, 3, 6])
    assert main(["run", "--num-heads", "1,3,6"]) == 2
    assert "describe a --checkpoint's model" in capsys.readouterr().err


def test_run_main_job_cpu_reference_path(tmp_path, capsys):
    """`cvt-cutlass run` without a GPU says so and runs the swapped model's CPU reference path, on a
    named config and on an original checkpoint; the logits match the unswapped model."""
    from cvt_cutlass.cli import main

    if torch.cuda.is_available():
        pytest.skip("the GPU path of `cvt-cutlass run` is exercised on the device")
    assert main(["run", "--model", "cvt-13", "--batch", "1", "--image-size", "64"]) == 0
    text = capsys.readouterr().out
    assert "no CUDA GPU is visible" in text and "CPU reference" in text and "| cvt-13 (random weights) |" in text
    torch.save(_to_original(tiny_cvt().state_dict()), tmp_path / "tiny.pth")
    assert main(["run", "--checkpoint", str(tmp_path / "tiny.pth"), "--num-heads", "1,3,6", "--batch", "2",
                 "--image-size", "64"]) == 0
    assert "tiny.pth" in capsys.readouterr().out
