#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): the softmax on-chip kernel's
# warps / pipelining stages / grid at 4096 (16384 rows), 16384 and 32768 columns; the
# split kernel's columns per program at 50257; every tuning candidate of the skinny
# linear layers that miss the 1.2x target; the quick softmax suite's log_softmax 262144. Logs go to OUTDIR, and OUTDIR/probes.tgz holds
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
export PROBE_SPLIT=none PROBE_ONLINE=none
export PROBE_ROWS="16:1:0,16:2:0,16:3:0,16:2:-1,16:2:1,32:1:0,32:2:0,8:2:0"
run softmax-rows 150 "$PY" scripts/probe_softmax.py 16384 32768
export PROBE_M=16384 PROBE_ROWS="8:1:0,8:2:0,8:3:0,8:4:0,8:2:-1,4:2:0,4:3:0,16:2:0"
run softmax-rows-4096 90 "$PY" scripts/probe_softmax.py 4096
unset PROBE_M PROBE_ROWS
export PROBE_SPLIT="2048:512,4096:1024,4096:512,8192:1024,8192:512"
run softmax-split 120 "$PY" scripts/probe_softmax.py 50257
export PROBE_EXTRA="16-16-256-1-1,16-16-256-2-1,16-32-256-2-1,32-16-256-2-1"
run gemm-cands 240 "$PY" scripts/probe_gemm.py cands 1,256,64 64,256,64 512,256,64 \
    4096,256,64 65536,256,64 4096,13,512 4096,64,16 65536,64,16
# the softmax suite's last quick case, cut off by the time limit in the round before
cp -r benchmarks/results "$OUT/results"
run bench-log-softmax 240 "$PY" -m fuseml.cli bench softmax --quick --merge \
    --cases 'log_softmax/.*262144' --out "$OUT/results"
cat "$OUT/summary.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
