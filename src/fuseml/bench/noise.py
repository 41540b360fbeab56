"""Timings a reader can trust: an arm whose timing is noisy, or far from what the same arm
measured in the committed results of the same GPU, is timed again before its row is
written.

An arm's timing is *unsettled* when

* its p20-p80 spread exceeds SPREAD_MAX of its median (the board drifted while it was
  timed), or
* its median is more than HISTORY_MAX off the same arm's median in the committed results
  (benchmarks/results/<gpu>/<suite>.json: same case, arm and mode).

Such an arm is timed again, at most RERUNS_MAX times; the attempt nearest to settled is
kept. Its row records ``reruns`` (how many times it was timed again) and, if it is still
unsettled, ``noisy`` (why), so that a table never shows such a row as a plain result.
Every arm is checked, fuseml's own included: a ratio is only as good as both its ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SPREAD_MAX = 0.10  # p20-p80 spread over the median
HISTORY_MAX = 0.15  # relative distance of the median from the committed median
RERUNS_MAX = 2  # times an unsettled arm is timed again

# (case, arm, mode) -> the committed median in ms
History = dict[tuple[str, str, str], float]


@dataclass
class Timing:
    """One arm's kept timing: (p50, p20, p80[, p99]) ms, times re-run, why still unsettled."""

    quantiles: tuple[float, ...]
    reruns: int = 0
    noisy: list[str] = field(default_factory=list)

    def fields(self) -> dict:
        """The row fields this adds: reruns where it was re-run, noisy where unsettled."""
        out: dict = {}
        if self.reruns:
            out["reruns"] = self.reruns
        if self.noisy:
            out["noisy"] = "; ".join(self.noisy)
        return out


def badness(quantiles: Sequence[float], history_ms: float | None) -> float:
    """How far from settled: the larger of spread / SPREAD_MAX and distance from the
    committed median / HISTORY_MAX; settled at 1 or less."""
    p50, p20, p80 = quantiles[:3]
    if not p50 or p50 <= 0:
        return 0.0
    worst = (p80 - p20) / p50 / SPREAD_MAX
    if history_ms:
        worst = max(worst, abs(p50 / history_ms - 1) / HISTORY_MAX)
    return worst


def unsettled(quantiles: Sequence[float], history_ms: float | None) -> list[str]:
    """Why the timing (p50, p20, p80, ...) cannot be taken as it is; empty when settled."""
    p50, p20, p80 = quantiles[:3]
    if not p50 or p50 <= 0:
        return []
    reasons = []
    spread = (p80 - p20) / p50
    if spread > SPREAD_MAX:
        reasons.append(f"p20-p80 spread {100 * spread:.0f}% of the median")
    if history_ms:
        off = p50 / history_ms - 1
        if abs(off) > HISTORY_MAX:
            reasons.append(f"median {100 * off:+.0f}% off the committed {1e3 * history_ms:.1f} us")
    return reasons


def settle(
    measure: Callable[[list[str]], dict[str, tuple[float, ...]]],
    names: Iterable[str],
    history: dict[str, float | None] | None = None,
    reruns_max: int = RERUNS_MAX,
) -> dict[str, Timing]:
    """Each arm's timing, unsettled arms timed again (at most ``reruns_max`` times).

    measure(names): {arm: quantiles} for at least the arms named (a timer in turns may
    time every arm again, so that a re-run still weighs a drifting board on all alike;
    only the named arms' new timings are used). history: arm -> committed median (ms).
    """
    names = list(names)
    history = history or {}
    first = measure(names)
    kept = {n: Timing(tuple(first[n]), 0, unsettled(first[n], history.get(n))) for n in names}
    pending = [n for n in names if kept[n].noisy]
    for _ in range(reruns_max):
        if not pending:
            break
        again = measure(pending)
        for n in pending:
            t = kept[n]
            new = tuple(again[n])
            t.reruns += 1
            if badness(new, history.get(n)) < badness(t.quantiles, history.get(n)):
                t.quantiles, t.noisy = new, unsettled(new, history.get(n))
        pending = [n for n in pending if kept[n].noisy]
    return kept


def plain_timing(row: dict) -> bool:
    """A row that may stand as history: a kernel-events or graph-replay timing, not failed,
    not itself marked noisy (see history_from_rows)."""
    return (
        bool(row.get("p50_ms"))
        and not row.get("error")
        and not row.get("noisy")
        and row.get("mode") in ("events", "graph")
    )


def history_from_rows(rows: Iterable[dict]) -> History:
    """(case, arm, mode) -> p50_ms of committed rows that are plain timings (not failed,
    not themselves marked noisy) of the GPU: kernel events and graph replays. Eager wall
    and host rows are not kept: they measure the host, which differs between machines of
    one GPU kind (torch's gelu call: 6.2 and 10.6 us on two H200 hosts), so only their
    spread, timed in turns with their peers, decides."""
    return {
        (r.get("case"), r.get("arm"), r.get("mode")): float(r["p50_ms"])
        for r in rows
        if plain_timing(r)
    }


def committed_history(results_file: Path) -> History:
    """The history in ``results_file`` as committed (git's HEAD version where git has it,
    else the file as it is on disk, read before this run writes anything); empty where
    there is none."""
    from fuseml.bench.commit import _git

    text = None
    path = Path(results_file).resolve()
    if path.parent.is_dir():
        top = (_git(path.parent, "rev-parse", "--show-toplevel") or "").strip()
        if top and path.is_relative_to(Path(top).resolve()):
            rel = path.relative_to(Path(top).resolve()).as_posix()
            text = _git(Path(top), "show", f"HEAD:{rel}")
    if text is None and path.is_file():
        text = path.read_text()
    if not text:
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return history_from_rows(doc.get("rows", []) if isinstance(doc, dict) else [])
