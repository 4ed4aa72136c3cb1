#!/usr/bin/env bash
# The eager step's host time (.ci/host_breakdown.py) of two versions of the package on one machine,
# alternated (old, new, old, new) so that drift of the host hits both alike:
#   bash .ci/host_ab.sh OLD_TREE [batches] [rounds]
# OLD_TREE: a checkout (or `git archive` of) the other version; this tree is "new". Each version's
# torch binding builds on first import (into CVT_CUTLASS_CACHE, keyed by its source).
set -uo pipefail
old=$1; batches=${2:-32,128}; rounds=${3:-2}
new=$PWD
for r in $(seq "$rounds"); do
  for v in old new; do
    tree=$old; [ $v = new ] && tree=$new
    echo "=== $v (round $r)"
    ( cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" python3 "$new/.ci/host_breakdown.py" "$batches" 8 ) 2>&1 \
      | grep -E "^\||bare launch" | grep -v "^|---"
  done
done
