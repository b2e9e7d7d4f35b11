"""What a person new to tensordbg meets in the UI, driven as they would: keys typed fast, small
terminals, a training that goes NaN, thousands of hits. Each test is one thing the first trial got
wrong (issue 9)."""

from __future__ import annotations

import asyncio
import io
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zygote
from fake_source import FakeSource
from rich.console import Console
from rich.text import Text
from test_tui import SIZE, mounted, open_tensor, paused_on_the_two_hits, shown, text_of, until
from textual import events
from textual.command import CommandPalette
from textual.pilot import Pilot
from textual.widgets import Label, Static, TabbedContent

import tensordbg
from tensordbg.sources.live import LiveSource
from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.event_log import describe_event
from tensordbg.tui.components.histogram_view import draw
from tensordbg.tui.components.hit_table import HitTable
from tensordbg.tui.components.run_status import RunStatus
from tensordbg.tui.components.slice_input import SliceInput
from tensordbg.tui.components.tensor_grid import CELL, TensorGrid, format_block
from tensordbg.tui.launch import session_app
from tensordbg.tui.screens.rule_add import RuleAddScreen


async def type_at_once(pilot: Pilot, text: str) -> None:
    """Keys as a terminal sends a fast typist's (or a paste's): all queued before the first is
    handled, as tmux's send-keys does (``pilot.press`` waits for each key to be handled)."""
    driver = pilot.app._driver
    assert driver is not None
    for char in text:
        key = events.Key(_KEYS.get(char, char), char)
        key.set_sender(pilot.app)
        driver.send_message(key)
    await asyncio.sleep(0.05)
    await pilot.pause(0.05)


_KEYS = {
    "/": "slash",
    "\r": "enter",
    " ": "space",
    "[": "left_square_bracket",
    "]": "right_square_bracket",
    ":": "colon",
    ",": "comma",
}


def test_a_slice_typed_fast_goes_to_the_slice_box_not_to_the_count() -> None:
    """``[3]`` and Enter typed fast on the grid: ``[`` opens the slice box, the rest is text in
    it (not a count prefix for ``s``), and Enter applies the slice and leaves the box."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=SIZE) as pilot:
            grid = await open_tensor(pilot, 3, "net.2.output", TensorGrid)
            await until(pilot, lambda: app.focused is grid)
            await type_at_once(pilot, "[3]\r")  # and Enter, all in one burst
            box = app.query_one(SliceInput)
            assert box.value == "[3]"
            assert "count" not in app.main.title
            inspector = app.main.tensor_inspector
            await until(pilot, lambda: inspector.text == "[3]")
            # Applied, the keys drive the debugger again: c continues, it is not typed.
            assert app.focused is grid
            await pilot.press("c")
            assert box.value == "[3]"
            # A second slice typed the same way replaces the first (it is not appended to it).
            await type_at_once(pilot, "[0, 1:3]\r")
            assert box.value == "[0, 1:3]"
            await until(pilot, lambda: inspector.text == "[0, 1:3]")
            assert app.focused is grid
            # A slice refused keeps the keys in the box, to be mended; "[" after it starts a new
            # one ("[1:x][0]" was typed), while "[" inside a text is typed as it is.
            await type_at_once(pilot, "[1:x]\r")
            assert app.focused is box and box.value == "[1:x]"
            await type_at_once(pilot, "[2]\r")
            await until(pilot, lambda: inspector.text == "[2]")
            # So does "[" after an unclosed slice refused ("'[' was never closed"): it was
            # appended, "[1, 2:4[1, 2:4]", though an index list cannot begin there.
            await type_at_once(pilot, "[1, 2:4\r")
            assert app.focused is box and box.value == "[1, 2:4"
            await type_at_once(pilot, "[0]\r")
            await until(pilot, lambda: inspector.text == "[0]")
            box.focus()
            box.value, box.cursor_position = "[[0, 1]]", 1
            await pilot.press("[")
            assert box.value == "[[[0, 1]]"
            box.value, box.cursor_position = "[0, ", 4  # an index list after a comma
            await pilot.press("[")
            assert box.value == "[0, ["

    asyncio.run(flow())


def screen_text(app: TensorDbgApp) -> str:
    """The screen as a person sees it, line by line."""
    console = Console(width=app.size.width, height=app.size.height, record=True, file=io.StringIO())
    for strip in app.screen._compositor.render_strips():
        console.print(Text("".join(segment.text for segment in strip)), soft_wrap=True)
    return console.export_text()


def state_line(app: TensorDbgApp) -> str:
    return str(app.query_one("#run-state", Static).content)


def test_the_state_shown_is_the_state_the_training_is_in_now() -> None:
    """Paused by ``p``, then running on: the Run tab and the header say RUNNING
    at the new step, not the reason nor the hit of an earlier pause."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused" and "on a hit" in state_line(app))
            assert app.main.title == "PAUSED at step 3"
            source.state, source.paused_at, source.step = "paused", None, 4
            source.emit("state", {"state": "running", "step": 3})
            source.emit("state", {"state": "paused", "step": 4, "reason": "pause"})
            await until(pilot, lambda: "step 4" in state_line(app))
            assert "(pause)" in state_line(app) and "on a hit" not in state_line(app)
            source.state, source.step = "running", 5
            source.emit("state", {"state": "running", "step": 5})
            await until(pilot, lambda: app.state == "running")
            line = state_line(app)
            assert "RUNNING" in line and "after step 4" in line and "pause" not in line
            assert app.main.title == "RUNNING after step 4"

    asyncio.run(flow())


def test_a_status_sent_before_a_pause_does_not_undo_the_pause() -> None:
    """A status is the latest of many, and one sent just before the pause can reach a UI after
    the welcome that said "paused" (a UI that connects at the hit): the demo's UI showed
    RUNNING at step 25 with its two hits for ever, the training paused there. The state comes
    from the welcome and the state events only; the status brings its numbers."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            last = {"step": 2, "loss": 1.9, "grad_norm": 0.9, "steps_per_sec": 9.0}
            source.emit("status", {"state": "running", "step": 3, "phase": "forward",
                                   "hits_total": 2, "last": last})  # fmt: skip
            numbers = app.query_one("#run-numbers", Static)
            await until(pilot, lambda: "1.9" in str(list(numbers.content.columns[1].cells)))
            await pilot.pause(0.1)
            assert app.state == "paused" and app.main.title.startswith("PAUSED at step 3")
            assert "PAUSED" in state_line(app)
            source.emit("state", {"state": "running", "step": 3})  # a state event moves it
            await until(pilot, lambda: app.state == "running")

    asyncio.run(flow())


def test_at_80_by_24_the_header_shows_the_state_whole() -> None:
    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await pilot.pause(0.1)
            assert "PAUSED at step 3" in screen_text(app).splitlines()[0]

    asyncio.run(flow())


def test_a_nan_loss_is_shown_as_nan_and_the_curves_say_which_steps_they_cannot_draw() -> None:
    """The loss went NaN at step 4: the Run tab says NaN (not the last finite loss), the curve's
    title gives its scale and names the steps it could not draw; hits count the same as the
    Hits tab however events interleave."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            run = app.query_one(RunStatus)
            for step, loss in ((4, math.nan), (5, math.nan)):
                last = {"step": step, "loss": loss, "grad_norm": 0.5, "steps_per_sec": 9.0}
                status = {"state": "paused", "step": step + 1, "phase": "forward"}
                source.emit("status", {**status, "hits_total": 2, "last": last})
            numbers = app.query_one("#run-numbers", Static)
            await until(
                pilot, lambda: "NaN (step 5)" in str(list(numbers.content.columns[1].cells))
            )
            label = str(app.query_one("#loss-label", Label).content)
            assert "1.9 … 2.3" in label and "non-finite at steps 4–5, not drawn" in label
            hit = dict(source.hits()[0], id=2, step=5, message="a later NaN")
            source.emit("hit", hit)
            source.emit("status", {**status, "hits_total": 3, "last": None})
            await until(pilot, lambda: app.query_one(HitTable).row_count == 3)
            await pilot.pause(0.05)
            assert run._info["hits_total"] == 3

    asyncio.run(flow())


NOISE = [2.3001, 2.3002, 2.3000, math.nan, 2.3001, math.inf]


def with_history(source: FakeSource, **series: list[Any]) -> None:
    """The source's ``info()`` gives this history, a step a value from step 0 (ones for the
    series not given)."""
    steps = len(next(iter(series.values())))
    history = {key: [1.0] * steps for key in ("loss", "grad_norm", "steps_per_sec")}
    history.update(series, step=list(range(steps)))
    source.info = lambda: {**FakeSource.info(source), "history": history}  # type: ignore[method-assign]


async def run_tab(pilot: Pilot) -> None:
    """The Run tab, once the FakeSource's paused training is shown and its curves are laid out."""
    app = pilot.app
    await paused_on_the_two_hits(pilot)  # the Hits tab has come forward
    await mounted(pilot)
    app.main.show_tab("run")
    await until(pilot, lambda: app.query_one("#grad-spark").size.height == 4)


def drawn(app: TensorDbgApp, spark: str) -> list[str]:
    """The rows of a curve (``loss`` or ``grad``), top first."""
    widget = app.query_one(f"#{spark}-spark")
    return [widget.render_line(y).text for y in range(widget.size.height)]


def title(app: TensorDbgApp, spark: str) -> str:
    return str(app.query_one(f"#{spark}-label", Label).content)


@pytest.mark.parametrize(
    ("loss", "scale"),
    [
        (NOISE * 5, "Loss  2.3000 … 2.3002, flat within 0.1% over steps 0–29  10 non-finite"),
        ([2.3] * 30, "Loss  2.3 at every step, 0–29"),
        ([2.3], "Loss  2.3 at step 0"),
    ],
    ids=["noise", "constant", "one-point"],
)
def test_a_loss_that_does_not_move_is_drawn_flat_and_its_title_gives_the_scale(
    loss: list[float], scale: str
) -> None:
    """A loss stuck at 2.3 give or take 0.0002 (or exactly, or one step of it) is drawn as a
    level line at half the curve's height, not its noise stretched into full-height bars, nor
    along the bottom as if there were no data; the title has the digits that tell its ends apart
    and counts the non-finite points it leaves out, which are marked × at their steps. A value
    that does not change is said once: ``2.3 at every step, 0–29`` (not "throughout over")."""
    source = FakeSource()
    with_history(source, loss=loss)

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await run_tab(pilot)
            width = app.query_one("#loss-spark").size.width
            finite = [math.isfinite(loss[c * len(loss) // width]) for c in range(width)]
            level = "".join("█" if f else " " for f in finite)
            marks = "".join("█" if f else "×" for f in finite)
            assert drawn(app, "loss") == [" " * width] * 2 + [level, marks]
            assert title(app, "loss").startswith(scale)

    asyncio.run(flow())


def test_non_finite_steps_keep_their_place_and_the_finite_ones_are_not_stretched() -> None:
    """Steps 6–10 NaN: steps 0–5 are drawn over the first 6/11 of the width, each at its own
    step's place, and steps 6–10 are marked × where they are (the six finite points were spread
    over the whole width: the right edge read as step 10 where it was step 5)."""
    source = FakeSource()
    loss = [3.0, 2.0, 1.5, 1.0, 0.75, 0.5] + [math.nan] * 5
    with_history(source, loss=loss)

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await run_tab(pilot)
            top, *_, bottom = drawn(app, "loss")
            width = len(bottom)
            for column in range(width):
                step = column * len(loss) // width
                assert (bottom[column] == "×") == (step >= 6), (column, step)
                assert (top[column] != " ") == (step == 0), (column, step)  # the highest loss
            assert "5 non-finite at steps 6–10, not drawn" in title(app, "loss")

    asyncio.run(flow())


def test_a_gradient_norm_never_measured_says_so_and_draws_nothing() -> None:
    """Rules that need no gradient norm (``--rules NaN,Overflow``): every step's norm is None.
    The curve said "Gradient norm over steps 0–79" over a row of ▁, as if there were data."""
    source = FakeSource()
    with_history(source, loss=[2.0 - s / 100 for s in range(80)], grad_norm=[None] * 80)

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await run_tab(pilot)
            assert title(app, "grad") == "Gradient norm  not measured at steps 0–79"
            assert not "".join(drawn(app, "grad")).strip()
            assert "".join(drawn(app, "loss")).strip()  # the loss is drawn

    asyncio.run(flow())


def test_a_fast_training_has_every_step_on_the_curve_with_a_ui_connected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 fast steps whose loss zig-zags, with the UI connected over the socket: the server
    sends ten status events a second at most (the latest wins), and the curve had the two that
    came, under "over steps 0–19". The UI reads the steps left out from the training's history:
    every step is on the curve, at its own place (a UI opened afterwards drew them all)."""
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(tmp_path))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    session = tensordbg.attach(model, optimizer, on_hit="record", run_id="fast1",
                               summary_at_exit=False)  # fmt: skip
    app = session_app(run_id="fast1", wait=10.0)
    assert app is not None

    def train() -> None:
        for step in range(20):
            model(torch.ones(1, 2)).sum().backward()
            session.observe("loss", torch.tensor(2.0 if step % 2 == 0 else 1.0))
            optimizer.step()

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "running")
            await asyncio.to_thread(train)
            run = app.main.run_status
            await until(pilot, lambda: run._history["step"] == list(range(20)))
            assert run._history["loss"] == [2.0, 1.0] * 10
            await pilot.pause(0.1)
            assert title(app, "loss") == "Loss  1 … 2 over steps 0–19"
            top = drawn(app, "loss")[0]
            assert top == "".join("█ "[c * 20 // len(top) % 2] for c in range(len(top)))

    try:
        asyncio.run(flow())
    finally:
        session.detach()


def test_the_last_steps_numbers_that_come_just_after_finished_are_shown() -> None:
    """The server can send a status behind the state event saying the training finished (when
    both are posted while it sends hits, the state events go first). The UI stopped reading at
    "finished": a run that ended at step 12 showed "NaN (step 10)" as its latest loss though step
    11 had one. It reads on for a moment after "finished"."""
    source = FakeSource()
    loss = [2.0] * 10 + [math.nan]
    with_history(source, loss=loss)
    source.state, source.paused_at, source.step = "running", None, 11

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "running")
            numbers = app.query_one("#run-numbers", Static)
            latest = lambda: str(list(numbers.content.columns[1].cells)[-1])  # noqa: E731
            await until(pilot, lambda: latest() == "NaN (step 10)")
            # Posted together, the status last: as the server sends them (not after a delay
            # that a loaded machine could stretch past the UI's moment of reading on).
            last = {"step": 11, "loss": 0.5, "grad_norm": 1.0, "steps_per_sec": 9.0}
            source.emit("state", {"state": "detached", "step": 12})
            source.emit("state", {"state": "finished", "step": 12})
            source.emit("status", {"state": "running", "step": 12, "phase": "optimizer",
                                   "hits_total": 2, "last": last})  # fmt: skip
            await until(pilot, lambda: app.state == "finished")
            await until(pilot, lambda: latest() == "0.5 (step 11)")
            assert "FINISHED" in state_line(app) and "after step 11" in state_line(app)
            step_column = [str(cell) for cell in numbers.content.columns[0].cells]
            assert step_column == ["last step", "11"]  # step 12 never began
            await until(pilot, lambda: "has finished" in text_of(app.main.banner))  # then let go

    asyncio.run(flow())


def test_steps_the_ui_never_heard_of_are_a_gap_in_the_curve_not_the_value_before_them() -> None:
    """A run that ends just after steps the status throttle left out: its last step's numbers
    come with "finished", steps 10–18 never come (the history cannot be read once the training
    has gone). The loss curve drew them as a flat line at step 9's loss, as if the loss had
    held there; they are a gap, and the title says which steps were not received."""
    source = FakeSource()
    with_history(source, loss=[3.0 - step / 10 for step in range(10)])
    source.state, source.paused_at, source.step = "running", None, 10

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "running")
            await until(pilot, lambda: app.query_one("#loss-spark").size.height == 4)
            last = {"step": 19, "loss": 1.0, "grad_norm": 1.0, "steps_per_sec": 9.0}
            source.emit("state", {"state": "finished", "step": 20})
            source.emit("status", {"state": "running", "step": 20, "phase": "optimizer",
                                   "hits_total": 2, "last": last})  # fmt: skip
            await until(pilot, lambda: "has finished" in text_of(app.main.banner))
            await pilot.pause(0.1)
            rows = drawn(app, "loss")
            width = len(rows[0])
            for column in range(width):
                step = column * 20 // width
                bars = "".join(row[column] for row in rows).strip()
                assert bool(bars) == (step not in range(10, 19)), (column, step)
            # Called lost once the UI's read of the history (which it can no longer make)
            # has been tried: half a second at most, later under load.
            said = "over steps 0–19  steps 10–18 not received"
            await until(pilot, lambda: title(app, "loss").endswith(said))

    asyncio.run(flow())


def test_steps_the_ui_has_not_read_yet_are_not_called_lost() -> None:
    """A fast run: status events leave steps out, and the UI reads them from the training's
    history half a second later at most. Meanwhile the title said "steps 11–14 not received",
    as if they were lost; it says so only of steps the history, once read, did not have."""
    source = FakeSource()
    with_history(source, loss=[3.0 - step / 10 for step in range(10)])
    source.state, source.paused_at, source.step = "running", None, 10
    held, reading = threading.Event(), threading.Event()
    every_step = FakeSource()
    with_history(every_step, loss=[3.0 - step / 10 for step in range(20)])

    def info() -> dict[str, Any]:  # the training's reply is slow to come
        reading.set()
        held.wait(10)
        return {**every_step.info(), "state": "running", "step": 20}

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "running")
            await until(pilot, lambda: app.query_one("#loss-spark").size.height == 4)
            source.info = info  # type: ignore[method-assign]
            for step in (10, 15, 19):
                last = {"step": step, "loss": 2.0, "grad_norm": 1.0, "steps_per_sec": 90.0}
                source.emit("status", {"state": "running", "step": step + 1, "hits_total": 2,
                                       "phase": "optimizer", "last": last})  # fmt: skip
            await until(pilot, lambda: app.main.run_status._history["step"][-1] == 19)
            await asyncio.to_thread(reading.wait, 10)
            await pilot.pause(0.1)
            assert "not received" not in title(app, "loss")
            held.set()
            await until(pilot, lambda: app.main.run_status._history["step"] == list(range(20)))
            await until(pilot, lambda: title(app, "loss") == "Loss  1.1 … 3 over steps 0–19")

    try:
        asyncio.run(flow())
    finally:
        held.set()


def test_at_80_columns_a_curve_title_wraps_rather_than_being_cut() -> None:
    """The demo's Run tab at 80 columns ended its loss title in "3 non-finite at steps 26–28,
    not dra": the title is a line the right edge cut. It wraps."""
    source = FakeSource()
    falling = [4.2615 - step * (4.2615 - 0.3051) / 25 for step in range(26)]
    with_history(source, loss=falling + [math.nan] * 3)  # "Loss  0.3051 … 4.262 over steps 0–28"

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(80, 24)) as pilot:
            await run_tab(pilot)
            label = app.query_one("#loss-label", Label)
            said = "3 non-finite at steps 26–28, not drawn"
            await until(pilot, lambda: said in title(app, "loss") and label.size.height == 2)

            def shown() -> str:
                return " ".join(line.strip() for line in screen_text(app).splitlines())

            await until(pilot, lambda: said in shown())  # on the screen, whole

    asyncio.run(flow())


def test_at_80_by_24_the_run_tab_scrolls_by_keys_to_the_gradient_norm() -> None:
    """Paused on a hit at 80x24, the hit's message takes several lines and the gradient-norm
    curve falls below the screen; PageDown and Down did nothing on the Run tab (its keys went
    nowhere). F1 gives the keys to the tab, and they scroll it."""
    source = FakeSource()
    source._hits[0]["message"] = (
        "net.2.output holds 2 NaN among 32 values. A NaN usually comes from 0/0, log or sqrt of a "
        "negative or zero value, or an overflow just before. Its inputs were finite: it made them."
    )

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(80, 24)) as pilot:
            await paused_on_the_two_hits(pilot)
            await pilot.press("f1")
            run, grad = app.main.run_status, app.query_one("#grad-spark")
            await until(pilot, lambda: grad.size.height == 4 and "on a hit" in state_line(app))
            shown = lambda: run.scrollable_content_region.contains_region(grad.region)  # noqa: E731
            assert not shown()  # its last rows are below the tab's bottom at first
            await pilot.press("down")
            await until(pilot, lambda: run.scroll_y == 1)
            await pilot.press("pagedown")
            await until(pilot, shown)

    asyncio.run(flow())


def test_the_loss_of_a_step_whose_loss_was_nan_is_nan() -> None:
    """What the Run tab is sent: a NaN loss is the step's loss, not left out."""
    model = torch.nn.Linear(2, 1)
    session = tensordbg.attach(model, on_hit="record", server=False, summary_at_exit=False)
    try:
        for loss in (1.0, math.nan, 2.0):
            model(torch.ones(1, 2)).sum().backward()
            session.observe("loss", torch.tensor(loss))
    finally:
        session.detach()
    losses = [loss for _, loss, _, _ in session.metrics.history]
    assert losses[0] == 1.0 and math.isnan(losses[1])


def test_a_histogram_of_only_nan_says_so_rather_than_nan_to_nan() -> None:
    nan = float("nan")
    all_nan = {"counts": [0] * 8, "min": nan, "max": nan, "nan": 1984, "posinf": 0, "neginf": 0}
    assert draw(all_nan).plain == "All 1,984 values are NaN: no finite value to draw."
    mixed = dict(all_nan, nan=3, posinf=2)
    assert draw(mixed).plain == "No finite value to draw: NaN 3   +Inf 2."
    assert "nan" not in draw(mixed).plain


def test_the_log_writes_numbers_for_people_not_dicts_and_17_digits() -> None:
    last = {"step": 25, "loss": 0.30512345678901234, "grad_norm": math.nan, "steps_per_sec": 12.1}
    status = {"state": "running", "step": 26, "phase": "forward", "hits_total": 2, "last": last}
    line = describe_event("status", status)
    assert line == (
        "step 25 done: loss 0.3051, gradient norm NaN, 12.1 steps/s; "
        "now running at step 26 (forward), 2 hits"
    )
    assert "{" not in line
    assert describe_event("custom", {"ratio": 1 / 3, "where": {"x": 2.0000000001}}) == (
        "ratio 0.3333, where {x 2}"
    )


def test_the_log_gives_a_state_the_reason_of_that_state_not_of_the_last_pause() -> None:
    """The training sends the reason of its last pause with every state event: quitting the
    demo after c, the Log said "detached at step 29 (NaN hit: ...)", as if the hit of step 25
    had detached it."""
    hit = "NaN hit: blocks.0.attn.output holds 1984 NaN among 31744 values."
    assert describe_event("state", {"state": "paused", "step": 25, "reason": hit}) == (
        f"paused at step 25 ({hit})"
    )
    line = describe_event("state", {"state": "running", "step": 29, "reason": hit})
    assert line == "running after step 28"  # between steps: the last it ended
    # Detached or finished, the step given is the next one, which never began (steps 0-28
    # ran): the last step is named, as the header names it.
    line = describe_event("state", {"state": "detached", "step": 29, "reason": hit})
    assert line == "detached after step 28"
    ended = {"state": "finished", "step": 29, "reason": "interrupted by Ctrl-C"}
    assert describe_event("state", ended) == "finished after step 28 (interrupted by Ctrl-C)"


def test_slash_on_the_hits_tab_filters_the_hits_and_end_goes_to_the_last_hit() -> None:
    """``/`` typed fast with a word filters the hits (not the model tree); Escape gives the keys
    back with the filter kept; End goes to the last hit, Home to the first."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = app.query_one(HitTable)
            await until(pilot, lambda: app.state == "paused" and hits.row_count == 2)
            passed_on = source.hits()[1]
            for i in range(300):
                source.emit("hit", dict(passed_on, id=2 + i, step=4 + i, message=f"late {i}"))
            await until(pilot, lambda: hits.row_count == 302)
            await until(pilot, lambda: app.focused is hits)
            await pilot.press("end")
            assert hits.current is not None and hits.current["id"] == 301
            assert hits.scroll_x == 0 and hits.scroll_y > 0
            await pilot.press("home")
            assert hits.current is not None and hits.current["id"] == 0

            await type_at_once(pilot, "/late 29")
            assert app.query_one(TabbedContent).active == "hits"
            assert app.main.hit_filter.value == "late 29"
            assert hits.ids == [31, *range(292, 302)]  # "late 29", "late 290".."late 299"
            await pilot.press("escape")
            assert app.focused is hits and hits.row_count == 11
            # The where column's word filters too; a filter that hides every hit says so.
            app.main.hit_filter.value = "origin"
            await until(pilot, lambda: hits.row_count == 1 and hits.current["origin"])
            app.main.hit_filter.value = "zzz"
            await until(pilot, lambda: hits.row_count == 0)
            assert "No hit matches the filter 'zzz'" in text_of(app.main.hit_detail)
            app.main.hit_filter.value = "late 29"
            await until(pilot, lambda: hits.row_count == 11)
            await pilot.press("enter")
            await until(pilot, lambda: app.main.tensor_inspector.ref == passed_on["ref"])

    asyncio.run(flow())


def test_grid_cells_never_cut_a_number_silently() -> None:
    """Numbers too long for a cell lose digits of precision, never digits of magnitude."""
    floats = format_block(np.array([[-1.2345e100, 123456.789, -0.000123456]]))[0][0]
    cells = [floats[i : i + CELL].strip() for i in range(0, len(floats), CELL)]
    assert cells == ["-1.23e+100", "1.235e+05", "-0.0001235"]
    ints = format_block(np.array([[12345678901234, -5]], dtype=np.int64))[0][0]
    assert ints[:CELL].strip() == "1.235e+13" and ints[CELL:].strip() == "-5"
    assert len(floats) == 3 * CELL and len(ints) == 2 * CELL


def test_a_column_cut_by_the_edge_of_the_grid_is_not_drawn_and_an_ellipsis_says_more_follow() -> (
    None
):
    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=(80, 24)) as pilot:
            grid = await open_tensor(pilot, 5, "big", TensorGrid)  # 1000 x 1000
            await until(pilot, lambda: grid.cell_text(0, 1) not in (None, "·"))
            line = grid.render_line(1).text.rstrip()
            assert line.endswith("…")
            values = line[:-1].split()[1:]  # the row label first
            c0, c1 = grid._visible_columns()
            assert [grid.cell_text(0, c) for c in range(c0, c1)] == values

    asyncio.run(flow())


def test_i_ignores_the_rule_of_the_hit_on_its_tensor() -> None:
    """Paused on a NaN at net.2.output: i adds the tensor to the NaN rule's exclusions through
    set_rule (the palette offers it too), and says so."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused" and app.main.hit_table.current)
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "Ignore this rule on this tensor" in titles
            await pilot.press("ctrl+p")  # asked again with the palette open, as it asks
            await shown(pilot, CommandPalette)
            titles = [c.title for c in app.get_system_commands(app.main)]
            assert "Ignore this rule on this tensor" in titles
            await pilot.press("escape")
            await until(pilot, lambda: app.screen is app.main)
            await pilot.press("i")
            await until(pilot, lambda: source._rules[0]["exclude"] == ["net.2.output"])
            assert source._rules[1]["exclude"] == []
            source.state = "running"
            source.emit("state", {"state": "running", "step": 3})
            await until(pilot, lambda: app.state == "running")
            assert "i" not in [
                b.binding.key
                for b in app.screen.active_bindings.values()
                if b.enabled and b.node is app
            ]

    asyncio.run(flow())


def test_i_on_a_row_two_rules_share_ignores_the_tensor_in_both() -> None:
    """A row of the Hits tab that names two rules (they said the same of the tensor): i makes
    each of them ignore it, and says so."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = app.main.hit_table
            await until(pilot, lambda: app.state == "paused" and hits.current)
            origin = source.hits()[0]
            source.emit("hit", dict(origin, id=2, rule="VanishingGradient"))
            await until(pilot, lambda: hits.known == 3)
            hits.select_hit(origin["id"])
            assert hits.rules_of(hits.current) == ["NaN", "VanishingGradient"]
            await pilot.press("i")
            await until(pilot, lambda: source._rules[1]["exclude"] == [origin["tensor"]])
            assert source._rules[0]["exclude"] == [origin["tensor"]]
            await until(pilot, lambda: "NaN and VanishingGradient now ignore" in
                        str(app.main.rule_panel.result.content))  # fmt: skip

    asyncio.run(flow())


def test_a_rule_told_to_ignore_a_tensor_stops_hitting_it_in_the_training() -> None:
    """The live side of i: a network that makes NaN every step hits once a step until the NaN
    rule excludes that tensor, then not at all there."""

    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * torch.tensor(float("nan"))

    model = Broken()
    session = tensordbg.attach(model, on_hit="record", server=False, summary_at_exit=False)
    source = LiveSource(session)
    try:
        model(torch.ones(2, 4))
        hit = next(h for h in source.hits() if h["rule"] == "NaN" and h["origin"])
        rule = next(r for r in source.rules()["rules"] if r["name"] == "NaN")
        source.set_rule(rule["id"], params={"exclude": [*rule["exclude"], hit["tensor"]]})
        before = len(session.hits)
        model(torch.ones(2, 4))
        model(torch.ones(2, 4))
        again = [h for h in source.hits(since=before) if h["tensor"] == hit["tensor"]]
        assert again == [] and rule["name"] == "NaN"
        assert (
            hit["tensor"]
            in next(r for r in source.rules()["rules"] if r["id"] == rule["id"])["exclude"]
        )
    finally:
        session.detach()


BROKEN_SCRIPT = """
import torch
{attach}

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.lin(x) - 100.0)  # the user's line that makes NaN

model = Net()
{session}
for step in range(3):
    model(torch.ones(2, 4)).sum().backward()
print("trained")
"""


@pytest.mark.parametrize("how", ["run", "attach"])
def test_on_hit_raise_shows_the_users_frames_and_the_summary_last(tmp_path: Path, how: str):
    attach = "import tensordbg" if how == "attach" else ""
    session = 'tensordbg.attach(model, on_hit="raise", server=False)' if how == "attach" else ""
    script = tmp_path / "train.py"
    script.write_text(BROKEN_SCRIPT.format(attach=attach, session=session))
    if how == "run":
        command = [sys.executable, "-m", "tensordbg.cli", "run", "--on-hit", "raise", str(script)]
    else:
        command = [sys.executable, str(script)]
    done = zygote.run(command, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert "Traceback" in err and "WatchpointHit" in err
    frames = [line for line in err.splitlines() if line.startswith('  File "')]
    assert frames and all("train.py" in line for line in frames), err
    assert "model(torch.ones(2, 4)).sum().backward()" in err  # the user's call
    assert err.index("WatchpointHit:") < err.index("tensordbg: 1 hit, at its origin"), err


def test_the_add_rule_dialog_keeps_its_buttons_on_screen_at_80_by_24() -> None:
    """A rule with many thresholds and a long description: the dialog's body scrolls, Add and
    Cancel stay on screen."""
    source = FakeSource()
    many = {f"threshold_{i}": float(i) for i in range(8)}
    rules = source.rules()
    source.rules = lambda: {  # type: ignore[method-assign]
        **rules,
        "available": [{"name": "TensorRange", "doc": "Bounds. " * 60, "params": many}],
    }

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await pilot.press("f6")
            await until(pilot, lambda: app.main.rule_panel.current is not None)
            await pilot.press("a")
            await shown(pilot, RuleAddScreen)
            await pilot.pause(0.1)
            for button in ("#save", "#cancel"):
                region = app.screen.query_one(button).region
                assert region.height > 0 and region.y >= 0 and region.bottom <= 24, region

    asyncio.run(flow())


def test_the_rules_tab_fits_160_columns_with_every_column_whole() -> None:
    """A rule watching every kind of tensor and disabled with a reason: at 160 columns the
    reason is on screen (it came last and was cut) and the kinds say "all"."""
    source = FakeSource()
    kinds = ["grad", "grad_input", "grad_output", "input", "observed", "output", "param", "update"]
    source._rules[0].update(kinds=kinds, disabled_reason="needs an optimizer")

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(160, 48)) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await pilot.press("f6")
            await until(pilot, lambda: app.main.rule_panel.current is not None)
            await pilot.pause(0.2)
            text = screen_text(app)
            assert "needs an optimizer" in text and "grad_input" not in text
            assert " all " in text

    asyncio.run(flow())


class StaleSource(FakeSource):
    """Paused mid-forward at step 3: net.2 has not run yet this step, its output is step 2's."""

    def modules(self) -> list[Any]:
        out = super().modules()
        for m in out:
            for summary in m["stats"].values():
                summary["step"] = 2 if m["path"] == "net.2" else 3
        return out


def test_modules_mark_statistics_from_an_earlier_step_and_name_a_passed_up_output_as_hits_do() -> (
    None
):
    async def flow() -> None:
        app = TensorDbgApp(LocalClient(StaleSource()))
        async with app.run_test(size=SIZE) as pilot:
            table = app.main.module_browser.table
            await until(pilot, lambda: table.row_count == 6)
            await pilot.press("f3")
            await until(pilot, lambda: app.focused is table)
            await pilot.pause(0.1)
            rows = {
                table.render_line(y).text.split()[0]: table.render_line(y).text for y in range(1, 7)
            }
            assert "step 2: NaN×2! n=" in rows["2"]  # net.2, last seen at step 2
            assert "step" not in rows["0"].split("Linear")[1]  # net.0 ran this step
            await type_at_once(pilot, "/Sequential")
            await until(pilot, lambda: table.row_count == 1)
            tensors = app.main.module_browser.tensor_table
            await until(pilot, lambda: tensors.row_count == 1)
            await pilot.pause(0.1)
            assert "net.output = net.2.output" in tensors.render_line(1).text

    asyncio.run(flow())


def test_a_module_that_returns_its_childs_output_shows_it_as_its_own() -> None:
    """The demo's attention returns its output projection's output: the attention's row in the
    Modules tab has that output's statistics (it was empty)."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(torch.softmax(x, dim=-1))

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Attention())
    session = tensordbg.attach(model, on_hit="record", server=False, summary_at_exit=False)
    try:
        model(torch.ones(2, 4))
        modules = {m["path"]: m for m in LiveSource(session).modules()}
    finally:
        session.detach()
    output = modules["1"]["stats"]["output"]  # 1.proj's output, returned by 1
    assert output["numel"] == 8 and output["shape"] == [2, 4]


class Masked(torch.nn.Module):
    """Attention-like: its own code makes the NaN (a softmax over a fully masked row) and its
    output projection returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = x.masked_fill(~keep, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # 0/0 on a row with nothing kept
        return self.proj(weights)


def test_provenance_of_a_value_made_inside_a_modules_forward_shows_the_line_inside_it() -> None:
    model = Masked()
    session = tensordbg.attach(model, on_hit="record", server=False, summary_at_exit=False)
    source = LiveSource(session)
    try:
        keep = torch.tensor([[True, True, False, False], [False, False, False, False]])
        model(torch.ones(2, 4), keep)
        hit = next(h for h in source.hits() if h["origin"])
        prov = source.provenance(hit["ref"], hit["module"], hit["call"])
    finally:
        session.detach()
    assert prov["source"]["function"] == "forward"
    listing = dict(prov["source"]["context"])
    # The innermost user line: the softmax that made the NaN, not the return below it.
    assert "weights = torch.softmax(scores" in listing[prov["source"]["line"]]
    assert any("return self.proj(weights)" in text for text in listing.values())
    assert prov["operation"]["op"] == "torch.softmax"
    # The bool mask that hid the second row, which no rule judges, is listed with a summary.
    mask = next(i for i in prov["inputs"] if i["dtype"] == "bool")
    assert mask["name"] == "input[1]" and mask["ref"] is None and mask["shape"] == [2, 4]
    assert mask["line"] == "bool mask: 2 of 8 True; 1 of 2 rows all False"
    assert prov["stack"][-1][1] == prov["source"]["line"]
    assert "the first NaN came from torch.softmax" in hit["message"]


def test_run_help_lists_the_rules_by_name() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensordbg.cli", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    assert "NaN," in text and "TensorRange" in text and "WeightUpdateRatio" in text


def test_a_training_held_by_a_rule_that_hangs_says_which_rule_in_the_run_tab(monkeypatch) -> None:
    """A training that has gone quiet is asked what it does: the Run tab names the rule check
    under way and its tensor, and stops naming it once the training speaks again (issue 8).
    Switched off meanwhile, the rule says the change waits for the training's next hook."""
    import threading

    from models import hanging_rule, two_linears

    from tensordbg.tui.screens import main

    monkeypatch.setattr(main, "QUIET_AFTER", 0.5)
    slow, release, entered = hanging_rule("fc2")
    model = two_linears()
    session = tensordbg.attach(model, rules=[slow], server=False, on_hit="record",
                               sync="eager", summary_at_exit=False)  # fmt: skip
    worker = threading.Thread(target=lambda: model(torch.randn(3, 4)).sum().backward())

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(LiveSource(session)))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "running")
            worker.start()
            assert entered.wait(30)
            await until(pilot, lambda: "in rule Slow on fc2.output" in state_line(app))
            # Switched off while it hangs: accepted, made at the training's next hook.
            panel = app.main.rule_panel
            await until(pilot, lambda: panel.table.row_count == 1)
            panel.action_toggle()
            switch = lambda: str(panel.table.get_row_at(0)[0])  # noqa: E731
            await until(pilot, lambda: switch() == "✗ (next hook)")
            release.set()
            worker.join(30)
            model(torch.randn(3, 4))  # the training speaks again: a new step's status
            await until(pilot, lambda: "in rule" not in state_line(app))
            await until(pilot, lambda: switch() == "✗")  # made: the mark is gone
            # ...and so is the note that it waits for the training.
            note = str(panel.result.content)
            assert "made when the training reaches" not in note and note.endswith(": made.")

    try:
        asyncio.run(flow())
    finally:
        release.set()
        session.detach()


def test_a_training_tensordbg_stopped_watching_says_so_in_the_run_tab(monkeypatch) -> None:
    """tensordbg's own fault stops the watching, never the training: the Run tab says the
    training runs unwatched and why, to the UI connected then and to one that connects later
    (it said RUNNING, as if every step were checked)."""
    import warnings as warnings_module

    from models import two_linears

    model = two_linears()
    session = tensordbg.attach(model, server=False, on_hit="record", summary_at_exit=False)

    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tensordbg bug")

    async def flow(fails: bool) -> None:
        app = TensorDbgApp(LocalClient(LiveSource(session)))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "running")
            if fails:
                assert "NOT WATCHED" not in state_line(app)
                for name, module in list(sys.modules.items()):
                    if name.startswith("tensordbg.engine.") and hasattr(module, "host_stats"):
                        monkeypatch.setattr(module, "host_stats", explode)
                with warnings_module.catch_warnings(record=True):
                    warnings_module.simplefilter("always")
                    model(torch.randn(3, 4)).sum().backward()
                assert session.broken
            await until(pilot, lambda: "NOT WATCHED" in state_line(app))
            line = " ".join(state_line(app).split())
            assert "RUNNING" in line and "RuntimeError: tensordbg bug" in line, line

    try:
        asyncio.run(flow(fails=True))
        asyncio.run(flow(fails=False))  # a UI that connects later
        assert "tensordbg bug" in LiveSource(session).info()["unwatched"]
    finally:
        session.detach()


def test_the_log_keeps_what_happened_not_a_line_per_step() -> None:
    """Steps' numbers are the Run tab's: the log writing a line a step drowned the hits, the
    pauses and the warnings in it."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            written: list[str] = []
            write = app.main.event_log.write_event
            app.main.event_log.write_event = lambda e, p: (written.append(e), write(e, p))
            for step in range(5):
                last = {"step": step, "loss": 1.0, "grad_norm": 1.0, "steps_per_sec": 9.0}
                source.emit("status", {"state": "running", "step": step + 1, "phase": "forward",
                                       "hits_total": 2, "last": last})  # fmt: skip
            source.emit("log", {"message": "a warning of the training", "level": "warning",
                                "step": 5})  # fmt: skip
            await until(pilot, lambda: written)
            await pilot.pause(0.2)
            assert written == ["log"]  # not one "status" line a step
            run = app.main.run_status  # the Run tab has the steps' numbers
            await until(pilot, lambda: run._info.get("step") == 5 and run._history["step"][-1] == 4)

    asyncio.run(flow())


def test_at_80_by_24_the_histogram_can_be_scrolled_to_beside_the_grid() -> None:
    """The statistics and the histogram share a column beside the grid; at 80x24 the
    histogram fell below the screen with no way to reach it. The column scrolls now."""
    from tensordbg.tui.components.histogram_view import HistogramView

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=(80, 24)) as pilot:
            await open_tensor(pilot, 3, "net.2.output", TensorGrid)
            side = app.query_one("#tensor-side")
            histogram = app.query_one(HistogramView)
            await pilot.pause(0.3)
            screen = app.screen.region
            if not screen.contains_region(histogram.region):
                assert side.max_scroll_y > 0  # below the screen, but it can be reached
                side.scroll_end(animate=False)
                await pilot.pause(0.2)
            assert histogram.region.height > 0
            assert screen.y + screen.height >= histogram.region.y + 3  # its top rows are shown

    asyncio.run(flow())


def test_tui_wait_without_a_run_id_waits_for_the_first_session_to_start(
    server_factory, private_runtime_dir
) -> None:
    """`tensordbg tui --wait 60` started before `tensordbg run` made its session (at the model's
    first call) opens that session when it appears, instead of saying there is none."""
    import threading
    import time

    from tensordbg.tui.launch import session_app

    start = server_factory(run_id="late", rank=0)
    timer = threading.Timer(0.6, lambda: start(FakeSource()))
    timer.start()
    began = time.monotonic()
    app = session_app(wait=10.0)
    timer.join()
    assert app is not None and 0.5 < time.monotonic() - began < 8
    assert session_app(wait=0.0) is not None  # there is one now


def test_f5_before_any_tensor_is_open_says_how_to_open_one() -> None:
    """F5 with no tensor open showed an empty source box under "No tensor open". The box says
    what to do: open a tensor from the Hits tab or the Modules tab first. (With a hit under
    the Hits tab's cursor F5 opens that hit's: here the training has none yet.)"""
    fake = FakeSource()
    fake._hits = []

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(fake))
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await pilot.press("f5")
            await until(pilot, lambda: app.query("#provenance-source"))
            await pilot.pause(0.1)
            source = text_of(app.query_one("#provenance-source", Static))
            assert source.startswith("No tensor is open. Open one first:")
            assert "Hits tab (F2)" in source and "Modules tab (F3)" in source
            assert "No tensor is open. Open one first:" in screen_text(app)  # on screen

    asyncio.run(flow())


def test_on_a_narrow_terminal_every_tab_title_is_on_the_bar() -> None:
    """At 80x24 the bar ended in "Profil": the titles with their keys take 85 columns. At 80
    the tabs close up to keep their keys (test_tui_first_use); narrower still, they go without
    the keys; on a wide one the keys come back."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=(70, 24)) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            await pilot.pause(0.1)
            bar = screen_text(app).splitlines()[1]
            assert bar.split() == ["Run", "Hits", "Modules", "Tensor", "Provenance", "Rules",
                                   "Log", "Profile"]  # fmt: skip
            await pilot.resize_terminal(120, 30)
            await pilot.pause(0.1)
            assert "Profile F8" in screen_text(app).splitlines()[1]

    asyncio.run(flow())


def test_at_80_by_24_a_module_line_cut_by_the_right_edge_ends_in_an_ellipsis() -> None:
    """At 80x24 the Modules tab's lines (a module's statistics are long) were cut at the right
    edge with nothing to say that they go on. A line whose text goes on ends in "…" left of the
    scrollbar (a line cut only in its padding does not); → scrolls sideways, as the search box
    says, and a line scrolled to its end has no ellipsis."""
    source = FakeSource(modules=30)  # more modules than lines: a vertical scrollbar
    source.module_list[4]["type"] = "CausalSelfAttention"  # net.2: a longer line

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(80, 24)) as pilot:
            await paused_on_the_two_hits(pilot)
            await pilot.press("f3")
            table = app.main.module_browser.table
            await until(pilot, lambda: table.row_count == 36 and table.has_focus)
            await pilot.pause(0.1)

            def shown(path: str | None) -> str:
                """A module's line (the heading for None) as the screen shows it."""
                paths = [m["path"] for m in table._modules]  # the heading stays on line 0
                y = 0 if path is None else paths.index(path) + 1 - round(table.scroll_y)
                area = table.scrollable_content_region
                line = screen_text(app).splitlines()[area.y + y]
                return line[area.x : area.right]

            assert "← → scroll the lines sideways" in app.main.module_browser.search.placeholder
            # Cut, but its NaN flag comes before the numbers: the cut cannot hide it.
            assert shown("net.2").endswith("…") and "NaN×2!" in shown("net.2")
            assert shown(None).rstrip().endswith("output")  # only padding goes past the edge
            assert not shown("net.1").rstrip().endswith("…")  # a ReLU's statistics fit
            while table.scroll_x < table.max_scroll_x:
                await pilot.press("right")
            await pilot.pause(0.1)
            assert not shown("net.2").rstrip().endswith("…")  # scrolled to its end

    asyncio.run(flow())


def test_at_80_by_24_a_module_tensor_line_cut_by_the_right_edge_ends_in_an_ellipsis() -> None:
    """Under the module tree, the table of the module's tensors (a DataTable) was cut at 80
    columns with nothing to say that its summaries go on, while the tree's lines end in "…".
    Its lines end in "…" too, the heading not (only its padding is cut); → on the table
    scrolls sideways, and a line scrolled to its end has no ellipsis."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=(80, 24)) as pilot:
            await paused_on_the_two_hits(pilot)
            await pilot.press("f3")
            modules = app.main.module_browser.table
            await until(pilot, lambda: modules.row_count == 6 and modules.has_focus)
            await pilot.press("down", "down", "down", "down", "enter")  # net.2's tensors
            tensors = app.main.module_browser.tensor_table
            await until(pilot, lambda: tensors.row_count == 1 and tensors.has_focus)
            await pilot.pause(0.1)  # DataTable sizes its columns when idle

            def shown(y: int) -> str:
                """Line ``y`` of the tensors table (0: its heading) as the screen shows it."""
                area = tensors.scrollable_content_region
                line = screen_text(app).splitlines()[area.y + y]
                return line[area.x : area.right]

            assert "net.2.output" in shown(1)
            assert shown(1).endswith("…") and "NaN" not in shown(1)  # the summary goes on
            assert shown(0).rstrip().endswith("summary")  # only padding goes past the edge
            while tensors.scroll_x < tensors.max_scroll_x:
                await pilot.press("right")
            await pilot.pause(0.1)
            assert shown(1).rstrip().endswith("NaN×2!")

    asyncio.run(flow())


def test_a_training_in_deferred_mode_says_why_its_modules_may_have_no_ranges() -> None:
    """Deferred mode reads a module's output only when a phase shows a problem: while it ran,
    the Modules tab's output column was empty without a word, and a pause between steps has
    nothing to show either (the note said ranges were measured at a pause). The tab says when
    there are ranges, running and paused, and no longer once the training finished."""
    source = FakeSource()
    source.state, source.paused_at = "running", None
    source.info = lambda: {**FakeSource.info(source), "sync": "deferred"}  # type: ignore[method-assign]

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state == "running")
            await pilot.press("f3")
            table = app.main.module_browser.table
            await until(pilot, lambda: table.row_count == 6 and table.has_focus)
            await pilot.pause(0.1)
            note = app.main.module_browser.note

            def said() -> bool:
                return note.has_class("-visible") and "a hit shows them" in str(note.render())

            assert said() and "a pause between steps has none" in str(note.render())
            source.state = "paused"
            source.emit("state", {"state": "paused", "step": 3, "reason": "pause"})
            await until(pilot, lambda: app.state == "paused")
            await pilot.pause(0.1)
            assert said()
            source.state = "finished"
            source.emit("state", {"state": "finished", "step": 3})
            await until(pilot, lambda: app.state == "finished")
            await until(pilot, lambda: not note.has_class("-visible"))

    asyncio.run(flow())


def test_the_hit_detail_shows_no_number_without_saying_what_it_is() -> None:
    """Under a NaN hit's message the detail said "value 1984": 1984 what? The message says it
    ("holds 1984 NaN among 31744 values"); a number apart from it is the rule's measure against
    the threshold it crossed, and says so."""
    source = FakeSource()
    message = "blocks.0.attn.output holds 1984 NaN among 31744 values."
    source._hits[0].update(value=1984.0, threshold=None, message=message)
    source._hits[1].update(rule="ExplodingGradient", value=2.5e6, threshold=1e6)

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            detail = app.query_one("#hit-detail", Static)
            await until(pilot, lambda: message in text_of(detail))
            assert "1984" not in text_of(detail).replace(message, "")
            await pilot.press("down")
            await until(pilot, lambda: "[ExplodingGradient]" in text_of(detail))
            assert "ExplodingGradient measured 2.5e+06 against its threshold 1e+06" in text_of(
                detail
            )

    asyncio.run(flow())


# --- the second trial: tensordbg demo in tmux at 80x24 and 120x40 --------------------------------


def footer_row(app: TensorDbgApp) -> tuple[list[str], list[str]]:
    """The footer's keys a person can read whole, left of the palette key; and any key that
    is cut (by the palette key or the screen's edge)."""
    keys = list(app.screen.query("FooterKey"))
    palette = next((k for k in keys if k.has_class("-command-palette")), None)
    if palette is None:  # being laid out again
        return [], []
    others = [k for k in keys if k is not palette]
    whole = [k.key for k in others if k.region.right <= palette.region.x]
    return whole, [k.key for k in others if k.key not in whole]


async def settled_footer(
    pilot: Pilot, condition: Callable[[list[str]], bool], timeout: float = 10.0
) -> tuple[list[str], list[str]]:
    """The footer's row once ``condition`` holds on it and two reads a pause apart agree: the
    footer lays itself out again after a change of bindings, more than once, and between two
    passes it has no keys at all."""
    deadline = time.monotonic() + timeout
    seen = None
    while True:
        row = footer_row(pilot.app)
        if condition(row[0]) and row == seen:
            return row
        seen = row if condition(row[0]) else None
        if time.monotonic() > deadline:
            raise AssertionError(f"the footer never settled; last read {row}")
        await pilot.pause(0.02)


def test_at_80_columns_the_footer_keeps_whole_the_keys_a_person_needs_most() -> None:
    """At 80x24 the footer ended in "q Detach & quit  i Ignore r": "/ Search" and "P Profile"
    never showed, and the Rules tab's keys pushed the debugger's out even at 120 columns. A key
    that does not fit is left out whole (the palette has it), the rarest first: while paused,
    skip and ignore come before search and profile (a third trial found them left out)."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=(80, 24)) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            whole, cut = await settled_footer(pilot, lambda keys: keys[:2] == ["c", "n"])
            assert whole == ["c", "n", "s", "q", "k", "i"] and cut == []
            assert "Ignore rule" in screen_text(app).splitlines()[-1]
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert {"Search", "Profile the next N steps"} <= set(titles), titles
            app.main.show_tab("rules")
            whole, cut = await settled_footer(pilot, lambda keys: "space" in keys)
            assert {"c", "n", "s", "q", "space", "e"} <= set(whole) and cut == []
            await pilot.resize_terminal(120, 40)
            whole, cut = await settled_footer(pilot, lambda keys: "a" in keys)
            assert {"c", "n", "s", "q", "k", "i", "space", "e", "a", "r"} <= set(whole)
            assert cut == []
            app.main.show_tab("hits")
            whole, cut = await settled_footer(pilot, lambda keys: "slash" in keys)
            assert {"c", "n", "s", "q", "k", "i", "slash", "P"} <= set(whole) and cut == []

    asyncio.run(flow())


def test_at_80_by_24_a_row_two_rules_share_keeps_origin_and_passed_on_apart() -> None:
    """After s in the demo, a row naming two rules ("ExplodingGradient, NaN") widened the rule
    column and "where" shrank to "wh…" and "↳ …". The rule column gives up its cells first."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(80, 24)) as pilot:
            hits = await paused_on_the_two_hits(pilot)
            origin, _ = source.hits()
            grad = dict(origin, step=4, phase="backward", origin=False,
                        tensor="blocks.1.attn.proj.weight.grad",
                        message="blocks.1.attn.proj.weight.grad holds 3 NaN.")  # fmt: skip
            source.emit("hit", dict(grad, id=2, rule="ExplodingGradient"))
            source.emit("hit", dict(grad, id=3, rule="NaN"))
            await until(pilot, lambda: hits.known == 4)
            await pilot.pause(0.05)
            lines = drawn_lines(hits)
            assert lines[0].split()[:5] == ["step", "phase", "rule", "tensor", "where"]
            assert "● origin" in lines[1] and "↳ passed on" in lines[2]
            assert "↳ passed on" in lines[3] and "blocks.1.attn.proj.weight.grad" in lines[3]

    asyncio.run(flow())


def drawn_lines(widget: Any) -> list[str]:
    return [strip.text for strip in widget.render_lines(widget.region.reset_offset)]


def test_the_log_wraps_at_its_width_whether_it_was_on_screen_or_not() -> None:
    """The Log tab wrapped a line at the full width while it was on screen, and at 78 columns
    (of 120) the lines that came while another tab was."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            log = app.main.event_log
            app.main.show_tab("log")
            await until(pilot, lambda: log.lines)
            width = log.scrollable_content_region.width
            app.main.log_entry("seen " * 40)  # 200 characters, on screen
            app.main.show_tab("hits")
            await until(pilot, lambda: not log.scrollable_content_region.width)
            app.main.log_entry("unseen " * 30)  # 210, while the Hits tab is on screen
            app.main.show_tab("log")
            await until(pilot, lambda: "unseen" in log.lines[-1].text)
            wrapped = [line.text.rstrip() for line in log.lines if "seen" in line.text]
            assert max(len(line) for line in wrapped) > 100 and len(wrapped) == 4, wrapped
            assert all(len(line) <= width for line in wrapped)
            await pilot.resize_terminal(80, 24)  # wrapped again at the new width
            await until(pilot, lambda: log.scrollable_content_region.width < width)
            await pilot.pause(0.05)
            wrapped = [line.text.rstrip() for line in log.lines if "seen" in line.text]
            assert len(wrapped) > 4 and all(len(line) <= 78 for line in wrapped), wrapped

    asyncio.run(flow())
