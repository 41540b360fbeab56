#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): host time per call of the
# linear path with its direct launches (not measured yet), the modules and a DLRM forward,
# then the dlrm suite's bf16 rows (fuseml.optimize now runs the bottom MLP through the
# register-resident chain kernel).
# Logs go to OUTDIR, and
# OUTDIR/probes.tgz holds them all (one file to fetch). Set FUSEML_COMMIT=<sha> for the
# results' commit stamp where the tree has no current .git.
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
run host 240 "$PY" scripts/host_overhead.py
cp -r benchmarks/results "$OUT/results"
run bench-dlrm 330 "$PY" -m fuseml.cli bench dlrm --quick --merge --cases bf16 \
    --out "$OUT/results"
head -30 "$OUT/host.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
