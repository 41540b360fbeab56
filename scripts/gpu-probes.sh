#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): the softmax GPU tests (the
# split kernel's persistent grid for aligned rows, the on-chip grid kinds, the CUDA
# log_softmax exp), then the persistent grid on aligned rows (50256, 65536, 262144) with
# register caps, against one program per item and the probe kernel of the same scheme.
# Logs go to OUTDIR, and OUTDIR/probes.tgz holds them all.
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
run tests 300 "$PY" -m pytest -q -m gpu -n 12 -rf tests/ops/test_softmax.py
tail -3 "$OUT/tests.txt"
export PROBE_ONLINE=none PROBE_SPLIT="4096:1024:1,8192:1024" PROBE_MAXNREG="0,64,72"
run split 150 "$PY" scripts/probe_softmax.py 50256 65536 262144
PROBE_LOG=1 PROBE_MAXNREG=0,64 run log-split 60 "$PY" scripts/probe_softmax.py 65536
PROBE_PIPE=4096:4 run pipelined 60 "$PY" scripts/probe_softmax_pipelined.py 50256
cat "$OUT"/split.txt "$OUT"/log-split.txt "$OUT"/pipelined.txt
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
