#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): one quick suite on the
# machine the call lands on (meant for an H200, whose committed elementwise and softmax
# tables predate the current kernels), written into OUTDIR/results; OUTDIR/probes.tgz
# holds the logs and results (one file to fetch).
#
#   scripts/gpu-probes.sh [OUTDIR] [SUITE]     (defaults: out/gpu-probes, softmax)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu-probes}"
SUITE="${2:-softmax}"
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
run "bench-$SUITE" 570 "$PY" -m fuseml.cli bench "$SUITE" --quick --out "$OUT/results"
tail -5 "$OUT/bench-$SUITE.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
