"""The Run tab's curves: each step at its own place across the width, a gap where a step never
reached the UI, a red ``×`` where its value is not finite."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from rich.color import Color, blend_rgb
from rich.console import Console, ConsoleOptions
from rich.segment import Segment
from rich.style import Style
from textual.app import RenderResult
from textual.renderables.sparkline import Sparkline as SparklineRenderable
from textual.widgets import Sparkline

FLAT = 1e-3  # a curve whose spread is within this fraction of its magnitude is drawn flat
MARK = "×"  # a column whose steps' values are all non-finite
MARK_STYLE = Style(color="red", bold=True)


class StepSparkline(Sparkline):
    """A curve with each step at its own place across the width: a step has a column (or
    several), and a column that covers several steps draws their mean. A step received without
    a value (not measured) between two with one continues the curve; a step never received (the
    status events left it out and the history could not be read, as when the run ended just
    after) is a gap, not drawn as if it held the value before it; a step whose value is not
    finite is a red ``×`` at the bottom, not a bar. A flat series is a level line at half height.

    Textual's sparkline spreads the values it is given over the width whatever their steps (the
    points after a gap, or before a run of NaN, were drawn at other steps' places), and scales
    a series to its own extent: the rounding noise of a loss that does not move filled the
    whole height, a constant one lay along the bottom as if there were no data."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._steps: list[int] = []
        self._values: list[Any] = []

    def plot(self, steps: Sequence[int], values: Sequence[Any]) -> None:
        """Draw ``values`` (numbers, NaN, infinities or None) at their ``steps`` (ascending)."""
        self._steps, self._values = list(steps), list(values)
        self.refresh()

    def render(self) -> RenderResult:
        drawn = super().render()  # for the colours the widget's styles give
        if not isinstance(drawn, SparklineRenderable):
            return drawn
        drawn_columns = columns_of(self._steps, self._values, self.size.width)
        level = bool(finite(self._values)) and flat(finite(self._values))
        return Bars(drawn_columns, self.size.height, level, drawn.min_color, drawn.max_color)


class Bars:
    """Columns drawn as bars ``height`` rows high, as Textual's sparkline draws its bars:
    a number's bar is as high as it is within the columns' range (half height when ``flat``),
    coloured from ``low`` to ``high`` style; ``MARK`` is a non-finite step; None is blank."""

    BARS = SparklineRenderable.BARS

    def __init__(self, columns: list[float | str | None], height: int, flat: bool,
                 low: Style, high: Style) -> None:  # fmt: skip
        self.columns, self.height, self.flat = columns, height, flat
        self.low = (low.color or Color.default()).get_truecolor()
        self.high = (high.color or Color.default()).get_truecolor()
        numbers = [c for c in columns if isinstance(c, float)]
        self.bottom = min(numbers, default=0.0)
        self.extent = max(numbers, default=0.0) - self.bottom or 1.0

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Segment]:
        for row in reversed(range(self.height)):
            for column in self.columns:
                yield self._cell(column, row)
            if row:
                yield Segment.line()

    def _cell(self, column: float | str | None, row: int) -> Segment:
        if column is None:
            return Segment(" ")
        if isinstance(column, str):
            return Segment(column if row == 0 else " ", MARK_STYLE if row == 0 else None)
        ratio = 0.5 if self.flat else (column - self.bottom) / self.extent
        level = int(ratio * (len(self.BARS) * self.height - 1)) - row * len(self.BARS)
        if level < 0:
            return Segment(" ")
        colour = Color.from_triplet(blend_rgb(self.low, self.high, ratio))
        return Segment(self.BARS[min(level, len(self.BARS) - 1)], Style(color=colour))


def flat(values: Sequence[float]) -> bool:
    """Whether the values spread over no more than ``FLAT`` of their magnitude: a level with
    noise on it, which scaled to its own extent would look like wild swings."""
    low, high = min(values), max(values)
    return high - low <= FLAT * max(abs(low), abs(high))


def columns_of(steps: list[int], values: list[Any], width: int) -> list[float | str | None]:
    """What each of ``width`` columns draws of the steps it covers (steps ``steps[0]`` to
    ``steps[-1]`` spread evenly, so that each step is at its own place): the mean of their
    finite values; ``MARK`` where their values are all non-finite; where they have no value,
    the value of the column before when a later column has one (the curve goes on over steps
    not measured), else None; None where none of its steps was received (a gap)."""
    if not steps or width <= 0:
        return []
    span = steps[-1] - steps[0] + 1
    out: list[float | str | None] = []
    received: list[bool] = []
    for column in range(width):
        first = column * span // width
        end = max((column + 1) * span // width, first + 1)
        lo, hi = bisect_left(steps, steps[0] + first), bisect_left(steps, steps[0] + end)
        given = [v for v in values[lo:hi] if v is not None]
        numbers = finite(given)
        out.append(_mean(numbers) if numbers else MARK if given else None)
        received.append(hi > lo)
    return _carry_over(out, received)


def _carry_over(
    columns: list[float | str | None], received: list[bool]
) -> list[float | str | None]:
    """Columns without a value take the number of the column before them, when one follows
    that has a value (a step not measured lies between measured ones); a column none of whose
    steps was ``received`` stays empty, and no value is carried across it."""
    last = max((i for i, c in enumerate(columns) if c is not None), default=-1)
    held: float | str | None = None
    out: list[float | str | None] = []
    for i, (column, heard) in enumerate(zip(columns, received, strict=True)):
        if not heard:
            held = None
        elif column is not None:
            held = column if isinstance(column, float) else None
        out.append(column if column is not None or i > last or not heard else held)
    return out


def finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def _mean(values: Any) -> float:
    return sum(values) / len(values)
