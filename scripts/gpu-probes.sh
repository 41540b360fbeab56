#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): the lora suite, the mlp
# suite's top MLPs and the linear suite (quick) after the TMA kernels' direct launches,
# merged into a copy of the committed results. Logs go to OUTDIR, and OUTDIR/probes.tgz
# holds them all (one file to fetch). Set FUSEML_COMMIT=<sha> for the results' stamp.
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
run bench-lora 230 "$PY" -m fuseml.cli bench lora --quick --merge --out "$OUT/results"
run bench-mlp 130 "$PY" -m fuseml.cli bench mlp --quick --merge --cases top --out "$OUT/results"
run bench-linear 200 "$PY" -m fuseml.cli bench linear --quick --merge --out "$OUT/results"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
