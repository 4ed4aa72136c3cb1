#!/usr/bin/env bash
# The eager step's host time (.ci/host_breakdown.py) of two versions of the package on one machine,
# alternated (old, new, old, new) so that drift of the host hits both alike:
#   bash .ci/host_ab.sh OLD_TREE [batches] [rounds]
# OLD_TREE: a checkout (or `git archive`) of the other version; this tree is "new". Each is
# installed (no dependencies) into its own folder under /tmp; its torch binding builds on first
# import (into CVT_CUTLASS_CACHE, keyed by its source). The wheels the package needs must already
# be importable (PYTHONPATH).
set -uo pipefail
old=$1; batches=${2:-32,128}; rounds=${3:-2}
for v in old new; do
  src=$old; [ $v = new ] && src=$PWD
  rm -rf /tmp/cvt_ab_$v
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/cvt_ab_$v "$src" \
    > /tmp/cvt_ab_$v.log 2>&1 || { echo "installing $v failed"; tail -5 /tmp/cvt_ab_$v.log; exit 3; }
done
for r in $(seq "$rounds"); do
  for v in old new; do
    echo "=== $v (round $r)"
    ( cd /tmp && PYTHONPATH="/tmp/cvt_ab_$v:${PYTHONPATH:-}" python3 "$OLDPWD/.ci/host_breakdown.py" "$batches" 8 ) 2>&1 \
      | grep -E "^\||bare launch|Error" | grep -v "^|---"
  done
done
