#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call: the CUDA softmax twin's GPU tests with its
# split kernel's even column shares, and its time at 50257 / 65536 columns next to Triton's.
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
run tests 220 "$PY" -m pytest -q -m gpu -n 14 -rf tests/ops/test_softmax.py -k cuda
run probe-softmax 100 env PROBE_SPLIT=8192:1024 PROBE_ONLINE=none "$PY" \
    scripts/probe_softmax.py 50257 65536
tail -3 "$OUT/tests.txt"
grep -E "==|cuda|CUDA|split" "$OUT/probe-softmax.txt" | head -30
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
