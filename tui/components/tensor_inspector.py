"""The Tensor tab: a slice box, the slice's one-line summary, its values, a comparison with the
previous step and a histogram."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Input, Static

from tensordbg.sources.slicing import MAX_TEXT, SliceError, axis_labels, parse_index
from tensordbg.tui.components.histogram_view import HistogramView
from tensordbg.tui.components.slice_input import SliceInput
from tensordbg.tui.components.stats_compare import StatsCompare
from tensordbg.tui.components.tensor_grid import TensorGrid
from tensordbg.tui.errors import work
from tensordbg.tui.remote import RequestFailed, remote_of


class TensorInspector(Vertical):
    """One tensor at a time; a bad slice leaves the last good view in place, with the reason."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left_square_bracket", "edit_slice", "Slice"),
    ]
    _whole: tuple[int, ...] | None = None
    """The shape of the tensor shown, once seen unsliced: what a slice's labels come from."""

    def __init__(self) -> None:
        super().__init__(id="tensor-inspector")
        self.ref: int | None = None
        self.step: int | None = None  # the step its values are of, where that is known
        self.shown_step: int | None = None  # the step on show (the banner's)
        self._session: tuple[Any, Any] = (None, None)  # the rank and run connected to
        self.tensor_name = ""
        self.text = ""
        self._opening = False  # a tensor was opened and nothing of it has been shown yet

    def compose(self) -> ComposeResult:
        yield Static(
            "No tensor open: press Enter on a hit or on a module's tensor.", id="tensor-title"
        )
        yield SliceInput()
        yield Static("", id="slice-error")
        yield Static("", id="tensor-summary")
        with Horizontal(id="tensor-body"):
            grid = TensorGrid()
            grid.open_slice = self.action_edit_slice  # "[" on the grid, in order with what follows
            yield grid
            # The histogram first: it has the values of any tensor opened, where the previous
            # step's column is often blank (deferred checks measure a clean step's activations
            # only on a problem); a short terminal scrolls to the comparison.
            with VerticalScroll(id="tensor-side"):
                yield HistogramView()
                yield StatsCompare()

    def open(self, ref: int, name: str = "", text: str = "", focus: bool = True,
             step: int | None = None, shown: int | None = None) -> None:  # fmt: skip
        """Show tensor ``ref`` (of ``step`` where known: its statistics say, as they come) while
        step ``shown`` is on show; ``focus``: its values take the keys (False from another tab:
        focusing a widget of a hidden tab switches to that tab). A tensor of another step than
        the one on show (a hit of a replay's later step) says its step in its title."""
        self.ref, self.tensor_name, self.step = ref, name or f"tensor {ref}", step
        self.shown_step = shown
        self._opening = True  # until its first view arrives
        self._whole = None
        self.query_one(SliceInput).value = text
        self._show_error("")
        self.load(text)
        if focus:
            self.query_one(TensorGrid).focus()

    def reconnected(self, info: dict) -> None:
        """Connected anew (another rank of the job, R): a tensor left open is the last
        session's, said so with its rank."""
        session = (info.get("rank"), info.get("run_id"))
        if self.ref is not None and session != self._session:
            self.moved_on(f"rank {self._session[0]}'s, not this rank's: reopen it here")
        self._session = session

    def replay_moved(self, step: int) -> None:
        """A replay moved to dumped step ``step``: the values shown stay their step's (back at
        their own step, the title says no more than the tensor's name)."""
        self.shown_step = step
        if self.ref is not None and self.step == step:
            self.query_one("#tensor-title", Static).update(self._title())
            return
        shown = "an earlier step's" if self.step is None else f"step {self.step}'s"
        self.moved_on(f"{shown} values; the replay is at step {step}: open it again")

    def moved_on(self, note: str) -> None:
        """The training or the replay left the phase of the open tensor: its values stay, said
        to be that phase's (they are no longer served; a slice asks in vain)."""
        if self.ref is not None:
            title = Text(self.tensor_name, style="bold")
            title.append(f"  ({note})", style="bold yellow")
            self.query_one("#tensor-title", Static).update(title)

    def action_edit_slice(self) -> None:
        box = self.query_one(SliceInput)
        # Focused now, not after the keys already queued (widget.focus() waits for them): a
        # fast "[3]" would send "3" to the grid, where it is a count prefix.
        self.screen.set_focus(box)
        # "[" types the start of a new slice: the one applied before is replaced, not appended
        # to (the box keeps its text when it is focused otherwise, to edit it).
        box.value = "["
        box.cursor_position = 1

    @on(Input.Changed, "#slice-input")
    def _typed(self, event: Input.Changed) -> None:
        result = event.validation_result
        self._show_error(
            "" if result is None or result.is_valid else result.failure_descriptions[0]
        )

    @on(Input.Submitted, "#slice-input")
    def _submitted(self, event: Input.Submitted) -> None:
        result = event.validation_result
        if result is not None and not result.is_valid:
            self._show_error(result.failure_descriptions[0])
        elif self.ref is None:
            self._show_error("Open a tensor first: Enter on a hit or on a module's tensor.")
        else:
            self.load(event.value)
            # Applied: the keys are the debugger's again (c typed into the box, before).
            self.screen.set_focus(self.query_one(TensorGrid))

    def _show_error(self, message: str) -> None:
        self.query_one("#slice-error", Static).update(Text(message, style="bold red"))

    @work(group="inspect", exclusive=True)
    async def load(self, text: str) -> None:
        """Summary and comparison, then the grid (which fetches its own blocks), then the
        histogram; a refused slice keeps the previous view and shows why."""
        ref = self.ref
        if ref is None:
            return
        opening = self._opening
        try:
            stats = await remote_of(self).stats(ref, text)
        except RequestFailed as e:
            if self._opening:  # nothing of the tensor shown before stays on screen
                self.query_one("#tensor-title", Static).update(self._title())
                self.query_one("#tensor-summary", Static).update("")
                self.query_one(StatsCompare).update("")
                self.query_one(TensorGrid).clear("No values to show (why is said above).")
                self.query_one(HistogramView).show_message("")
            self._show_error(e.message)
            return
        self._opening = False
        # Its canonical text (what the title shows), unless that is past what a source accepts
        # (it spaces the commas: 39 Nones typed in 196 characters are 234): then as typed, or a
        # histogram asked again for it would be refused.
        self.text = stats["index"] if len(stats["index"]) <= MAX_TEXT else text
        line = stats["line"]
        self.step = stats.get("step", self.step)  # the source's word: a ref names its step
        self.query_one("#tensor-title", Static).update(self._title())
        alarm = any(stats["summary"].get(k) for k in ("nan", "posinf", "neginf"))
        self.query_one("#tensor-summary", Static).update(
            Text(line, style="bold red" if alarm else "bold")
        )
        self.query_one(StatsCompare).show(stats)
        self.query_one(HistogramView).values_of = stats.get("values_of", "")
        if not stats["index"]:
            self._whole = tuple(stats["shape"])
        grid = self.query_one(TensorGrid)
        grid.show(ref, text, tuple(stats["shape"]), self._labels())
        bad = sum(stats["summary"].get(k) or 0 for k in ("nan", "posinf", "neginf"))
        if opening and 0 < bad < (stats["summary"].get("numel") or 0):
            grid.action_find_bad()  # opened with a few NaN among many: the first is shown
        await self._histogram(ref, text)

    def _title(self) -> Text:
        """The tensor's name (its ref is the source's, not the person's), its step when another
        is on show, and its slice."""
        title = Text(self.tensor_name, style="bold")
        if None not in (self.step, self.shown_step) and self.step != self.shown_step:
            title.append(f"  (step {self.step}'s)", style="bold yellow")
        if self.text:
            title.append(f"  slice {self.text}")
        return title

    def _labels(self) -> list[Sequence[int] | None] | None:
        """The tensor's indices along each dim of the slice shown (None: its positions, when
        the tensor was not seen whole first)."""
        if not self.text or self._whole is None:
            return None
        try:
            return axis_labels(self._whole, parse_index(self.text))
        except SliceError:
            return None

    @on(HistogramView.Rebin)
    def _rebin(self, event: HistogramView.Rebin) -> None:
        event.stop()
        if self.ref is not None:
            self._refetch_histogram(self.ref, self.text)

    @work(group="histogram-fetch", exclusive=True)
    async def _refetch_histogram(self, ref: int, text: str) -> None:
        await self._histogram(ref, text)

    async def _histogram(self, ref: int, text: str) -> None:
        """Ask for the histogram of ``ref[text]`` with one bin a column of the box, and show it
        unless another tensor or slice was opened meanwhile."""
        histogram = self.query_one(HistogramView)
        try:
            hist = await remote_of(self).histogram(ref, text, bins=histogram.bins)
        except RequestFailed as e:
            if self.ref == ref:
                histogram.show_message(f"No histogram: {e.message}")
            return
        if self.ref == ref:
            histogram.show(hist)
