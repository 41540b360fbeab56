#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): the linear suite's skinny DLRM
# layers (13 -> 512, 256 -> 64, 64 -> 16) at every M of the full suite, merged into a copy
# of the committed results. Logs go to OUTDIR, and OUTDIR/probes.tgz holds them all (one
# file to fetch). Set FUSEML_COMMIT=<sha> for the results' stamp.
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
cp -r benchmarks/results "$OUT/results"
run bench-linear 500 "$PY" -m fuseml.cli bench linear --merge \
    --cases '^(13x512|256x64|64x16)/relu/bfloat16' --out "$OUT/results"
grep -E "tuned|passed|failed" "$OUT/bench-linear.txt" | tail -30
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
