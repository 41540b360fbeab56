#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): the split kernel's persistent
# grid (fuseml.ops.softmax) against the probe kernel of the same scheme
# (probe_softmax_pipelined.py: 328 / 414 us at 50256 / 65536 where the library kernel
# took 395 / 501), with register caps, and one program per item for reference. Logs go to
# OUTDIR, and OUTDIR/probes.tgz holds them all.
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
PROBE_PIPE=4096:4 run pipelined 90 "$PY" scripts/probe_softmax_pipelined.py 50256 65536
export PROBE_ONLINE=none PROBE_SPLIT="4096:1024:1,8192:2048:1,8192:1024" PROBE_MAXNREG="0,64,72"
run split 150 "$PY" scripts/probe_softmax.py 50257 65536
cat "$OUT"/*.txt
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
