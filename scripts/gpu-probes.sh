#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call: the GPU tests of the modules whose kernels
# take the activation epilogue (its GELU / sigmoid formulas changed: linear, MLP, LoRA, nn,
# optimize, the DLRM models), then the elementwise suite's mid-size cases again, now with
# CUDA-graph rows (merged into a copy of the committed results). Logs go to OUTDIR, and
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
run tests 400 "$PY" -m pytest -q -m gpu -n 14 -rf tests/ops/test_linear.py \
    tests/ops/test_mlp.py tests/ops/test_lora.py tests/nn tests/test_optimize.py tests/models
cp -r benchmarks/results "$OUT/results"
run bench-elementwise 150 "$PY" -m fuseml.cli bench elementwise --quick --merge \
    --cases "(relu|gelu)/bfloat16/4096x4096$|^gelu/bfloat16/16777216$" --out "$OUT/results"
tail -3 "$OUT/tests.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
