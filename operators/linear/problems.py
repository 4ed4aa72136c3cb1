"""The Linear problems of a CvT: every GEMM its forward runs, and the backward GEMMs of a training
step (shape arithmetic only, from :mod:`cvt_cutlass.models`). The benchmark, the tests, the kernel
lists (:func:`cvt_cutlass.model_kernels`) and the profile sweeps all enumerate them here, so a new
model config needs no new code anywhere else."""

from __future__ import annotations

from dataclasses import dataclass

from ...models import CvtShape, ImageSize, get_config, stage_shapes

BACKWARD_PASSES = ("dgrad", "wgrad")
# The training forward's epilogues that a profile sweep times on the problems of another one (the
# variant: the epilogue its problems take at inference). fc1 keeps, as a second output, GELU's
# derivative at its pre-activation (what the training step runs) or the pre-activation itself
# (linear_gelu_aux). (Drop path's row-scaled residual epilogues read one vector more than the
# residual one and take its tuned kernel: select.py.)
TRAINING_VARIANTS = {"bias_gelu_dgelu": "bias_gelu", "bias_gelu_aux": "bias_gelu"}


@dataclass(frozen=True)
class LinearLayer:
    """One Linear layer kind of the model: y = epilogue(x W^T), x (m, k), W (n, k)."""

    label: str  # e.g. "s1.q", "s3.fc1", "head"
    m: int
    n: int
    k: int
    epilogue: str  # what the fused op computes
    count: int  # how many times a forward pass runs it (blocks per stage)
    unfused: str  # what PyTorch runs for the same step

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def linear_problems(cfg: CvtShape | str, batch: int, image_size: ImageSize = None) -> list[LinearLayer]:
    """Every Linear of a CvT forward pass, with the fused epilogue each one takes."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    layers = []
    for st in stage_shapes(cfg, image_size):
        d, mq, mkv, s = st.dim, batch * st.tokens_q, batch * st.tokens_kv, f"s{st.stage}"
        qkv = "bias" if cfg.qkv_bias[st.stage - 1] else "none"
        lin = "linear" if qkv == "none" else "linear+bias"
        layers += [
            LinearLayer(f"{s}.q", mq, d, d, qkv, st.depth, lin),
            LinearLayer(f"{s}.k", mkv, d, d, qkv, st.depth, lin),
            LinearLayer(f"{s}.v", mkv, d, d, qkv, st.depth, lin),
            LinearLayer(f"{s}.proj", mq, d, d, "bias_residual", st.depth, "linear+bias, add"),
            LinearLayer(f"{s}.fc1", mq, st.mlp_dim, d, "bias_gelu", st.depth, "linear+bias, gelu"),
            LinearLayer(f"{s}.fc2", mq, d, st.mlp_dim, "bias_residual", st.depth, "linear+bias, add"),
        ]
    layers.append(LinearLayer("head", batch, cfg.num_labels, cfg.embed_dim[-1], "bias", 1, "linear+bias"))
    return layers


@dataclass(frozen=True)
class BackwardProblem:
    """One backward GEMM of a Linear: ``dgrad`` dX = dY . W, problem (rows, the layer's K, its N),
    or ``wgrad`` dW = dY^T . X, problem (rows, N, K)."""

    label: str
    pass_: str
    m: int
    n: int  # output columns: dX's (the layer's K) or dW's rows (the layer's N)
    k: int  # reduction: the layer's N (dgrad) or K (wgrad; the rows are split)
    epilogue: str  # "none" / "dgelu_saved_dbias" (dgrad), "dbias" / "none" (wgrad)

    @property
    def key(self) -> str:
        """The selection table's epilogue column of this problem: ``<pass>:<epilogue>``."""
        return f"{self.pass_}:{self.epilogue}"


def backward_problems(model: CvtShape | str, batches, image_size: ImageSize, passes) -> list[BackwardProblem]:
    """The backward GEMMs a training step runs for every Linear at each batch: fc2's dgrad multiplies
    by GELU's derivative that fc1's forward saved and reduces fc1's db (``dgelu_saved_dbias``, as
    the mlp op runs it), so
    fc1's wgrad sums no db; problems whose N or K is not a multiple of 8 are left out (the kernels
    need 16-byte rows; those fall back)."""
    out: dict[tuple, BackwardProblem] = {}
    for b in batches:
        for p in linear_problems(model, b, image_size):
            probs = []
            if "dgrad" in passes:
                epi = "dgelu_saved_dbias" if p.label.endswith(".fc2") else "none"
                probs.append(BackwardProblem(p.label, "dgrad", p.m, p.k, p.n, epi))
            if "wgrad" in passes:
                epi = "none" if p.label.endswith(".fc1") else "dbias"
                probs.append(BackwardProblem(p.label, "wgrad", p.m, p.n, p.k, epi))
            for q in probs:
                if q.n % 8 == 0 and q.k % 8 == 0:
                    out.setdefault((q.pass_, q.m, q.n, q.k, q.epilogue), q)
    return list(out.values())
