#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): host time per call of the
# linear / LoRA / MLP paths, then the linear suite's skinny 13 -> 512 rows again (their
# per-eager-call time at B = 64 rose from 25.4 to 56.5 us between 04cad5b and c97227b while
# their host time fell; see NOTES.md), merged into a copy of the committed results.
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
run host 150 "$PY" scripts/host_overhead.py
cp -r benchmarks/results "$OUT/results"
run bench-linear 200 "$PY" -m fuseml.cli bench linear --quick --merge --cases 13x512 \
    --out "$OUT/results"
head -22 "$OUT/host.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
