"""A histogram of a slice's finite values, drawn with block characters, with its NaN/Inf counts."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.message import Message
from textual.widgets import Static

from tensordbg.tui.errors import work

HEIGHT = 8  # rows of bars
EIGHTHS = " ▁▂▃▄▅▆▇█"
NON_FINITE = (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf"))


def draw(hist: dict[str, Any], height: int = HEIGHT) -> Text:
    """Bars of ``hist["counts"]`` (one column a bin), the range under them, then NaN/Inf counts."""
    counts = hist["counts"]
    peak = max(counts, default=0)
    if not peak:  # no finite value: there is nothing to draw, and no range ("nan … nan")
        return _no_finite_values(hist)
    text = Text()
    text.append(f"peak {peak:,} per bin\n", style="dim")
    # Each bin's height in eighths of a row; a non-empty bin shows at least one eighth.
    levels = [max(1, round(c / peak * height * 8)) if c else 0 for c in counts] if peak else []
    for row in range(height - 1, -1, -1):
        line = "".join(EIGHTHS[min(8, max(0, level - row * 8))] for level in levels)
        text.append(line + "\n", style="cyan")
    lo, hi = f"{hist['min']:.4g}", f"{hist['max']:.4g}"
    gap = max(1, len(counts) - len(lo) - len(hi))
    text.append(f"{lo}{' ' * gap}{hi}\n", style="dim")
    for key, label in NON_FINITE:
        n = hist.get(key, 0)
        text.append(f"{label} {n:,}", style="bold red" if n else "dim")
        text.append("   ")
    return text


def _no_finite_values(hist: dict[str, Any]) -> Text:
    """``All 1,984 values are NaN.``, ``The one value is NaN.`` or ``No finite value: NaN 12
    +Inf 4``."""
    counts = {label: hist.get(key, 0) for key, label in NON_FINITE}
    present = {label: n for label, n in counts.items() if n}
    if len(present) == 1:
        ((label, n),) = present.items()
        said = f"The one value is {label}" if n == 1 else f"All {n:,} values are {label}"
        return Text(f"{said}: no finite value to draw.", style="bold red")
    if present:
        listed = "   ".join(f"{label} {n:,}" for label, n in present.items())
        return Text(f"No finite value to draw: {listed}.", style="bold red")
    return Text("No values: the slice is empty.", style="dim")


class HistogramView(Static):
    """Fed with a ``histogram()`` reply; the drawing happens in a thread worker. When the
    histogram on show has not one bin a column (it was asked for before the box had its width,
    or the terminal was resized), it posts :class:`Rebin` for its owner to ask again."""

    class Drawn(Message):
        def __init__(self, text: Text, bins: int) -> None:
            super().__init__()
            self.text = text
            self.bins = bins

    class Rebin(Message):
        """The histogram on show does not fit the width: ask again for ``bins`` bins."""

    def __init__(self) -> None:
        super().__init__("", id="histogram")
        self.border_title = "histogram of the finite values"
        self.shown_bins = 0  # bins of the histogram on show; 0 when none is
        # Which value it is of, when not the one the tensor's statistics are of (a replayed
        # hit's weight whose value at the hit was not dumped: the value after the update).
        self.values_of = ""

    @property
    def bins(self) -> int:
        """How many bins fit the width (one column each)."""
        return max(8, min(64, self.content_size.width or 32))

    @property
    def fits(self) -> bool:
        """Whether the histogram on show, if any, has one bin a column of the box as laid out
        (not yet known before the first layout)."""
        return self.shown_bins == 0 or (
            self.content_size.width > 0 and self.shown_bins == self.bins
        )

    @work(thread=True, exclusive=True, group="histogram")
    def show(self, hist: dict[str, Any]) -> None:
        text = draw(hist)
        if self.values_of:  # above it: the border title is cut short in a narrow box
            text = Text.assemble((f"Of {self.values_of}:\n", "bold yellow"), text)
        self.post_message(self.Drawn(text, len(hist["counts"])))

    def show_message(self, text: str) -> None:
        self.shown_bins = 0
        self.update(Text(text, style="dim"))

    def on_resize(self) -> None:
        self._ask_to_fit()

    def _ask_to_fit(self) -> None:
        if self.content_size.width and not self.fits:
            self.post_message(self.Rebin())

    @on(Drawn)
    def _drawn(self, message: Drawn) -> None:
        message.stop()
        self.shown_bins = message.bins
        self.update(message.text)
        self._ask_to_fit()  # the width may have changed while it was on its way
