#!/usr/bin/env bash
# One command on a GPU machine (torch + triton preinstalled, no network, no pip install):
# the environment report, the GPU tests, and every bench suite in quick mode. Logs and
# result files go to OUTDIR; the last lines are a short pass/fail and speed summary.
#
#   scripts/gpu-check.sh [OUTDIR]          (default: out/gpu-check)
#
# The whole check takes longer than one 10-minute GPU session call; split it with
#   FUSEML_TESTS="tests/ops tests/nn"   pytest paths of the GPU tests ("none": skip them)
#   FUSEML_SUITES="linear mlp"          bench suites to run ("none": skip them)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0

echo "== fuseml env" | tee "$OUT/env.txt"
"$PY" -m fuseml.cli env 2>&1 | tee -a "$OUT/env.txt" || status=1

tests="${FUSEML_TESTS:-tests}"
if [ "$tests" != "none" ]; then
    echo "== GPU tests ($tests)" | tee "$OUT/tests.txt"
    # shellcheck disable=SC2086  # a list of paths
    "$PY" -m pytest -q -m gpu -n "${FUSEML_TEST_WORKERS:-8}" -rf $tests 2>&1 | tee -a "$OUT/tests.txt"
    tests_rc=${PIPESTATUS[0]}
    [ "$tests_rc" -eq 0 ] || status=1
fi

# FUSEML_SUITES="a b" limits the suites (default: every suite).
suites="${FUSEML_SUITES:-$("$PY" -c "from fuseml.bench.suites import SUITES; print(' '.join(SUITES))")}"
[ "$suites" = "none" ] && suites=""
for suite in $suites; do
    echo "== bench $suite (quick)" | tee "$OUT/bench-$suite.txt"
    "$PY" -m fuseml.cli bench "$suite" --quick --out "$OUT/results" 2>&1 \
        | tee -a "$OUT/bench-$suite.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo "== summary" | tee "$OUT/summary.txt"
if [ -f "$OUT/tests.txt" ]; then
    grep -E "passed|failed|error" "$OUT/tests.txt" | tail -1 | sed 's/^/tests: /' | tee -a "$OUT/summary.txt"
fi
"$PY" -m fuseml.bench.summary "$OUT/results" 2>&1 | tee -a "$OUT/summary.txt"
echo "gpu-check: $([ $status -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$OUT/summary.txt"
exit $status
