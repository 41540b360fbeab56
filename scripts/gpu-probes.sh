#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call: the mlp suite's kaggle bottom MLP rows
# with the chain kernel (compile-max at 4096 and 65536 rows), then the wide top MLPs split
# into linear layers and a chain-kernel tail (scripts/probe_mlp.py plans).
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
cp -r benchmarks/results "$OUT/results"
run bench-mlp 420 "$PY" -m fuseml.cli bench mlp --quick --merge --cases kaggle-bottom \
    --out "$OUT/results"
run probe-mlp 150 "$PY" scripts/probe_mlp.py kaggle-top:4096:plans mlperf-top:4096:plans \
    mlperf-top:65536:plans
cat "$OUT/probe-mlp.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
