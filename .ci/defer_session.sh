#!/usr/bin/env bash
# One device call for the deferred column sums: build the kernels (every kernel changed with the
# ABI) and return them packed, run the layer op's GPU tests, then the eager step's host time with
# the sums deferred and immediate, alternated. Usage: bash .ci/defer_session.sh [steps: build tests ab absums]
set -uo pipefail
export PYTHONUNBUFFERED=1 CVT_CUTLASS_CACHE=$PWD/.cache/cvt_cutlass
out=${OUT:-/tmp/out}; mkdir -p "$out"
[ -f .carry/cache.tgz ] && tar xzf .carry/cache.tgz
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || exit 3
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
for step in ${*:-build tests ab}; do
  echo "=== $step ($SECONDS s)"
  case $step in
    build)
      python3 .ci/carry_kernels.py --modules ${MODULES:-test_layer} --gpus "$gpu" --jobs 15 > "$out/build.log" 2>&1
      echo "build exit $?"; tail -2 "$out/build.log"; cp .carry/cache.tgz "$out/cache.tgz" ;;
    tests)
      timeout ${TEST_TIMEOUT:-200} python3 -m pytest ${TESTS:-tests/test_layer.py} -v -p no:cacheprovider -k "${TEST_K:-gpu}" \
        > "$out/pytest.log" 2>&1; echo "pytest exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/pytest.log" | tail -8 ;;
    absums)
      python3 .ci/host_breakdown.py ${AB_BATCH:-32,128} ${AB_TRIALS:-10} --ab-sums > "$out/absums.log" 2>&1
      echo "absums exit $?"; grep -E "^\|" "$out/absums.log"; tail -3 "$out/absums.log" | grep -i error ;;
    ab)
      for r in 1 2; do
        for mode in "" --immediate-sums; do
          echo "--- ${mode:-deferred} (round $r)"
          python3 .ci/host_breakdown.py ${AB_BATCH:-32,128} 8 $mode 2>&1 | grep -E "^\|" | grep -v -E "^\|---|zero_grad|optimizer"
        done
      done ;;
  esac
done
