#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): the softmax suite (quick,
# every arm), merged into a copy of the committed results (a cut-short run keeps the
# older rows of the cases it did not reach). Logs go to OUTDIR, and OUTDIR/probes.tgz
# holds them all.
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
run bench-softmax 570 "$PY" -m fuseml.cli bench softmax --quick --merge --out "$OUT/results"
tail -30 "$OUT/bench-softmax.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
