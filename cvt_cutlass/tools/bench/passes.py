"""``cvt-cutlass bench --op linear|layernorm|attention|conv|dwconv --pass fwd,bwd,fwd+bwd``: the
training passes of the GEMM family, LayerNorm, attention, the token-embedding conv and the
depthwise conv projection + BatchNorm on CUTLASS vs torch autograd (cuBLAS, PyTorch's LayerNorm,
SDPA on cuDNN and on flash, cuDNN's conv and BatchNorm), same process, CvT-13's stage shapes at
the given batch (conv: ``--model``'s embedding convs at ``--image-size``).

Conv rows per stage: ``embed`` (conv2d_nhwc on NHWC tokens, the stem's image padded to 4 channels:
backward = wgrad + db, plus dgrad for stages 2 and 3 whose input requires grad; the stem's image
does not) against F.conv2d on NCHW tensors as HF runs it, and ``embed/cl`` against the same on
channels_last tensors (cuDNN's NHWC kernels).

Rows per stage (tokens per image, channels): ``qkv`` (a Linear + bias, c -> c), ``fc1`` (Linear +
bias + GELU via ``linear_gelu_aux``: its GELU' is torch's gelu_backward when the layer stands
alone), ``fc2`` (Linear + bias + residual), ``mlp`` (fc1 + GELU + fc2 + residual as the ``mlp``
op: GELU' computed in fc1's forward epilogue and saved, multiplied with fc1's dbias reduced in
fc2's dgrad epilogue, how the model trains; compare it with
torch's fc1 + fc2), ``ln`` (LayerNorm over the tokens), ``attn`` (q, k, v as the projections
write them, CvT's scale; peer: SDPA forced onto cuDNN), ``attn-flash`` (the same, peer: SDPA
on flash) and ``attn-det`` (ours under torch.use_deterministic_algorithms(True), its kernels
summing dq in a fixed order; peer: SDPA on cuDNN as PyTorch runs it by default).
``--op dwconv``: ``dw_q`` / ``dw_kv``, the conv projection at stride 1 / 2 with BatchNorm in
training mode (``dwconv_bn_train``: batch statistics, running stats updated) vs HF's path on the
same tokens (an NCHW view, Conv2d in the activation dtype as under autocast, F.batch_norm with
fp32 parameters, back to tokens, the cls row concatenated in stage 3).

Pass ``fwd``: the forward under no_grad. ``bwd``: ``torch.autograd.grad`` of a kept graph (dX,
dW, db of every input). ``fwd+bwd``: both. Timed eagerly (autograd runs on the engine's own
thread, so a CUDA graph capture of it is invalid), CUDA events, warm-up, medians of 15, random
inputs. Every kernel a row needs is compiled first, in parallel. ``--breakdown`` adds our four
MLP backward GEMMs timed one by one, and LayerNorm's backward kernel vs aten's, GPU time only
(CUDA-graph replays). The goal column: GEMM rows at <= 0.8x torch's
time (ratio >= 1.25), LayerNorm backward at >= 2x, attention and the embedding conv's backward
faster than cuDNN (>= 1x), conv projection + BatchNorm at >= 2x in each pass.
"""

from __future__ import annotations

from ... import fallback, runtime
from ...operators.attention import select_attention
from ...operators.conv2d import conv_window, select_conv2d, select_conv2d_backward
from ...operators.dwconv import select_dwconv_bn
from ...operators.layernorm import select_layernorm
from ...operators.linear import select_linear, select_linear_backward
from ..csvfile import append_csv
from ..timing import pass_gpu_ms, pass_timer, time_cuda
from .common import deterministic_mode, start

STAGES = {1: (3136, 64), 2: (784, 192), 3: (197, 384)}  # tokens per image (+ cls), channels (CvT-13)
ATTN = {1: (1, 3136, 784), 2: (3, 784, 196), 3: (6, 197, 50)}  # heads, Lq, Lkv (CvT-13, head dim 64)
DW_ROWS = {"dw_q": 1, "dw_kv": 2}  # the conv projection's rows: stride
DW_GEOMETRY = {1: (56, 0), 2: (28, 0), 3: (14, 1)}  # image side, cls rows (CvT-13 at 224)
ROWS = {"linear": ("qkv", "fc1", "fc2", "mlp"), "layernorm": ("ln",), "attention": ("attn", "attn-flash", "attn-det"),
        "dwconv": tuple(DW_ROWS)}
# speedup (torch ms / ours) the issues ask of the backward (dwconv: of every pass)
GOALS = {"linear": 1.25, "layernorm": 2.0, "attention": 1.0, "conv": 1.0, "dwconv": 2.0}


def cases(op: str, batch: int):
    """(row, stage, M rows, C channels) of one op's table."""
    for st, (tokens, c) in STAGES.items():
        for row in ROWS[op]:
            yield row, st, batch * tokens, c


def dw_geometry(row: str, st: int) -> tuple[int, int, int, int]:
    """(side, stride, cls rows, output side) of a conv projection row."""
    side, cls = DW_GEOMETRY[st]
    stride = DW_ROWS[row]
    return side, stride, cls, (side - 1) // stride + 1


def kernel_specs(op: str, batch: int, dtype: str, arch: int, gpu: str | None, model: str = "cvt-13",
                 image_size=None) -> list:
    """Every kernel the rows of ``op`` select (the planners' own calls, same arguments)."""
    if op == "conv":
        return conv_kernel_specs(batch, dtype, arch, gpu, model, image_size)
    out = []
    for row, st, m, c in cases(op, batch):
        h = 4 * c
        if row in DW_ROWS:
            _, stride, _, side_out = dw_geometry(row, st)
            out += [select_dwconv_bn(batch * side_out ** 2, c, stride, dtype, arch, gpu, p).spec for p in ("fwd", "bwd")]
            continue
        if row.startswith("attn"):
            heads, lq, lkv = ATTN[st]
            out += [select_attention(batch, heads, lq, lkv, 64, dtype, arch, gpu, p).spec for p in ("fwd", "bwd")]
            continue
        if row == "ln":
            out += [select_layernorm(m, c, dtype, arch, gpu, p).spec for p in ("fwd", "bwd")]
            continue
        gemms = {"qkv": [("bias", c, c)], "fc1": [("bias_gelu_aux", h, c)], "fc2": [("bias_residual", c, h)],
                 "mlp": [("bias_gelu_dgelu", h, c), ("bias_residual", c, h)]}[row]
        for epi, n, k in gemms:
            out.append(select_linear(m, n, k, dtype, epi, arch, gpu).spec)
            out.append(select_linear_backward("dgrad", m, k, n, dtype, "none", arch, gpu).spec)
            wepi = "none" if row == "mlp" and epi == "bias_gelu_dgelu" else "dbias"  # mlp: db1 from fc2's dgrad
            out.append(select_linear_backward("wgrad", m, n, k, dtype, wepi, arch, gpu).spec)
        if row == "mlp":
            out.append(select_linear_backward("dgrad", m, h, c, dtype, "dgelu_saved_dbias", arch, gpu).spec)
    return list({s.name: s for s in out}.values())


# ----------------------------------------------------------------------------- conv rows
def conv_layers(model: str, batch: int, image_size=None):
    """The embedding convs (models.ConvLayer) of ``model``."""
    from ...operators.conv2d import conv_problems

    return [layer for layer in conv_problems(model, batch, image_size) if layer.kind == "embed"]


def conv_kernel_specs(batch, dtype, arch, gpu, model="cvt-13", image_size=None) -> list:
    """The forward, wgrad and (inputs of 8k channels) dgrad kernels of the conv rows."""
    from ...operators.conv2d import stem_channels

    out = []
    for layer in conv_layers(model, batch, image_size):
        c = stem_channels(layer.c)
        m, kk = layer.n * layer.p * layer.q, layer.r * layer.r * c
        window = conv_window(c, layer.k, layer.r, layer.r, layer.w, layer.stride, layer.pad)
        out.append(select_conv2d(m, layer.k, kk, c, dtype, arch, gpu, window).spec)
        out.append(select_conv2d_backward("wgrad", m, layer.k, kk, c, dtype, arch, gpu, window).spec)
        if c % 8 == 0:
            out.append(select_conv2d_backward("dgrad", m, layer.k, kk, c, dtype, arch, gpu).spec)
    return list({s.name: s for s in out}.values())


def _conv_inputs(torch, layer, dt, gen, channels_last: bool):
    """(ours: leaves (x NHWC padded, w KRSC padded, b), grad; torch's: leaves (x NCHW, w KCRS, b),
    grad), same values; the input requires grad unless it is the stem's image."""
    from ...ops.conv2d import conv_filter_krsc, image_to_nhwc, stem_channels

    c = stem_channels(layer.c)
    x = torch.randn(layer.n, layer.c, layer.h, layer.w, device="cuda", generator=gen).to(dt)
    w = (torch.randn(layer.k, layer.c, layer.r, layer.r, device="cuda", generator=gen) / (layer.r * layer.c ** 0.5)).to(dt)
    b = (0.5 * torch.randn(layer.k, device="cuda", generator=gen)).to(dt)
    g = torch.randn(layer.n, layer.p, layer.q, layer.k, device="cuda", generator=gen).to(dt)
    need_x = layer.c % 8 == 0
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ours = [image_to_nhwc(x, c).requires_grad_(need_x), conv_filter_krsc(w, c).requires_grad_(), b.clone().requires_grad_()]
    peer = [x.contiguous(memory_format=fmt).requires_grad_(need_x), w.contiguous(memory_format=fmt).requires_grad_(),
            b.clone().requires_grad_()]
    grads = (g, g.permute(0, 3, 1, 2).contiguous(memory_format=fmt))
    return (ours if need_x else ours[1:], ours), (peer if need_x else peer[1:], peer), grads


def _measure_conv(torch, layer, pass_, dtype, dt, run, batch, channels_last):
    """One conv row: ours vs F.conv2d (NCHW, or channels_last), eager medians and CUDA-graph GPU times."""
    import torch.nn.functional as F

    from ...ops.conv2d import conv2d_nhwc

    (ol, oall), (pl, pall), (og, pg) = _conv_inputs(torch, layer, dt, run.gen, channels_last)
    st, pad = layer.stride, layer.pad

    def ours(*t):
        return conv2d_nhwc(*oall[:3 - len(t)], *t, st, pad)

    def peer(*t):
        return F.conv2d(*pall[:3 - len(t)], *t, stride=st, padding=pad)

    t_peer, t_ours, g_ours, gpu_speedup, gpu = _time_pass(torch, pass_, (peer, pl, pg), (ours, ol, og))
    m = layer.n * layer.p * layer.q
    flops = 2 * m * layer.k * layer.r * layer.r * layer.c * (2 if layer.c % 8 == 0 else 1)  # wgrad (+ dgrad)
    t_rate = g_ours or t_ours
    goal = GOALS["conv"] if pass_ == "bwd" else None

    def met(x):
        return "" if goal is None or x is None else ("yes" if x >= goal else "NO")

    case = f"{layer.label}{'/cl' if channels_last else ''}"
    return {**run.row, "op": "conv", "case": case, "pass": pass_, "dtype": dtype, "batch": batch, "m": m,
            "c": layer.c, "torch_ms": f"{t_peer:.4f}", "cutlass_ms": f"{t_ours:.4f}", "speedup": f"{t_peer / t_ours:.3f}",
            **gpu, "rate": f"{flops / t_rate / 1e9:.0f} TFLOP/s" if pass_ == "bwd" else "",
            "goal": "" if goal is None else f">={goal}x", "met": met(t_peer / t_ours),
            "met_gpu": met(gpu_speedup),
            "fallbacks": sum(fallback.stats()["fallbacks"].values())}


def _inputs(torch, row, m, c, dt, gen, batch=1, st=1):
    def r(*s, scale=1.0, grad=True, dtype=dt):
        t = (scale * torch.randn(*s, device="cuda", generator=gen)).to(dtype)
        return t.requires_grad_() if grad else t

    h = 4 * c
    if row in DW_ROWS:
        side, _, cls, side_out = dw_geometry(row, st)
        f32 = torch.float32
        return ([r(batch, cls + side * side, c), r(3, 3, c, scale=1 / 3, dtype=f32),
                 (1 + 0.1 * r(c, grad=False, dtype=f32)).requires_grad_(), r(c, scale=0.1, dtype=f32)],
                r(batch, cls + side_out * side_out, c, grad=False))
    if row.startswith("attn"):  # q and a packed kv as the projections write them, viewed per head
        heads, lq, lkv = ATTN[next(st for st, (_, ch) in STAGES.items() if ch == c)]
        q = r(batch, lq, heads * 64, grad=False).view(batch, lq, heads, 64)
        kv = r(batch, lkv, 2 * heads * 64, grad=False)
        k, v = (kv[..., i * heads * 64:(i + 1) * heads * 64].view(batch, lkv, heads, 64) for i in (0, 1))
        return [t.requires_grad_() for t in (q, k, v)], r(batch, lq, heads, 64, grad=False)
    if row == "ln":
        t = m // batch
        return [r(batch, t, c), (1 + 0.1 * r(c, grad=False)).requires_grad_(), r(c)], r(batch, t, c, grad=False)
    if row == "qkv":
        return [r(m, c), r(c, c, scale=c ** -0.5), r(c)], r(m, c, grad=False)
    if row == "fc1":
        return [r(m, c), r(h, c, scale=c ** -0.5), r(h)], r(m, h, grad=False)
    if row == "fc2":
        return [r(m, h), r(c, h, scale=h ** -0.5), r(c), r(m, c)], r(m, c, grad=False)
    return [r(m, c), r(h, c, scale=c ** -0.5), r(h), r(c, h, scale=h ** -0.5), r(c), r(m, c)], r(m, c, grad=False)


def _dw_fns(row, st):
    """(ours, HF's) conv projection + BatchNorm in training mode, each with its own running stats."""
    import torch
    import torch.nn.functional as F

    from ...ops.dwconv import dwconv_bn_train

    side, stride, cls, _ = dw_geometry(row, st)
    c = STAGES[st][1]
    stats = [(torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")) for _ in range(2)]

    def ours(x, w, g, b):
        return dwconv_bn_train(x, w, g, b, *stats[0], 0.1, 1e-5, side, side, stride, cls)[0]

    def hf(x, w, g, b):
        n = x.shape[0]
        img = x[:, cls:].transpose(1, 2).reshape(n, c, side, side)  # HF's view of the tokens
        z = F.conv2d(img, w.permute(2, 0, 1).unsqueeze(1).to(x.dtype), None, stride, 1, groups=c)
        y = F.batch_norm(z, *stats[1], g, b, True, 0.1, 1e-5).flatten(2).transpose(1, 2)
        return torch.cat([x[:, :cls], y], 1) if cls else y

    return ours, hf


def _fns(row, st=1):
    """(ours, torch's) for one row."""
    import torch.nn.functional as F

    from ...ops.attention import attention
    from ...ops.layernorm import layer_norm_tokens
    from ...ops.linear import linear, linear_gelu_aux, mlp

    if row in DW_ROWS:
        return _dw_fns(row, st)
    if row.startswith("attn"):
        return (lambda q, k, v: attention(q, k, v, _attn_scale(q))[0]), _sdpa(row)
    if row == "ln":
        return (lambda x, w, b: layer_norm_tokens(x, w, b, 1e-5),
                lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5))
    if row == "qkv":
        return linear, F.linear
    if row == "fc1":
        return (lambda x, w, b: linear_gelu_aux(x, w, b)[0]), (lambda x, w, b: F.gelu(F.linear(x, w, b)))
    if row == "fc2":
        return linear, (lambda x, w, b, r: F.linear(x, w, b) + r)
    return mlp, (lambda x, w1, b1, w2, b2, r: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) + r)


def _sdpa(row):
    """SDPA on one backend (cuDNN, or flash for ``attn-flash``) on the (B, L, H, D) views, CvT's scale."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if row == "attn-flash" else SDPBackend.CUDNN_ATTENTION

    def peer(q, k, v):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               scale=_attn_scale(q))
        return o.transpose(1, 2)
    return peer


def _attn_scale(q):
    return (q.shape[2] * q.shape[3]) ** -0.5  # CvT: embed_dim ** -0.5, not head_dim ** -0.5


def _work(row, m, c, nbytes, batch=1, st=1, pass_="bwd"):
    """(FLOPs, bytes) of a pass (the backward unless said): 2 GEMMs of 2*m*n*k per Linear;
    LayerNorm reads x, dy, writes dx; attention's backward: 2.5x the forward's 4*B*H*Lq*Lkv*D; the
    conv projection reads x and writes y (forward), reads x and dy and writes dx (backward), the
    least any implementation moves."""
    if row.startswith("attn"):
        heads, lq, lkv = ATTN[next(st for st, (_, ch) in STAGES.items() if ch == c)]
        return 10 * batch * heads * lq * lkv * 64, 0
    if row in DW_ROWS:
        side, _, cls, side_out = dw_geometry(row, st)
        n_img = m // STAGES[st][0]
        x_el, y_el = n_img * (cls + side * side) * c, n_img * (cls + side_out * side_out) * c
        moved = x_el + y_el if pass_ == "fwd" else 2 * x_el + y_el
        return 0, nbytes * moved * (2 if pass_ == "fwd+bwd" else 1)
    if row == "ln":
        return 0, nbytes * 3 * m * c
    gemm = {"qkv": c * c, "fc1": 4 * c * c, "fc2": 4 * c * c, "mlp": 8 * c * c}[row]
    return 4 * m * gemm, 0


def _time_pass(torch, pass_: str, peer: tuple, ours: tuple, deterministic: bool = False):
    """Time one pass of PyTorch's step and of ours (each ``(fn, leaves, grad)``; ours under
    torch.use_deterministic_algorithms(True) where ``deterministic``), fallback counters reset
    first: (host-inclusive median ms of the peer, of ours, our GPU ms, the GPU-time speedup (None
    where a capture failed), the GPU-time columns)."""
    fallback.reset()
    t_peer = time_cuda(pass_timer(torch, pass_, *peer), graph=False).median_ms
    g_peer = pass_gpu_ms(torch, pass_, *peer)
    with deterministic_mode(deterministic):
        t_ours = time_cuda(pass_timer(torch, pass_, *ours), graph=False).median_ms
        g_ours = pass_gpu_ms(torch, pass_, *ours)
    if not (g_peer and g_ours):
        return t_peer, t_ours, g_ours, None, {"torch_gpu_ms": "", "cutlass_gpu_ms": "", "gpu_speedup": ""}
    speedup = g_peer / g_ours
    gpu = {"torch_gpu_ms": f"{g_peer:.4f}", "cutlass_gpu_ms": f"{g_ours:.4f}", "gpu_speedup": f"{speedup:.3f}"}
    return t_peer, t_ours, g_ours, speedup, gpu


def _measure(torch, op, row, st, m, c, pass_, dtype, dt, run, batch):
    leaves, g = _inputs(torch, row, m, c, dt, run.gen, batch, st)
    ours, peer = _fns(row, st)
    t_peer, t_ours, g_ours, gpu_speedup, gpu = _time_pass(torch, pass_, (peer, leaves, g), (ours, leaves, g),
                                                          row == "attn-det")
    fb = sum(fallback.stats()["fallbacks"].values())
    flops, nbytes = _work(row, m, c, 2, batch, st, pass_)
    t_rate = g_ours or t_ours  # the rate of the GPU time where it was measured
    rate = f"{flops / t_rate / 1e9:.0f} TFLOP/s" if flops else f"{nbytes / t_rate / 1e6:.0f} GB/s"
    goal = GOALS[op] if pass_ == "bwd" or op == "dwconv" else None
    speed = t_peer / t_ours

    def met(x):
        return "" if goal is None or x is None else ("yes" if x >= goal else "NO")

    return {**run.row, "op": op, "case": f"s{st}.{row}", "pass": pass_, "dtype": dtype, "batch": batch, "m": m,
            "c": c, "torch_ms": f"{t_peer:.4f}", "cutlass_ms": f"{t_ours:.4f}", "speedup": f"{speed:.3f}", **gpu,
            "rate": rate if pass_ == "bwd" or op == "dwconv" else "", "goal": "" if goal is None else f">={goal}x",
            "met": met(speed), "met_gpu": met(gpu_speedup), "fallbacks": fb}


def _breakdown(torch, st, m, c, dtype, dt, run, batch):
    """Our MLP backward GEMMs one by one (CUDA-graph replays): fc2 wgrad (dW2, db2), fc2 dgrad
    times the saved GELU' with db1, fc1 wgrad, fc1 dgrad."""
    from ...ops.linear import linear_dgrad, linear_wgrad

    x, w1, _, w2, _, _ = (t.detach() for t in _inputs(torch, "mlp", m, c, dt, run.gen)[0])
    g = torch.randn(m, c, device="cuda", generator=run.gen).to(dt)
    hidden = torch.randn(m, 4 * c, device="cuda", generator=run.gen).to(dt)
    dgelu = torch.rand(m, 4 * c, device="cuda", generator=run.gen).half()  # fc1's saved GELU derivative
    calls = {"wgrad2+db2": lambda i: linear_wgrad(g, hidden, True),
             "dgrad2+dgelu+db1": lambda i: linear_dgrad(g, w2, gelu_grad=dgelu),
             "wgrad1": lambda i: linear_wgrad(hidden, x, False), "dgrad1": lambda i: linear_dgrad(hidden, w1)}
    rows = []
    for name, fn in calls.items():
        ms = time_cuda(fn).median_ms
        tflops = 2 * m * c * 4 * c / ms / 1e9
        rows.append({**run.row, "op": "kernel", "case": f"s{st}.mlp/{name}", "pass": "bwd", "dtype": dtype,
                     "batch": batch, "m": m, "c": c, "torch_ms": "", "cutlass_ms": "", "speedup": "",
                     "cutlass_gpu_ms": f"{ms:.4f}", "rate": f"{tflops:.0f} TFLOP/s",
                     "goal": "", "met": "", "fallbacks": ""})
    return rows


def _ln_breakdown(torch, st, m, c, dtype, dt, run, batch):
    """LayerNorm backward's GPU time alone (CUDA-graph replays, no autograd or host time): our
    kernel vs aten's native_layer_norm_backward from the same saved statistics."""
    from ...ops.layernorm import layer_norm_tokens_backward

    (x, w, b), g = _inputs(torch, "ln", m, c, dt, run.gen, batch)
    x, w, b = x.detach(), w.detach(), b.detach()
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, (c,), w, b, 1e-5)
    t_peer = time_cuda(lambda i: torch.ops.aten.native_layer_norm_backward(
        g, x, (c,), mean, rstd, w, b, [True, True, True])).median_ms
    t_ours = time_cuda(lambda i: layer_norm_tokens_backward(g, x, w, 1e-5)).median_ms
    nbytes = 2 * 3 * m * c
    return [{**run.row, "op": "kernel", "case": f"s{st}.ln/gpu-only", "pass": "bwd", "dtype": dtype, "batch": batch,
             "m": m, "c": c, "torch_ms": "", "cutlass_ms": "", "speedup": "", "torch_gpu_ms": f"{t_peer:.4f}",
             "cutlass_gpu_ms": f"{t_ours:.4f}", "gpu_speedup": f"{t_peer / t_ours:.3f}", "rate": f"{nbytes / t_ours / 1e6:.0f} GB/s", "goal": "", "met": "",
             "fallbacks": ""}]


HEADER = ("| op | case | pass | dtype | torch ms | ours ms | ratio | torch GPU ms | ours GPU ms | GPU ratio | rate | "
          "goal | met (eager / GPU) | fallbacks |")


def _print(r):
    g = r.get
    print(f"| {r['op']} | {r['case']} | {r['pass']} | {r['dtype']} | {r['torch_ms']} | {r['cutlass_ms']} | "
          f"{r['speedup']} | {g('torch_gpu_ms', '')} | {g('cutlass_gpu_ms', '')} | {g('gpu_speedup', '')} | "
          f"{r['rate']} | {r['goal']} | {r['met']}{' / ' + g('met_gpu', '') if r['met'] else ''} | "
          f"{r['fallbacks']} |", flush=True)


def _prebuild(a, run) -> None:
    specs = [s for b in a.batch for d in a.dtype
             for s in kernel_specs(a.op, b, d, run.arch, run.dev.name, a.model, a.image_size)]
    print(f"[bench {a.op}] compiling what is missing of {len(specs)} kernels", flush=True)
    runtime.prebuild(list({s.name: s for s in specs}.values()), run.dev.cc, binding=True)


def bench_main(a) -> int:
    import torch

    run = start(a)
    if run is None:
        return 2
    _prebuild(a, run)
    print(HEADER)
    print("|---" * HEADER.count(" | ") + "|---|")
    rows = []
    for batch in a.batch:
        for dtype in a.dtype:
            if a.op == "conv":
                for layer in conv_layers(a.model, batch, a.image_size):
                    for pass_ in a.passes:
                        for cl in (False, True):
                            rows.append(_measure_conv(torch, layer, pass_, dtype, run.torch_dtype[dtype], run, batch, cl))
                            _print(rows[-1])
                continue
            for row, st, m, c in cases(a.op, batch):
                for pass_ in a.passes:
                    rows.append(_measure(torch, a.op, row, st, m, c, pass_, dtype, run.torch_dtype[dtype], run, batch))
                    _print(rows[-1])
                extra = {"mlp": _breakdown, "ln": _ln_breakdown}.get(row) if a.breakdown else None
                if extra:
                    for r in extra(torch, st, m, c, dtype, run.torch_dtype[dtype], run, batch):
                        rows.append(r)
                        _print(r)
    if a.out:
        append_csv(a.out, rows, list(rows[0]))
    return 0
