"""A histogram of a slice's finite values, drawn with block characters, with its NaN/Inf counts."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on, work
from textual.message import Message
from textual.widgets import Static

HEIGHT = 8  # rows of bars
EIGHTHS = " ▁▂▃▄▅▆▇█"


def draw(hist: dict[str, Any], height: int = HEIGHT) -> Text:
    """Bars of ``hist["counts"]`` (one column a bin), the range under them, then NaN/Inf counts."""
    counts = hist["counts"]
    peak = max(counts, default=0)
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
    for key, label in (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf")):
        n = hist.get(key, 0)
        text.append(f"{label} {n:,}", style="bold red" if n else "dim")
        text.append("   ")
    return text


class HistogramView(Static):
    """Fed with a ``histogram()`` reply; the drawing happens in a thread worker."""

    class Drawn(Message):
        def __init__(self, text: Text) -> None:
            super().__init__()
            self.text = text

    def __init__(self) -> None:
        super().__init__("", id="histogram")
        self.border_title = "histogram of the finite values"

    @property
    def bins(self) -> int:
        """How many bins fit the width (one column each)."""
        return max(8, min(64, self.content_size.width or 32))

    @work(thread=True, exclusive=True, group="histogram")
    def show(self, hist: dict[str, Any]) -> None:
        self.post_message(self.Drawn(draw(hist)))

    def show_message(self, text: str) -> None:
        self.update(Text(text, style="dim"))

    @on(Drawn)
    def _drawn(self, message: Drawn) -> None:
        message.stop()
        self.update(message.text)
