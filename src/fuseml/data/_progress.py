"""Progress bars of the data commands: rows done and rows per second, rounded for people."""

from __future__ import annotations

from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

__all__ = ["ROWS_FIELD", "human_count", "human_rate", "row_progress"]

ROWS_FIELD = "rows"  # task field holding the rows done, when the bar itself counts bytes


def human_count(n: float) -> str:
    """1234 -> '1,234'; 45_840_617 -> '45.8M'."""
    if n >= 10_000_000:
        return f"{n / 1e6:.1f}M" if n < 1e9 else f"{n / 1e9:.2f}G"
    return f"{round(n):,}"


def human_rate(per_second: float) -> str:
    """Rates with three significant digits at most: 1.23M, 456k, 78.9."""
    if per_second >= 1e6:
        return f"{per_second / 1e6:.3g}M"
    if per_second >= 1e3:
        return f"{per_second / 1e3:.3g}k"
    return f"{per_second:.3g}"


class _RowsColumn(ProgressColumn):
    """'1,234,567 rows  456k rows/s' from the task's rows field (or its completed count)."""

    def render(self, task: Task) -> Text:
        rows = task.fields.get(ROWS_FIELD, task.completed)
        elapsed = task.elapsed or 0.0
        rate = f"  {human_rate(rows / elapsed)} rows/s" if elapsed > 0 and rows else ""
        return Text(f"{human_count(rows)} rows{rate}", style="progress.data.speed")


def row_progress(enabled: bool) -> Progress:
    """A bar with percent done, rows and rows/s, and time left."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(bar_width=16),  # leaves room for the counts on an 80-column terminal
        TaskProgressColumn(),
        _RowsColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
    )
