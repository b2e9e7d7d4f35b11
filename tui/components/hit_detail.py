"""Everything about the hit under the cursor in the Hits tab, its message unabridged.

What a person reads first comes first, so that a short terminal cuts only the end of a long
message (the pane scrolls for the rest): which rule found what where, the tensor's one-line
summary with the key that opens it, the rule's measure, then the message.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from tensordbg.statistics import describe
from tensordbg.tui.errors import work
from tensordbg.tui.remote import RequestFailed, remote_of

UNCOUNTED = "no counts were kept with the hit: its message says what its rule found"
"""Said after a summary that has only a shape and a dtype, where the tensor cannot be measured
now (a gradient checked in batched mode keeps no statistics with its hit)."""


NO_HITS = {
    "replay": "This recorded run holds no hits.",
    "finished": "No hits: the training finished without one.",
}
"""What the detail says with no hit to show, by the app's state: "No hits yet." while a training
may still hit (it said so of a recording and of a finished training)."""


class HitDetail(Static):
    """Fed with a hit dict (``Hit.as_dict``)."""

    def __init__(self) -> None:
        super().__init__("", id="hit-detail")
        self._hit: dict[str, Any] | None = None
        self._filtered_out = ""

    def on_mount(self) -> None:
        if hasattr(self.app, "state"):  # a training that ends with no hit: "yet" is over
            self.watch(self.app, "state", self._state_changed, init=False)

    def _state_changed(self) -> None:
        if self._hit is None:
            self.show(None, self._filtered_out)

    def show(self, hit: dict[str, Any] | None, filtered_out: str = "",
             rules: list[str] | None = None, measurable: bool = False) -> None:  # fmt: skip
        """``rules``: every rule that found what the hit says (its own by default).
        ``measurable``: the hit's tensor is held now (the training is paused in the hit's
        phase), so a summary without counts is completed from its statistics."""
        self._hit = hit
        self._filtered_out = filtered_out
        if hit is None and filtered_out:
            self.update(Text(f"No hit matches the filter '{filtered_out}': press / and clear "
                             "it to see them all.", style="dim"))  # fmt: skip
            return
        if hit is None:
            state = str(getattr(self.app, "state", ""))
            self.update(Text(NO_HITS.get(state, "No hits yet."), style="dim"))
            return
        rules = rules or [hit["rule"]]
        summary = hit.get("summary") or {}
        line = describe(summary, summary.get("shape"), summary.get("dtype", ""))
        uncounted = bool(summary) and all(key in ("shape", "dtype") for key in summary)
        if uncounted and not measurable:
            line = f"{line} ({UNCOUNTED})"
        self._draw(hit, rules, line)
        if uncounted and measurable:
            self._measure(hit, rules, line)

    @work(group="hit-detail", exclusive=True)
    async def _measure(self, hit: dict[str, Any], rules: list[str], line: str) -> None:
        """The counts of a hit that kept none, from its tensor, held at this pause."""
        try:
            stats = await remote_of(self).stats(hit["ref"])
        except RequestFailed:
            stats = None
        if self._hit is hit:  # the cursor is still on it
            self._draw(hit, rules, stats["line"] if stats else f"{line} ({UNCOUNTED})")

    def _draw(self, hit: dict[str, Any], rules: list[str], line: str) -> None:
        text = Text()
        text.append(f"[{', '.join(rules)}] ", style="bold")
        text.append(hit["tensor"], style="bold red" if hit["origin"] else "bold")
        where = "where the problem was produced" if hit["origin"] else "passed on from upstream"
        kind, module = hit["kind"], hit["module"] or "(model)"
        if kind == "observed":  # a loss given to observe(): no module made it, no call
            text.append("  observed")
        elif kind in ("param", "grad", "update", "buffer"):  # its module's, of no one call
            text.append(f"  {kind} of {module}")
        else:
            text.append(f"  {kind} of {module}, call {hit['call']}")
        text.append(f"  step {hit['step']} {hit['phase']}  ({where})\n")
        if line:
            text.append(f"{line}   ")
        text.append("Enter opens the tensor.\n", style="dim italic")
        # The message says what was measured, with its unit ("holds 1984 NaN among 31744
        # values"): a bare "value 1984" repeats it without saying what it is. Only a threshold
        # adds something.
        if hit.get("threshold") is not None:
            text.append(f"{hit['rule']} measured {hit['value']:.4g} against its threshold "
                        f"{hit['threshold']:.4g}\n", style="dim")  # fmt: skip
        text.append(hit["message"])
        self.update(text)
