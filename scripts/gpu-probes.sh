#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): LoRA's shrink launch alone per
# candidate and the expand mode's main launch alone (M = 256 and 4096), the skinny
# 13 -> 512 layer's candidates at 64 rows with extra small configs, then host time per
# call of the linear / LoRA / MLP paths. Logs go to OUTDIR, and OUTDIR/probes.tgz holds
# them all (one file to fetch).
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
run shrink 200 "$PY" scripts/probe_gemm.py shrink 256,4096,16 256,4096,64 4096,4096,16
export PROBE_EXTRA="64-64-16-4-1,64-64-16-2-1,64-128-16-4-1,64-32-16-2-1,64-64-16-1-1,32-64-16-1-1,64-128-16-4-2,64-256-16-4-1"
run skinny 120 "$PY" scripts/probe_gemm.py cands 64,13,512 64,64,16 64,256,64
run host 150 "$PY" scripts/host_overhead.py
cat "$OUT/shrink.txt" "$OUT/skinny.txt"
head -22 "$OUT/host.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
