#!/usr/bin/env bash
# The open GPU experiments of NOTES.md in one call (tuning work, not the benchmark): the
# GPU tests of the kernels changed since the last check, then the probes. Logs go to
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
run tests 240 "$PY" -m pytest -q -m gpu -n 8 -rf tests/ops/test_softmax.py \
    tests/ops/test_lora.py tests/ops/test_linear.py tests/test_triton_key.py
run gemm-lora 150 "$PY" scripts/probe_gemm.py lora
tail -3 "$OUT/tests.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
