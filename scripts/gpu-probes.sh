#!/usr/bin/env bash
# One quick bench suite on the machine the call lands on, in one device call, with the
# results packed into one file to fetch (a device call returns a limited number of files).
#
#   scripts/gpu-probes.sh [OUTDIR] [SUITE] [CASES]     (defaults: out/gpu-probes, softmax)
#
# Without CASES the whole suite runs into a fresh OUTDIR/results (an H200 refresh: its
# committed elementwise and softmax tables predate the current kernels). With CASES (a
# regex of case names, as `fuseml bench --cases`) the committed results are copied into
# OUTDIR/results first and only those cases are re-run and merged (`--merge`), so the
# file keeps every other row. OUTDIR/probes.tgz holds the logs and results; unpack it and
# copy the suite's .json / .png into benchmarks/results/<gpu>/, then `fuseml bench readme`.
# FUSEML_PROBE_LIMIT: seconds the bench may run (default 570); results measured by then
# are kept and packed. FUSEML_PROBE_FULL=1: the full suite's cases (no --quick), for a
# full suite run in parts (with CASES). FUSEML_PROBE_TURNS=1: every case's arms timed in
# turns, graph rows too (`fuseml bench --turns`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu-probes}"
SUITE="${2:-softmax}"
CASES="${3:-}"
LIMIT="${FUSEML_PROBE_LIMIT:-570}"
QUICK=--quick
[ "${FUSEML_PROBE_FULL:-0}" = 1 ] && QUICK=
[ "${FUSEML_PROBE_TURNS:-0}" = 1 ] && QUICK="$QUICK --turns"
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
if [ -n "$CASES" ]; then
    rm -rf "$OUT/results" && cp -r benchmarks/results "$OUT/results"
    run "bench-$SUITE" "$LIMIT" "$PY" -m fuseml bench "$SUITE" $QUICK --merge \
        --cases "$CASES" --out "$OUT/results"
else
    run "bench-$SUITE" "$LIMIT" "$PY" -m fuseml bench "$SUITE" $QUICK --out "$OUT/results"
fi
tail -5 "$OUT/bench-$SUITE.txt"
tar czf "$OUT/../probes.tgz" -C "$OUT" . && mv "$OUT/../probes.tgz" "$OUT/"
rm -rf "$OUT/results"  # packed above; left loose they count against the files a call returns
