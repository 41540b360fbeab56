#!/usr/bin/env bash
# Usage: scripts/gpu-check.sh [OUTDIR]          (default: out/gpu-check)
#
# One command on a GPU machine (torch + triton preinstalled, no network, no pip install):
# the environment report, the GPU tests, `fuseml demo` (which fails when the optimized
# model's predictions leave the tolerance) and the bench suites in quick mode. Logs and
# result files go to OUTDIR; OUTDIR/gpu-check.txt is the machine-written summary (device,
# torch, triton, commit, test counts, demo, suites; last line PASS or FAIL), committed per
# GPU as benchmarks/gpu-checks/<gpu>.txt (after `python -m fuseml.bench.gpu_check --relabel
# FILE` where the history is whole: a machine whose copy of it is older stamps +dirty).
#
# The GPU tests add up to about 6,400 s of test time (60 workers on a 64-core host), most
# of it compiling kernels, so the CPU count sets the pace. CHECK_GPUS spreads one pytest
# run over several GPUs of the machine (each xdist worker on one of them, round robin:
# tests/gpu_workers.py), so xdist balances the load:
#   CHECK_GPUS=0,1,2,3 CHECK_WORKERS=60 CHECK_SUITES=none scripts/gpu-check.sh OUT
# With several GPUs the demo runs beside the tests, on the last of them (the tests at a
# lower CPU priority, so that the demo's tuning keeps its pace): on a 4-GPU H200 host
# every GPU test (2,114) and the demo took 4.5 minutes.
# Without enough GPUs, run parts (CHECK_TESTS) in separate calls and summarize them (the
# parts keep the device and commit they ran on, wherever they are summed). On one H200
# (16 cores) two calls of 5-6 minutes each:
#   CHECK_TESTS="tests/ops/test_linear.py tests/ops/test_lora.py tests/ops/test_mlp.py" \
#     CHECK_DEMO=0 CHECK_SUITES=none scripts/gpu-check.sh OUT/a
#   CHECK_TESTS="tests --ignore=tests/ops/test_linear.py --ignore=tests/ops/test_lora.py \
#     --ignore=tests/ops/test_mlp.py" CHECK_SUITES=none scripts/gpu-check.sh OUT/b
#   python -m fuseml.bench.gpu_check OUT/a OUT/b ... --write benchmarks/gpu-checks/<gpu>.txt
# A remote runner that brings back few files: pack OUTDIR into one archive. Bench suites
# run apart:
#   CHECK_TESTS=none CHECK_DEMO=0 CHECK_SUITES="linear mlp lora tuning" scripts/gpu-check.sh OUT/s1
# CHECK_TESTS: pytest paths (and options) of the GPU tests ("none": skip);
# CHECK_WORKERS (default 14); CHECK_GPUS: GPUs to spread the tests over (default: one,
# as CUDA_VISIBLE_DEVICES leaves it); CHECK_DEMO=0 skips the demo; CHECK_SUITES: suites
# ("none": skip). The commit recorded is asked of git ("unknown (no git)" in a copied tree).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu-check}"
mkdir -p "$OUT"
rm -f "$OUT/tests.xml" "$OUT/tests.paths" "$OUT/demo.rc" "$OUT/gpu-check.txt"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0

echo "== fuseml env" | tee "$OUT/env.txt"
"$PY" -m fuseml env 2>&1 | tee -a "$OUT/env.txt" || status=1

demo_beside=""
run_demo() {
    echo "== fuseml demo" > "$OUT/demo.txt"
    "$PY" -m fuseml demo >> "$OUT/demo.txt" 2>&1
    echo $? > "$OUT/demo.rc"
}
tests="${CHECK_TESTS:-tests}"
gpus="${CHECK_GPUS:-}"
if [ "${CHECK_DEMO:-1}" != "0" ] && [ "$tests" != "none" ] && [ "${gpus/,/}" != "$gpus" ]; then
    ( export CUDA_VISIBLE_DEVICES="${gpus##*,}"; run_demo ) &
    demo_beside=$!
fi
if [ "$tests" != "none" ]; then
    echo "== GPU tests ($tests)" | tee "$OUT/tests.txt"
    echo "$tests" > "$OUT/tests.paths"
    # each test phase's seconds as it ends (tests/conftest.py): kept by a run cut short
    export CHECK_TIMES="$PWD/$OUT/test-times.txt"
    [ "${OUT#/}" != "$OUT" ] && CHECK_TIMES="$OUT/test-times.txt"
    rm -f "$CHECK_TIMES"
    # shellcheck disable=SC2086  # a list of paths
    ${demo_beside:+nice -n 10} "$PY" -m pytest -v -m gpu -n "${CHECK_WORKERS:-14}" --dist worksteal -rfE -p no:cacheprovider --durations=25 \
        --junitxml "$OUT/tests.xml" $tests 2>&1 | tee -a "$OUT/tests.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "$demo_beside" ]; then
    wait "$demo_beside"
    echo "== fuseml demo (beside the tests, GPU ${gpus##*,}): exit $(cat "$OUT/demo.rc")"
    tail -5 "$OUT/demo.txt"
    [ "$(cat "$OUT/demo.rc")" = "0" ] || status=1
elif [ "${CHECK_DEMO:-1}" != "0" ]; then
    echo "== fuseml demo" | tee "$OUT/demo.txt"
    "$PY" -m fuseml demo 2>&1 | tee -a "$OUT/demo.txt"
    demo_rc=${PIPESTATUS[0]}
    echo "$demo_rc" > "$OUT/demo.rc"
    [ "$demo_rc" -eq 0 ] || status=1
fi

suites="${CHECK_SUITES:-$("$PY" -c "from fuseml.bench.suites import SUITES; print(' '.join(SUITES))")}"
[ "$suites" = "none" ] && suites=""
for suite in $suites; do
    echo "== bench $suite (quick)" | tee "$OUT/bench-$suite.txt"
    "$PY" -m fuseml bench "$suite" --quick --out "$OUT/results" 2>&1 \
        | tee -a "$OUT/bench-$suite.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo "== summary"
if [ -d "$OUT/results" ]; then
    "$PY" -m fuseml.bench.summary "$OUT/results" 2>&1 | tee "$OUT/bench-summary.txt"
    # A copy of each results file beside the logs (OUTDIR/<gpu>-<suite>.json): a remote
    # runner may bring back only files a few folders deep (OUTDIR/results/<gpu>/ is two).
    for f in "$OUT"/results/*/*.json; do
        [ -e "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"
    done
fi
"$PY" -m fuseml.bench.gpu_check "$OUT" || status=1
exit $status
