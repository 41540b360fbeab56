#!/usr/bin/env bash
# The open GPU experiments of NOTES.md in one call (tuning work, not the benchmark):
# candidate kernels' sweeps and the GPU tests written since the last check. Logs go to
# OUTDIR, and OUTDIR/probes.tgz holds them all (one file to fetch).
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
run tests 170 "$PY" -m pytest -q -m gpu -n 8 -rf tests/ops/test_lora.py tests/ops/test_linear.py
run softmax 150 "$PY" scripts/probe_softmax.py
run gemm-lora 120 "$PY" scripts/probe_gemm.py lora
run gemm-small 120 "$PY" scripts/probe_gemm.py small
tail -3 "$OUT/tests.txt"
tar czf "$OUT/probes.tgz" -C "$OUT" --exclude probes.tgz .
