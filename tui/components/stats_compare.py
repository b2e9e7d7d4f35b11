"""This step's statistics of a slice beside the previous step's, with the change."""

from __future__ import annotations

import math
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

ROWS = (
    ("mean", "mean"),
    ("std", "std"),
    ("min", "min"),
    ("max", "max"),
    ("abs_mean", "mean |x|"),
    ("l2", "L2 norm"),
    ("nan", "NaN"),
    ("posinf", "+Inf"),
    ("neginf", "-Inf"),
    ("zeros", "zeros"),
)
COUNTS = {"nan", "posinf", "neginf", "zeros", "numel"}
SLICE_NOT_COMPARED = (
    "the previous step's statistics are of the whole tensor, not of a slice: clear the slice "
    "(Enter on an empty box) to compare them"
)
"""Why a slice has no previous column: sources keep a step's statistics of whole tensors only
(its column of dashes said "no statistics of this tensor", which the whole tensor had)."""
ALARMS = {"nan", "posinf", "neginf"}


def fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value):
        return "NaN"  # as the grid writes it
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.4g}"


def delta(now: Any, before: Any, key: str) -> Text:
    if now is None or before is None:
        return Text("–", style="dim")
    d = now - before
    if key in COUNTS:
        return Text(f"{d:+,}" if d else "0", style="bold red" if d > 0 and key in ALARMS else "")
    if not (math.isfinite(now) and math.isfinite(before)):
        # What the subtraction gives (NaN, or an infinity), as the grid writes it: "–" is kept
        # for a value no step recorded.
        return Text(fmt(d), style="bold red" if not math.isfinite(now) else "dim")
    relative = abs(d) / max(abs(before), 1e-30)
    return Text(f"{d:+.3g}", style="yellow" if relative > 0.5 else "")


class StatsCompare(Static):
    """Fed with a ``stats()`` reply; its ``previous`` is the same tensor at the last step
    (``previous_why``: why there is none, or, given with one, how its column differs: another
    phase of the tensor)."""

    def __init__(self) -> None:
        super().__init__("", id="stats-compare")
        self.border_title = "compared with the previous step"

    def show(self, stats: dict[str, Any]) -> None:
        now = stats["summary"]
        previous = stats.get("previous")
        before = previous["summary"] if previous else {}
        table = Table(box=None, padding=(0, 1), show_edge=False, expand=True)
        table.add_column("", style="dim", no_wrap=True)
        table.add_column("this step", justify="right", no_wrap=True)
        table.add_column(f"step {previous['step']}" if previous else "previous", justify="right")
        table.add_column("Δ", justify="right", no_wrap=True)
        empty = now.get("numel") == 0  # an empty slice has no moments (its NaN means none)
        # Moments are over the finite values: with none, the NaN they hold means none, not NaN.
        unfinite = sum(now.get(k) or 0 for k in ALARMS)
        none_finite = not empty and now.get("numel") is not None and unfinite >= now["numel"]
        for key, label in ROWS:
            value = None if (empty or none_finite) and key not in COUNTS else now.get(key)
            style = "bold red" if key in ALARMS and value else ""
            table.add_row(
                label,
                Text(fmt(value), style=style),
                fmt(before.get(key)),
                delta(value, before.get(key), key),
            )
        # Why columns are blank, above the rows: below them, a small screen cut it off.
        if empty:
            said = ["the slice selects no value"]
        elif none_finite:
            said = ["no finite value: mean, std, min, max and the norms are of finite ones"]
        elif not previous:
            said = [stats.get("previous_why") or (
                SLICE_NOT_COMPARED if stats.get("index")
                else "no statistics of this tensor from the previous step"
            )]  # fmt: skip
        else:
            said = [_partial(previous["step"], before)]
        if previous and stats.get("previous_why"):  # its column is of another phase: which
            said.insert(0, stats["previous_why"])
        table.title = "; ".join(s for s in said if s) or None
        table.title_style = "dim"
        self.update(table)


def _partial(step: int, before: dict[str, Any]) -> str | None:
    """Why the previous step's column is mostly blank: that step recorded only a few of these
    statistics (a statistics-only dump holds what the checks measured, often only whether the
    tensor was finite)."""
    held = [label for key, label in ROWS if before.get(key) is not None]
    if len(held) * 2 >= len(ROWS):
        return None
    if not held:
        return f"step {step} recorded none of these statistics, only what its checks measured"
    return f"step {step} recorded only {', '.join(held)} of these (what its checks measured)"
