"""Do kernels compile to the same device code at two revisions? (No GPU needed.)

    python .ci/sass_diff.py --rev f36b67b cvt_linear_fwd_sm90a_f16_tn_bias_t128x64x64_c1x1x1_sauto_coop_rh1_a8 ...
    python .ci/sass_diff.py --rev f36b67b --names-from names.txt --jobs 2

For each kernel name: the source the revision ``--rev`` emits (its tree exported by ``git archive``
and imported as an installed package) and the source the working tree emits, each compiled with
nvcc to a cubin for the kernel's own target (sm_90a / sm_89) with the build's flags, then
``cuobjdump -sass``. Every function's instructions are compared with addresses stripped and
function names ignored: ``same SASS``. Where they differ, the PTX is compared with every mangled
symbol name replaced by one placeholder: ``same PTX`` means the front end produced the same
program and only the names differ (a kernel that became a template: ptxas may then number
registers and order instructions differently, as symbol names feed its choices). Prints one line
per kernel and exits 1 if any kernel differs in its PTX.
Needs ``cuobjdump`` on PATH (or in $CUOBJDUMP): a CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump
(its nvidia/cu13/bin/cuobjdump).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_DROP = ("-shared", "-cudart=shared", "--resource-usage", "-Xcompiler=-fPIC,-fvisibility=hidden")

# Run inside the exported old tree: emit each name's source and say how to compile it.
_OLD_EMIT = r"""
import json, sys
from pathlib import Path
from cvt_cutlass import build
from cvt_cutlass.emitter import kernel_source
from cvt_cutlass.operators.spec import parse_kernel_name
out = Path(sys.argv[1]); plans = {}
for name in sys.argv[2:]:
    spec = parse_kernel_name(name)
    (out / f"{name}.cu").write_text(kernel_source(spec))
    plans[name] = {"target": build.target_for(spec.arch), "includes": list(getattr(spec, "include_dirs", ())),
                   "csrc": str(build.CSRC), "operators": str(build.OPERATORS)}
for h in build.CSRC.glob("*.h"):
    (out / h.name).write_text(h.read_text())
print(json.dumps(plans))
"""


def export_revision(rev: str, dest: Path) -> Path:
    """The revision's files as an installed package would lay them out (operators/, epilogues/
    and profiles/ inside cvt_cutlass/); returns the directory to put on sys.path."""
    tree = dest / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    site = dest / "site"
    shutil.copytree(tree / "cvt_cutlass", site / "cvt_cutlass")
    for sub in ("operators", "epilogues", "profiles"):
        if (tree / sub).is_dir():
            shutil.copytree(tree / sub, site / "cvt_cutlass" / sub, dirs_exist_ok=True)
    return site


def old_sources(rev: str, names: list[str], work: Path) -> dict:
    site = export_revision(rev, work / "old")
    out = work / "old_src"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", _OLD_EMIT, str(out), *names], env=env, cwd=work,
                          capture_output=True, text=True, check=True)
    plans = json.loads(proc.stdout.strip().splitlines()[-1])
    return {n: (out / f"{n}.cu", p["target"], _old_includes(p, out)) for n, p in plans.items()}


def _old_includes(plan: dict, src_dir: Path) -> list[str]:
    from cvt_cutlass import build

    flags = [f"-I{d}" for d in build.cutlass_include_dirs()] + [f"-I{src_dir}", f"-I{plan['operators']}"]
    for d in plan["includes"]:
        if d.startswith("csrc:"):
            flags.append(f"-Xcompiler=-idirafter,{Path(plan['csrc']) / d[5:]}")
        elif d.startswith("operators:"):
            flags.append(f"-Xcompiler=-idirafter,{Path(plan['operators']) / d[10:]}")
        else:
            flags.append(f"-I{build.cutlass_source_dir() / d}")
    return flags


def new_sources(names: list[str], work: Path) -> dict:
    from cvt_cutlass.operators.spec import parse_kernel_name

    from cvt_cutlass import build
    from cvt_cutlass.emitter import kernel_source

    out = work / "new_src"
    out.mkdir()
    plans = {}
    for name in names:
        spec = parse_kernel_name(name)
        src = out / f"{name}.cu"
        src.write_text(kernel_source(spec))
        job = build.KernelBuild(name, build.target_for(spec.arch), "", "", out, tuple(spec.include_dirs))
        cmd = build._nvcc_command(job, "nvcc", src, out / "x")
        flags = [c for c in cmd if c.startswith(("-I", "-Xcompiler=-idirafter"))]
        plans[name] = (src, build.target_for(spec.arch), flags)
    return plans


def compile_sass(src: Path, target: str, flags: list[str]) -> dict[str, list[str]] | str:
    """{function name: normalised instructions}, or the compiler's error text."""
    from cvt_cutlass import build

    cubin = src.with_suffix(".cubin")
    cmd = ["nvcc", *[f for f in build.NVCC_FLAGS if f not in _DROP], build.gencode(target), "-cubin", *flags,
           "-o", str(cubin), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return proc.stderr[-3000:]
    ptx = subprocess.run([*cmd[:cmd.index("-cubin")], "-ptx", *flags, "-o", str(src.with_suffix(".ptx")), str(src)],
                         capture_output=True, text=True)
    if ptx.returncode:
        return ptx.stderr[-3000:]
    sass = subprocess.run([os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        ins = re.sub(r"/\*[0-9a-fx]+\*/", "", line).strip()
        if cur is not None and ins and not ins.startswith(("..", ".section", ".text")):
            cur.append(re.sub(r"\s+", " ", ins))
    funcs[" ptx"] = _ptx_blocks(src.with_suffix(".ptx").read_text())
    return funcs


def _ptx_blocks(ptx: str) -> list[str]:
    """The PTX's top-level blocks (entries, functions, globals) with mangled names replaced by one
    placeholder, sorted: equal lists mean the same program up to names."""
    text = re.sub(r"_Z[\w$]+", "SYM", ptx)
    text = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("//"))
    return sorted(re.split(r"\n(?=\.(?:visible |weak |extern )?(?:\.entry|\.func|\.global|\.shared|\.const))", text))


def compare(old, new, show: bool = False) -> str:
    if isinstance(old, str) or isinstance(new, str):
        return "COMPILE ERROR\n" + (old if isinstance(old, str) else new)
    old_ptx, new_ptx = old.pop(" ptx"), new.pop(" ptx")
    a, b = sorted(map(tuple, old.values())), sorted(map(tuple, new.values()))
    if a == b:
        return f"same SASS ({len(a)} functions, {sum(map(len, a))} instructions)"
    if old_ptx == new_ptx:
        return f"same PTX, renamed symbols ({len(a)} functions)"
    out = f"DIFFERS: old {len(a)} functions {sum(map(len, a))} instructions, new {len(b)} / {sum(map(len, b))}"
    if show:
        only_old = [f for f, body in old.items() if tuple(body) not in set(b)]
        only_new = [f for f, body in new.items() if tuple(body) not in set(a)]
        out += f"\n  only in old: {only_old}\n  only in new: {only_new}"
        if only_old and only_new:
            diff = difflib.unified_diff(old[only_old[0]], new[only_new[0]], lineterm="", n=2)
            out += "\n" + "\n".join(list(diff)[:60])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--rev", required=True, help="the revision to compare the working tree with")
    ap.add_argument("--names-from", help="a file with one kernel name per line")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--show", action="store_true", help="print the first differing function's diff")
    a = ap.parse_args()
    names = list(a.names) + (Path(a.names_from).read_text().split() if a.names_from else [])
    with tempfile.TemporaryDirectory(prefix="sass_diff_") as tmp:
        work = Path(tmp)
        old, new = old_sources(a.rev, names, work), new_sources(names, work)
        with cf.ThreadPoolExecutor(a.jobs) as pool:
            futs = {n: (pool.submit(compile_sass, *old[n]), pool.submit(compile_sass, *new[n])) for n in names}
            bad = same_sass = 0
            for n in names:
                verdict = compare(futs[n][0].result(), futs[n][1].result(), a.show)
                bad += not verdict.startswith("same")
                same_sass += verdict.startswith("same SASS")
                print(f"{n}: {verdict}", flush=True)
    print(f"{len(names)} kernels: {same_sass} same SASS, {len(names) - bad - same_sass} same PTX up to symbol names, "
          f"{bad} different")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
