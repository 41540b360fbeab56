#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call: the GPU tests of the modules that call the
# changed GEMM paths, the softmax launch sweep, the lora suite with its graph rows, and
# the host time of TMA launches (descriptors) and of LoRA's two-launch expand mode.
# Logs go to OUTDIR, and OUTDIR/probes.tgz holds them all (one file to fetch). Set
# FUSEML_COMMIT=<sha> for the results' commit stamp where the tree has no current .git.
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
run tests 180 "$PY" -m pytest -q -m gpu -n 12 -rf tests/ops/test_mlp.py tests/nn \
    tests/test_optimize.py
run softmax 120 "$PY" scripts/probe_softmax.py
run bench-lora 180 "$PY" -m fuseml.cli bench lora --quick --out "$OUT/results"
run host 90 "$PY" scripts/host_overhead.py
tail -3 "$OUT/tests.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
