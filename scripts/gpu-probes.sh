#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): the softmax on-chip kernel's
# warps / pipelining stages / grid at every width class (rows chosen so that each case
# moves 64-128 MiB), log_softmax at 32768 columns, and the pipelined split-row probe at
# 50256 / 65536 columns. Logs go to OUTDIR, and OUTDIR/probes.tgz holds them all.
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
export PROBE_SPLIT=none PROBE_ONLINE=none
rows() {  # name, rows, columns, sweep
    PROBE_M=$2 PROBE_ROWS=$4 run "$1" 90 "$PY" scripts/probe_softmax.py "$3"
}
rows rows-128 262144 128 "4:0:0,4:0:-1,4:1:-1,4:1:0"
rows rows-1000 32768 1000 "2:0:0,2:0:-1,2:1:-1,4:0:-1"
rows rows-1024 32768 1024 "2:0:0,2:0:-1,2:1:-1,4:0:-1,4:1:-1"
rows rows-2048 16384 2048 "4:0:0,4:0:-1,4:1:-1,4:2:-1"
rows rows-4096 16384 4096 "8:2:0,8:2:-1,8:1:-1,4:2:-1,4:1:-1"
rows rows-8192 8192 8192 "16:2:0,16:2:-1,16:1:-1,8:2:-1,8:1:-1,16:3:0"
rows rows-16384 4096 16384 "16:2:0,16:2:-1,16:1:-1,8:1:-1,16:3:-1"
rows rows-32768 4096 32768 "16:2:0,16:3:0,16:4:0,32:3:0,16:3:-1,16:3:2"
PROBE_LOG=1 rows log-rows-32768 4096 32768 "16:2:0,16:3:0,16:4:0,16:1:0,32:3:0"
PROBE_LOG=1 rows log-rows-1024 32768 1024 "2:0:0,2:0:-1,2:1:-1"
run pipelined 200 "$PY" scripts/probe_softmax_pipelined.py 50256 65536
cat "$OUT/summary.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
