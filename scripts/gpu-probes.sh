#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): the linear and LoRA GPU tests,
# then the linear suite's narrow layers (256 -> 64, 64 -> 16) from 512 rows, tuned over
# both kernels now, merged into a copy of the committed results.
# Logs go to OUTDIR, and OUTDIR/probes.tgz holds them all (one file to fetch). Set
# FUSEML_COMMIT=<sha> for the results' stamp.
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
run tests 300 "$PY" -m pytest -q -m gpu -n 14 -rf tests/ops/test_linear.py tests/ops/test_lora.py
cp -r benchmarks/results "$OUT/results"
run bench-linear 200 "$PY" -m fuseml.cli bench linear --merge \
    --cases '^(256x64|64x16)/relu/bfloat16/m(512|4096|65536)$' --out "$OUT/results"
tail -3 "$OUT/tests.txt"
grep -E "tuned" "$OUT/bench-linear.txt" | cut -c1-220
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
