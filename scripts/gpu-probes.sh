#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): the linear GPU tests (the
# pointer kernel's one-step variant for K <= BLOCK_K), the skinny layers' candidates at 64
# rows, then the linear suite's skinny 13 -> 512 rows merged into a copy of the committed
# results. Logs go to OUTDIR, and OUTDIR/probes.tgz holds them all (one file to fetch).
# Set FUSEML_COMMIT=<sha> for the results' stamp.
#
#   scripts/gpu-probes.sh [OUTDIR]        (default: out/gpu-probes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu-probes}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
run() {  # name, timeout in seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee "$OUT/$name.txt"
    timeout "$limit" "$@" >> "$OUT/$name.txt" 2>&1
    echo "$name: exit $?" | tee -a "$OUT/summary.txt"
}
run tests 240 "$PY" -m pytest -q -m gpu -n 14 -rf tests/ops/test_linear.py tests/nn
run skinny 100 "$PY" scripts/probe_gemm.py cands 64,13,512 64,64,16 4096,13,512
cp -r benchmarks/results "$OUT/results"
run bench-linear 150 "$PY" -m fuseml.cli bench linear --quick --merge --cases 13x512 \
    --out "$OUT/results"
tail -3 "$OUT/tests.txt"
cat "$OUT/skinny.txt"
grep -E "13x512" "$OUT/bench-linear.txt" | head -20
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
