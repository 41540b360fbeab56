#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): the GPU tests of the linear,
# LoRA, MLP, module, fuseml.optimize, DLRM model and predict paths, then host time per
# call of the linear / LoRA / MLP paths (after the one-pass argument check). Logs go to
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
run tests 400 "$PY" -m pytest -q -m gpu -n 14 -rf tests/ops/test_linear.py \
    tests/ops/test_lora.py tests/ops/test_mlp.py tests/nn tests/test_optimize.py tests/models \
    tests/test_predict.py
run host 140 "$PY" scripts/host_overhead.py
tail -3 "$OUT/tests.txt"
head -22 "$OUT/host.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
