"""Everything about the hit under the cursor in the Hits tab, its message unabridged."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from tensordbg.statistics import describe


class HitDetail(Static):
    """Fed with a hit dict (``Hit.as_dict``)."""

    def __init__(self) -> None:
        super().__init__("", id="hit-detail")

    def show(self, hit: dict[str, Any] | None) -> None:
        if hit is None:
            self.update(Text("No hits yet.", style="dim"))
            return
        text = Text()
        text.append(f"[{hit['rule']}] ", style="bold")
        text.append(hit["tensor"], style="bold red" if hit["origin"] else "bold")
        where = "where the problem was produced" if hit["origin"] else "passed on from upstream"
        text.append(f"  {hit['kind']} of {hit['module'] or '(model)'}, call {hit['call']}")
        text.append(f"  step {hit['step']} {hit['phase']}  ({where})\n")
        text.append(hit["message"] + "\n")
        threshold = "" if hit.get("threshold") is None else f"  threshold {hit['threshold']:.4g}"
        text.append(f"value {hit['value']:.4g}{threshold}", style="dim")
        summary = hit.get("summary") or {}
        if summary:
            text.append("   ")
            text.append(describe(summary, summary.get("shape"), summary.get("dtype", "")))
        text.append("\nEnter opens the tensor.", style="dim italic")
        self.update(text)
