#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call: the linear / LoRA / module GPU tests with
# the plain linear kernel's repeat launches through its compiled kernel's own launcher.
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
run tests 200 "$PY" -m pytest -q -m gpu -n 14 -rf tests/ops/test_linear.py tests/ops/test_lora.py \
    tests/nn -k "not every"
tail -3 "$OUT/tests.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
