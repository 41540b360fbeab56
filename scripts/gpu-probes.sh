#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call: the GPU tests of the elementwise ops (the
# CUDA twin's flat path uses fewer vectors a thread at mid sizes), and re-runs merged into
# a copy of the committed results: the elementwise suite's 1M-element cases and the 2-D
# bf16 bias + residual + ReLU cases, and log_softmax at 262144 columns. Logs go to OUTDIR, and
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
run tests 170 "$PY" -m pytest -q -m gpu -n 12 -rf tests/ops/test_add.py \
    tests/ops/test_gelu.py tests/ops/test_bias_act.py
cp -r benchmarks/results "$OUT/results"
run bench-elementwise 200 "$PY" -m fuseml.cli bench elementwise --quick --merge \
    --cases "/1000000$|relu/bfloat16/4096x(512|4096)$" --out "$OUT/results"
run bench-softmax 150 "$PY" -m fuseml.cli bench softmax --quick --merge \
    --cases "log_softmax/bfloat16/4096x262144$" --out "$OUT/results"
tail -3 "$OUT/tests.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
