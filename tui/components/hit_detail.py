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

    def show(self, hit: dict[str, Any] | None, filtered_out: str = "",
             rules: list[str] | None = None) -> None:  # fmt: skip
        """``rules``: every rule that found what the hit says (its own by default)."""
        if hit is None and filtered_out:
            self.update(Text(f"No hit matches the filter '{filtered_out}': press / and clear "
                             "it to see them all.", style="dim"))  # fmt: skip
            return
        if hit is None:
            self.update(Text("No hits yet.", style="dim"))
            return
        text = Text()
        text.append(f"[{', '.join(rules or [hit['rule']])}] ", style="bold")
        text.append(hit["tensor"], style="bold red" if hit["origin"] else "bold")
        where = "where the problem was produced" if hit["origin"] else "passed on from upstream"
        text.append(f"  {hit['kind']} of {hit['module'] or '(model)'}, call {hit['call']}")
        text.append(f"  step {hit['step']} {hit['phase']}  ({where})\n")
        text.append(hit["message"] + "\n")
        # The message says what was measured, with its unit ("holds 1984 NaN among 31744
        # values"): a bare "value 1984" repeats it without saying what it is. Only a threshold
        # adds something.
        if hit.get("threshold") is not None:
            text.append(f"{hit['rule']} measured {hit['value']:.4g} against its threshold "
                        f"{hit['threshold']:.4g}   ", style="dim")  # fmt: skip
        summary = hit.get("summary") or {}
        if summary:
            text.append(describe(summary, summary.get("shape"), summary.get("dtype", "")))
        text.append("\nEnter opens the tensor.", style="dim italic")
        self.update(text)
