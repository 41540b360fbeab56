#!/usr/bin/env bash
# Usage: scripts/gpu-check.sh [OUTDIR]          (default: out/gpu-check)
#
# One command on a GPU machine (torch + triton preinstalled, no network, no pip install):
# the environment report, the GPU tests, `fuseml demo` (which fails when the optimized
# model's predictions leave the tolerance) and the bench suites in quick mode. Logs and
# result files go to OUTDIR; OUTDIR/gpu-check.txt is the machine-written summary (device,
# torch, triton, commit, test counts, demo, suites; last line PASS or FAIL), committed per
# GPU as benchmarks/gpu-checks/<gpu>.txt.
#
# The whole check no longer fits one 10-minute call. Four parts on a four-GPU H200 host
# (15 workers each, the extensions built first), each with its own OUTDIR, reached in
# 435 s: A 99%, B 71%, C 93%, D 95%:
#   T=tests/ops
#   A="$T/test_lora.py $T/test_fastcall.py $T/test_launch.py $T/test_utils.py"
#   B="$T/test_linear.py $T/test_mlp.py $T/test_tuned_paths.py $T/test_pdl.py $T/test_gelu.py $T/test_add.py"
#   C="$T/test_softmax.py $T/test_bias_act.py $T/test_embedding_interaction.py"
#   D="tests --ignore=tests/ops" (with the demo)
#   CUDA_VISIBLE_DEVICES=0 CHECK_SUITES=none CHECK_DEMO=0 CHECK_WORKERS=15 \
#     CHECK_TESTS="$A" scripts/gpu-check.sh OUT/a &      (B, C, D likewise on GPUs 1-3)
# So run them in two calls: A, C and B split in two (linear + tuned_paths + pdl; mlp +
# gelu + add) on four GPUs, then D alone; then one summary of the parts:
#   python -m fuseml.bench.gpu_check OUT/a OUT/b1 OUT/b2 OUT/c OUT/d --write benchmarks/gpu-checks/<gpu>.txt
# A remote runner that brings back few files: pack OUTDIR into one archive. Bench suites
# run apart:
#   CHECK_TESTS=none CHECK_DEMO=0 CHECK_SUITES="linear mlp lora tuning" scripts/gpu-check.sh OUT/s1
# CHECK_TESTS: pytest paths (and options) of the GPU tests ("none": skip);
# CHECK_WORKERS (default 14); CHECK_DEMO=0 skips the demo; CHECK_SUITES: suites
# ("none": skip). The commit recorded is asked of git ("unknown (no git)" in a copied tree).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu-check}"
mkdir -p "$OUT"
rm -f "$OUT/tests.xml" "$OUT/tests.paths" "$OUT/demo.rc"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0

echo "== fuseml env" | tee "$OUT/env.txt"
"$PY" -m fuseml env 2>&1 | tee -a "$OUT/env.txt" || status=1

tests="${CHECK_TESTS:-tests}"
if [ "$tests" != "none" ]; then
    echo "== GPU tests ($tests)" | tee "$OUT/tests.txt"
    echo "$tests" > "$OUT/tests.paths"
    # shellcheck disable=SC2086  # a list of paths
    "$PY" -m pytest -v -m gpu -n "${CHECK_WORKERS:-14}" -rfE -p no:cacheprovider --durations=25 \
        --junitxml "$OUT/tests.xml" $tests 2>&1 | tee -a "$OUT/tests.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "${CHECK_DEMO:-1}" != "0" ]; then
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
