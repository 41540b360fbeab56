#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): the softmax GPU tests (Triton
# and the CUDA twin: the on-chip kernel's grid kinds, the split kernel's persistent grid,
# the CUDA log_softmax split kernel's exp), then the split kernel's persistent grid
# against one program per item at 50257 / 65536 columns, softmax and log_softmax. Logs go
# to OUTDIR, and OUTDIR/probes.tgz holds them all.
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
run tests 330 "$PY" -m pytest -q -m gpu -n 12 -rf tests/ops/test_softmax.py
tail -3 "$OUT/tests.txt"
export PROBE_ONLINE=none PROBE_SPLIT="4096:1024:1,8192:2048:1,8192:1024"
run split 100 "$PY" scripts/probe_softmax.py 50257 65536
PROBE_LOG=1 run log-split 100 "$PY" scripts/probe_softmax.py 50257 65536
cat "$OUT/summary.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
