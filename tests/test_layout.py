"""The layout's rules, checked on the source tree (CPU, no compiler): the library's modules import
in one direction (no circle, counting imports inside functions too), no module imports another's
private names, no function is longer than 80 lines, no CUDA kernel lives in a Python string, and
the product states facts, not run labels or issue numbers.

    python -m tests.test_layout    # prints the figures these tests bound
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {"cvt_cutlass": "cvt_cutlass", "operators": "cvt_cutlass.operators", "epilogues": "cvt_cutlass.epilogues"}
MAX_LINES = 80  # a function longer than this does not fit on a screen
LABEL = re.compile(r"\b[Ii]ssues? #?\d+\b|\b[Rr]uns? [HBCMADG]\d{1,2}[a-z]?\b|\([HBCMADG]\d{1,2}[a-z]?\)|\b[Ii]n progress\b")


def modules() -> dict[str, Path]:
    """{dotted module name: file} of the installed package's Python files."""
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> modules of ours it imports, anywhere in its body; "module: name" of every private
    name one module imports from another)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, is_pkg, node)
                targets = [(f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src, a.name) for a in node.names]
            else:
                continue
            for target, name in targets:
                hit = next((m for m in sorted(mods, key=len, reverse=True) if target == m or target.startswith(m + ".")),
                           None)
                if hit and hit != mod:
                    edges[mod].add(hit)
                    if name and name.startswith("_") and not name.startswith("__") and hit not in mods.get(name, ""):
                        private.append(f"{mod}: {hit}.{name}")
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def long_functions(files, limit: int = MAX_LINES) -> list[str]:
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def python_files() -> list[Path]:
    return sorted(f for d in (*PACKAGES, "tests", ".ci") for f in (ROOT / d).rglob("*.py"))


def labelled_lines() -> list[str]:
    files = python_files() + [ROOT / "README.md"] + sorted((ROOT / "operators").rglob("*.cuh"))
    return [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for f in files
            for i, line in enumerate(f.read_text().splitlines(), 1) if LABEL.search(line)]


def test_no_import_circle():
    edges, _ = imports(modules())
    assert cycles(edges) == []


def test_no_module_imports_another_modules_private_names():
    _, private = imports(modules())
    assert private == []


def test_functions_fit_on_a_screen():
    assert long_functions(python_files()) == []


def test_no_cuda_kernel_in_a_python_string():
    """No CUDA kernel definition in any Python file (its pattern: tests/data/cuda_kernel_definition.regex):
    kernels live in operators/*/*.cuh; the pattern matches a header's kernels."""
    from .conftest import KERNEL_DEFINITION

    assert KERNEL_DEFINITION.search((ROOT / "operators" / "dwconv" / "dwbn_fwd.cuh").read_text())
    assert [str(f.relative_to(ROOT)) for f in python_files() if KERNEL_DEFINITION.search(f.read_text())] == []


def test_the_product_states_facts_not_run_labels():
    assert labelled_lines() == []


def test_the_library_never_imports_the_tooling_or_the_cli():
    edges, _ = imports(modules())
    upward = [f"{m} -> {t}" for m, ts in edges.items() for t in ts
              if not m.startswith(("cvt_cutlass.tools", "cvt_cutlass.cli"))
              and t.startswith(("cvt_cutlass.tools", "cvt_cutlass.cli"))]
    assert upward == []


def _pyproject() -> dict:
    tomllib = __import__("pytest").importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _glob_match(rel: Path, pattern: str) -> bool:
    """``rel`` is one of the files setuptools' package-data glob ``pattern`` takes (``*`` within
    one path part, as glob)."""
    parts = Path(pattern).parts
    return len(rel.parts) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(rel.parts, parts, strict=True))


def _installed_name(folder: Path) -> str:
    top = folder.relative_to(ROOT).parts
    return ".".join([PACKAGES[top[0]], *top[1:]])


def test_the_wheel_carries_every_package_and_kernel_header():
    """pyproject's package list names every folder with an __init__.py or a header, C++ source or
    selection table (setuptools warns of data folders it is not told about), and its package-data
    globs every such file in its folder's package (a missing one works in an editable install and
    fails from a wheel)."""
    cfg = _pyproject()
    files = [f for d in PACKAGES for f in (ROOT / d).rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    data_files = [f for f in files if f.suffix in (".h", ".cuh", ".hpp", ".cpp", ".csv")]
    folders = {f.parent for f in files if f.name == "__init__.py"} | {f.parent for f in data_files}
    assert sorted(_installed_name(f) for f in folders) == sorted(cfg["packages"])
    data = cfg["package-data"]
    missing = [str(f.relative_to(ROOT)) for f in data_files
               if not any(_glob_match(Path(f.name), g) for g in data.get(_installed_name(f.parent), []))]
    assert missing == []


# Kernels launched plainly with <<<>>> (never with programmatic dependent launch): CUTLASS's own,
# which do not start with griddepcontrol.wait, and the column / row sums and dbias rounding that
# every Linear library includes (common/reduce.cuh, linear/dgrad_sm80.cuh).
PLAIN_LAUNCHES = {"attention/ex41_fwd.cuh": 1, "common/reduce.cuh": 4, "conv2d/sm80_conv.cuh": 1,
                  "linear/dgrad_sm80.cuh": 1}
CUDA_SUFFIXES = (".cuh", ".cu", ".h", ".hpp")


def _code(text: str) -> str:
    """CUDA source without its comments (block comments and // to the end of a line)."""
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def _kernel_bodies(text: str):
    """(name, start of body) of each __global__ function defined in comment-free CUDA source."""
    for m in re.finditer(r"__global__\b", text):
        pos = m.end()
        while True:  # the parameter list: the first '(' not of __launch_bounds__
            p = text.index("(", pos)
            name = re.search(r"(\w+)\s*$", text[:p]).group(1)
            depth, q = 0, p
            while True:
                depth += {"(": 1, ")": -1}.get(text[q], 0)
                if depth == 0:
                    break
                q += 1
            if name != "__launch_bounds__":
                break
            pos = q + 1
        brace = text.index("{", q)
        yield name, text[brace + 1 : brace + 400]


def test_every_kernel_of_ours_waits_for_its_predecessor_before_touching_memory():
    """operators/common/pdl.cuh: a kernel launched with programmatic dependent launch may start
    while the one before it still runs, so every kernel launched through launch_kernel must be a
    kernel defined under operators/ (named in the call, not through a variable) that begins with
    pdl_enter() (griddepcontrol.wait); every other launch is a plain one, listed; nothing else sets
    the launch attribute."""
    ops = ROOT / "operators"
    launched, plain, begins, attr = set(), {}, {}, []
    for f in sorted(p for p in ops.rglob("*") if p.suffix in CUDA_SUFFIXES):
        rel, text = str(f.relative_to(ops)), _code(f.read_text())
        if rel != "common/pdl.cuh":  # (the helper's own definition and its use of the attribute)
            launched |= {m.group(1) for m in re.finditer(r"launch_kernel\(\s*(?:\w+::)*(\w+)", text)}
            attr += [rel] * ("ProgrammaticStreamSerialization" in text)
        if text.count("<<<"):
            plain[rel] = text.count("<<<")
        for name, body in _kernel_bodies(text):
            assert name not in begins, f"two kernels named {name}: the check would confuse them"
            begins[name] = body.lstrip().startswith("pdl_enter();")
    assert plain == PLAIN_LAUNCHES
    assert attr == []
    assert launched <= set(begins), f"launched through launch_kernel but not a kernel defined here: {launched - set(begins)}"
    assert sorted(n for n in launched if not begins[n]) == []
    assert len(launched) == 24, sorted(launched)


if __name__ == "__main__":
    e, p = imports(modules())
    print("import circles:", cycles(e))
    print("private-name imports:", len(p), *p, sep="\n  ")
    print(f"functions over {MAX_LINES} lines:", *long_functions(python_files()), sep="\n  ")
    print("functions over 60 lines:", len(long_functions(python_files(), 60)))
    print("run labels:", *labelled_lines(), sep="\n  ")
