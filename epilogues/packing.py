"""Trace an epilogue into CUTLASS EVT C++ and pack its arguments from the kernel ABI.

``trace_linear_epilogue(epi, dtype, arch)`` returns the fusion-callback type declarations that
cutlass_cppgen emits for the traced function, the name of the root callback type, and a C++
brace-initializer for that callback's ``Arguments``, written in terms of the ``cvt_gemm_args p``
fields (``p.bias``, ``p.c``/``p.ldc``, ``p.aux``/``p.ldaux``, ``p.d``/``p.ldd``).

The initializer mirrors the visitor tree: an EVT node's arguments are ``{child..., own}`` (the
order in which CUTLASS's ``Sm90EVT`` / ``Sm80EVT`` hold them), a leaf's are its own.
Needs no GPU: cutlass_cppgen is told the compute capability instead of asking a device.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass

from . import EpilogueDef

_EVT_CC = {89: 80, 90: 90}  # cutlass_cppgen's EVT backends: Sm80 (2.x kernels) and Sm90
_TRACE_LOCK = threading.Lock()  # the tracer keeps global state

# What each named tensor is in the kernel ABI: (pointer field, leading-dimension field).
_ABI_FIELDS = {"bias": ("bias", None), "C": ("c", "ldc"), "Z": ("aux", "ldaux"), "G": ("aux", "ldaux"),
               "D": ("d", "ldd"), "rs": ("row_scale", None)}


@dataclass(frozen=True)
class TracedEpilogue:
    fusion_decl: str  # C++ type declarations of the visitor nodes
    fusion_callbacks: str  # root callback type name
    fusion_args: str  # brace-initializer of the root's Arguments
    reads_c: bool  # the epilogue reads C (the residual); otherwise ElementC is void
    epilogue_stages: int  # SM80-class visitor epilogue stages (1 for ours)


def _example_tensors(epi: EpilogueDef, dtype: str, residual: str = ""):
    """Tensors of the epilogue's operands for the tracer: 16-bit in ``dtype``, the residual C in
    fp32 where ``residual`` is "f32" or "f32in", and the stores too where it is "f32"; GELU's
    derivative (a forward's store G, a dgrad's saved C) in fp16."""
    import torch

    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    sdt = torch.float32 if residual == "f32" else tdt  # the stores
    cdt = torch.float32 if residual in ("f32", "f32in") else tdt  # the residual
    if epi.activation == "dgelu_saved":
        cdt = torch.float16
    m, n = 256, 128  # only ranks and broadcast patterns matter to the tracer
    ex = {"accum": torch.empty(m, n, dtype=torch.float32)}
    for name in inspect.signature(epi.fn).parameters:
        if name == "accum":
            continue
        if name == "bias":
            ex[name] = torch.empty(1, n, dtype=tdt)
        elif name == "C":
            ex[name] = torch.empty(m, n, dtype=cdt)
        elif name == "rs":
            ex[name] = torch.empty(m, 1, dtype=torch.float32)
        else:
            raise ValueError(f"epilogue {epi.name}: unknown operand {name!r}")
    for name in epi.stores:
        ex[name] = torch.empty(m, n, dtype=torch.float16 if name == "G" else sdt)
    return ex


def _import_cppgen():
    """Import cutlass_cppgen without leaving its sqlite cache file in the caller's directory.

    Importing it creates ./compiled_cache.db (its own JIT cache, which we never use) and closes
    the connection; remove the file again if it was not there before the import (another process
    in the same directory may have removed it first).
    """
    import os
    import sys

    if "cutlass_cppgen" in sys.modules:
        return sys.modules["cutlass_cppgen"]
    stray = os.path.abspath("compiled_cache.db")
    existed = os.path.exists(stray)
    import cutlass_cppgen

    if not existed:
        try:  # processes started in one directory (torchrun) race for it: the first removes it
            os.remove(stray)
        except FileNotFoundError:
            pass
    return cutlass_cppgen


@functools.cache
def trace_linear_epilogue(epi: EpilogueDef, dtype: str, arch: int, residual: str = "") -> TracedEpilogue:
    """The EVT of ``epi`` for 16-bit ``dtype`` operands on ``arch`` (C and D in fp32 where
    ``residual`` is "f32", C alone where it is "f32in")."""
    cutlass_cppgen = _import_cppgen()
    from cutlass_cppgen.backend.evt.backend.emitter_base import FusionCallbacks

    cc = _EVT_CC[arch]
    with _TRACE_LOCK:
        visitor = cutlass_cppgen.epilogue.trace(epi.fn, _example_tensors(epi, dtype, residual), cc=cc)
        # Sm90: C and D belong to the collective epilogue (shared-memory reuse), Sm80: they are
        # ordinary aux load/store nodes of the tree.
        decl, root = FusionCallbacks(visitor.dag_ir, cc, emit_CD=(cc < 90)).emit()
        dag = visitor.dag_ir
        _check_traced(dag, epi)
        if cc >= 90:
            root_node = dag.get_all_inputs("D")[0]
        else:
            root_node = dag.node_metas_topological_order()[-1].name
        args = _initializer(dag, root_node, cc)
        stages = int(getattr(visitor, "epilogue_stages", 1) or 1)
    if epi.activation == "dgelu":
        decl = _dgelu(decl)
    if epi.activation in ("dgelu", "dgelu_saved") and epi.reduces:
        decl, root, args = _with_dbias(decl, root, args, dtype, cc)
    if epi.saves_dgelu:
        decl = _saved_dgelu(decl, cc)
    return TracedEpilogue(
        fusion_decl=decl.strip("\n"),
        fusion_callbacks=root,
        fusion_args=args,
        reads_c="C" in epi.operands,
        epilogue_stages=stages,
    )


_PLACEHOLDER = "cutlass::epilogue::thread::Sigmoid"
_ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}  # what the tracer writes for D's dtype


def _dgelu(decl: str) -> str:
    """The traced placeholder made into the exact GELU derivative (DGeluErf, from the dgrad template)."""
    if decl.count(_PLACEHOLDER) != 1:
        raise TraceMismatch(f"dgelu: expected one {_PLACEHOLDER} placeholder in the traced tree")
    return decl.replace(_PLACEHOLDER, "DGeluErf")


def _saved_dgelu(decl: str, cc: int) -> str:
    """The traced ``G = accum + bias; D = gelu(G)`` made into the training forward that saves
    GELU's derivative: the G store node stores DGeluErf of its value (linear/mapped_store.cuh) and
    passes the value on, and the GELU is ``GeluErf``, computed from the same parts (the compiler
    shares them: linear/dgelu.cuh)."""
    store = {90: "cutlass::epilogue::fusion::Sm90AuxStore<",
             80: "cutlass::epilogue::threadblock::VisitorAuxStore<"}[cc]
    head = f"using G = {store}"
    gelu = "cutlass::epilogue::thread::GELU,"
    if decl.count(head) != 1 or decl.count(gelu) != 1:
        raise TraceMismatch(f"bias_gelu_dgelu: expected one {head!r} node and one {gelu!r} node")
    start = decl.index(head)
    end = decl.index(">;", start)
    mapped = f"using G = Sm{cc}MappedAuxStore<DGeluErf, {store}" + decl[start + len(head):end] + ">>;"
    return (decl[:start] + mapped + decl[end + 2:]).replace(gelu, "GeluErf,")


def _with_dbias(decl: str, root: str, args: str, dtype: str, cc: int) -> tuple[str, str, str]:
    """The dgrad's ``accum * GELU'`` (GELU' computed at the saved Z, as cuBLASLt's DGELU_BGRAD, or
    read as the forward saved it) with a row reduction of its result on top: dbias (written to
    ``p.aux``).

    SM90: CUTLASS's Sm90RowReduction, non-atomic and without its final pass: one fp32 partial row
    per M-tile into ``p.bias`` (a workspace buffer), which the dgrad launcher sums per column in
    fixed order into p.aux, so dbias is deterministic and needs no zeroing. Its per-element
    out-of-bounds predication is off (VisitCheckOOB = false): what it reduces outside the problem is
    exactly 0 (TMA zero-fills the out-of-bounds A rows, B columns and Z, so the accumulator there is
    0 and 0 * GELU'(0) = 0), and the predicated path costs coordinate compares on every element of
    an epilogue that the cooperative schedule does not overlap with the mainloop. The product
    ``accum * GELU'(Z)`` stays fp32 into the reduction (rounded to D's dtype only by the store):
    CUTLASS's unpredicated reduction path converts its input as fp32 fragments, and dbias from the
    unrounded product is the more exact sum. SM80-class: the
    row-reduction visitor adds with fp32 atomics into ``p.bias``, a workspace buffer the dgrad
    launcher zeroes and rounds into p.aux.
    """
    if cc >= 90:
        product = f"cutlass::multiplies, {_ELEMENT[dtype]}, float,"
        if decl.count(product) != 1:
            raise TraceMismatch(f"dbias: expected one {product!r} node (accum * GELU'(Z))")
        decl = decl.replace(product, "cutlass::multiplies, float, float,")
        decl += f"""

using DBias = cutlass::epilogue::fusion::Sm90RowReduction<
    cutlass::plus, cutlass::plus, cutlass::plus, 0, typename EpilogueDescriptor::TileShape,
    float, float, cutlass::FloatRoundStyle::round_to_nearest, cute::Stride<cute::_0, cute::_1, cute::_0>,
    /*Alignment=*/4, /*EnableNullptr=*/true, /*FinalReduction=*/false, /*VisitCheckOOB=*/false>;

using EVTDBias = cutlass::epilogue::fusion::Sm90EVT<DBias, {root}>;"""
        own = "{const_cast<void*>(p.bias), 0.f, {}}"
    else:
        decl += f"""

using DBias = cutlass::epilogue::threadblock::VisitorRowReduction<
    cutlass::plus, cutlass::atomic_add, OutputTileThreadMap, float, float,
    cutlass::FloatRoundStyle::round_to_nearest>;

using EVTDBias = cutlass::epilogue::threadblock::Sm80EVT<DBias, {root}>;"""
        own = "{static_cast<float*>(const_cast<void*>(p.bias)), 0.f, {}}"
    return decl, "EVTDBias", "{" + args + ", " + own + "}"


class TraceMismatch(RuntimeError):
    """The traced visitor tree is not the epilogue its definition declares."""


def _check_traced(dag, epi: EpilogueDef) -> None:
    """The traced tree must read exactly accum + the declared operands, store exactly the declared
    outputs, and apply GELU iff declared.

    The tracer parses the function's source from disk (inspect.getsource): if epilogues/linear.py
    changed under a running process, it reads the wrong lines and traces another function. The
    kernel would then carry this epilogue's name and another's code; refuse to emit it.
    """
    loads, stores, acts = set(), set(), []
    for name in dag.nodes_topological_order():
        meta = dag.get_node_meta(name)
        op = getattr(meta, "op", None)
        if op == "load":
            loads.add(name)
        elif op == "store":
            stores.add(name)
        elif op == "compute":
            acts.append(str(meta.fn).lower())
    gelu = any("gelu" in a for a in acts)
    want_gelu = epi.activation == "gelu"
    placeholder = any("sigmoid" in a for a in acts)
    if (loads != {"accum", *epi.operands} or stores != set(epi.stores) or gelu != want_gelu
            or placeholder != (epi.activation == "dgelu")):
        raise TraceMismatch(
            f"tracing epilogue {epi.name!r} gave loads {sorted(loads)}, stores {sorted(stores)}, "
            f"ops {acts}; it declares operands {epi.operands}, stores {epi.stores}, activation "
            f"{epi.activation!r}. Was {epi.fn.__code__.co_filename} edited while this process ran? "
            "Restart it."
        )


def _initializer(dag, node: str, cc: int) -> str:
    from cutlass_cppgen.backend.evt.ir import TopoVisitorNode

    meta = dag.get_node_meta(node)
    if isinstance(meta, TopoVisitorNode):
        raise NotImplementedError(
            f"epilogue node {node!r} is a DAG (a value used twice without a store); "
            "argument packing handles trees only"
        )
    own = _leaf_initializer(meta, cc)
    children = dag.get_all_inputs(node)
    if not children:
        return own
    inner = ", ".join([_initializer(dag, c, cc) for c in children] + [own])
    return "{" + inner + "}"


def _leaf_initializer(meta, cc: int) -> str:
    from cutlass_cppgen.backend.evt.ir.compute_nodes import ComputeImpl
    from cutlass_cppgen.backend.evt.ir.load_nodes import (
        AccumulatorImpl,
        AuxLoadImpl,
        ColumnBroadcastImpl,
        LoadSrcImpl,
        RowBroadcastImpl,
    )
    from cutlass_cppgen.backend.evt.ir.store_nodes import AuxStoreImpl
    from cutlass_library import DataTypeTag

    impl = meta.underlying_impl
    name = meta.name
    if isinstance(impl, (AccumulatorImpl, ComputeImpl)):
        return "{}"
    if cc >= 90 and isinstance(impl, LoadSrcImpl):
        return "{}"  # Sm90SrcFetch: C comes from the collective epilogue's arguments
    if name not in _ABI_FIELDS:
        raise ValueError(f"epilogue tensor {name!r} has no kernel-ABI field; use one of {list(_ABI_FIELDS)}")
    ptr, ld = _ABI_FIELDS[name]
    elem = DataTypeTag[impl.element]
    if isinstance(impl, (RowBroadcastImpl, ColumnBroadcastImpl)):
        return f"{{static_cast<{elem} const*>(p.{ptr}), {elem}(0), {{}}}}"
    stride = f"{{int64_t(p.{ld}), cute::Int<1>{{}}, cute::Int<0>{{}}}}"
    if isinstance(impl, (AuxLoadImpl, LoadSrcImpl)):
        # Sm80's VisitorAuxLoad takes a non-const pointer; it only reads through it.
        cast = f"const_cast<{elem}*>(static_cast<{elem} const*>(p.{ptr}))"
        return f"{{{cast}, {elem}(0), {stride}}}"
    if isinstance(impl, AuxStoreImpl):
        return f"{{static_cast<{elem}*>(p.{ptr}), {stride}}}"
    raise NotImplementedError(f"epilogue node {name!r} of kind {type(impl).__name__} is not packed yet")
