#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): the candidates of the skinny
# 256 -> 64 layer (and extra small configs), then the linear suite's skinny DLRM layers at
# every M (short-K candidates for many rows), merged into a copy of the committed results.
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
export PROBE_EXTRA="16-16-64-4-3,16-16-128-4-2,16-16-256-2-1,16-16-256-8-1,16-32-256-4-1,16-16-64-2-4"
run skinny 120 "$PY" scripts/probe_gemm.py cands 1,256,64 64,256,64
unset PROBE_EXTRA
cp -r benchmarks/results "$OUT/results"
run bench-linear 360 "$PY" -m fuseml.cli bench linear --merge \
    --cases '^(13x512|256x64|64x16)/relu/bfloat16' --out "$OUT/results"
cat "$OUT/skinny.txt"
grep -E "tuned" "$OUT/bench-linear.txt" | grep -E "k13|n16:k64" | tail -8
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
