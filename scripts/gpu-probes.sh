#!/usr/bin/env bash
# The open GPU checks of NOTES.md in one call (next round): the softmax suite (quick),
# merged into a copy of the committed results, for the CUDA twin's two-barrier split kernel
# (0319666; measured by the probe only so far), then the probe itself. Logs go to OUTDIR,
# and OUTDIR/probes.tgz holds them all (one file to fetch). Set FUSEML_COMMIT=<sha> for
# the results' stamp.
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
run bench-softmax 420 "$PY" -m fuseml.cli bench softmax --quick --merge --out "$OUT/results"
export PROBE_ONLINE=none PROBE_SPLIT=8192:1024
run probe 120 "$PY" scripts/probe_softmax.py 50257 65536 262144
cat "$OUT/probe.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
