#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): every GEMM tuning candidate at
# 256 and 128 rows of 4096 x 4096 (split-K among them) against cuBLAS. Logs go to OUTDIR,
# and OUTDIR/probes.tgz holds them all (one file to fetch).
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
run cands 400 "$PY" scripts/probe_gemm.py cands 256,4096,4096 128,4096,4096
cat "$OUT/cands.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
