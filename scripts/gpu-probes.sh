#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (this round): the linear and LoRA GPU tests
# (split-K TMA kernel, direct TMA launches), host time per call of the linear / LoRA / MLP
# paths, then the LoRA layer at 256 and 4096 rows against the merged weight (split-K
# candidates in the tuning). Logs go to OUTDIR, and OUTDIR/probes.tgz holds them all (one
# file to fetch). Set FUSEML_COMMIT=<sha> for the results' commit stamp where the tree has
# no current .git.
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
run tests 300 "$PY" -m pytest -q -m gpu -n 14 -rf tests/ops/test_linear.py tests/ops/test_lora.py
run host 150 "$PY" scripts/host_overhead.py
export PROBE_SETS=3
run lora 120 "$PY" scripts/probe_gemm.py lora 256:0:16 256:0:64 4096:0:16
tail -3 "$OUT/tests.txt"
head -22 "$OUT/host.txt"
tail -40 "$OUT/lora.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
