"""The terminal UI driven like a person would, against the numpy-only FakeSource: a training paused
on a NaN produced at net.2, a 1000x1000 tensor at ref 5, and (with ``modules=2000``) a big model.

Each test runs the real app headless (``App.run_test``) with an in-process ``LocalClient``.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from fake_source import FakeSource
from rich.console import Group
from textual.pilot import Pilot
from textual.widget import Widget
from textual.widgets import Input, Static, TabbedContent, Tree

from tensordbg.transport.client import ConnectionLost, LocalClient
from tensordbg.transport.connection import ConnectionInfo, write_connection_file
from tensordbg.transport.server import Server
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.connection_banner import ConnectionBanner
from tensordbg.tui.components.histogram_view import HistogramView
from tensordbg.tui.components.hit_table import HitTable
from tensordbg.tui.components.module_table import ModuleTable
from tensordbg.tui.components.rule_panel import RulePanel
from tensordbg.tui.components.run_status import RunStatus
from tensordbg.tui.components.slice_input import SliceInput
from tensordbg.tui.components.tensor_grid import BLOCK_COLS, BLOCK_ROWS, TensorGrid
from tensordbg.tui.launch import session_app, wait_for_run
from tensordbg.tui.messages import OpenTensor
from tensordbg.tui.remote import TrainingExited
from tensordbg.tui.screens.rule_add import RuleAddScreen
from tensordbg.tui.screens.rule_edit import RuleEditScreen

SIZE = (120, 40)
W = TypeVar("W", bound=Widget)
TESTS = Path(__file__).parent


async def until(pilot: Pilot, condition: Callable[[], Any], timeout: float = 10.0) -> None:
    """Let the app work until ``condition()`` holds (requests run in workers and threads)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the UI")
        await asyncio.sleep(0.005)
    if pilot.app.is_running:
        # A short pause, not pause(): that waits for the CPU to idle, up to a second a time.
        await pilot.pause(0.01)


async def paused_on_the_two_hits(pilot: Pilot) -> HitTable:
    """Wait for the FakeSource's paused training with its two hits listed; the hits table."""
    app = pilot.app
    hits = app.query_one(HitTable)
    await until(pilot, lambda: app.state == "paused" and hits.row_count == 2)
    return hits


async def open_tensor(pilot: Pilot, ref: int, name: str, part: type[W]) -> W:
    """Once paused, open tensor ``ref`` as Enter on it would; its ``part`` once it is there and
    the tensor is on screen (a part of the tensor opened before is there at once)."""
    app = pilot.app
    await until(pilot, lambda: app.state == "paused")
    app.main.post_message(OpenTensor(ref, name))
    inspector = app.main.tensor_inspector
    await until(pilot, lambda: inspector.ref == ref and active_tab(app) == "tensor")
    await until(pilot, lambda: app.query(part))
    return app.query_one(part)


async def shown(pilot: Pilot, screen: type[Any]) -> None:
    """Wait until a screen of this type is on top and mounted: a pushed screen is on the stack
    before its widgets are composed, so querying it at once can find none."""
    await until(pilot, lambda: isinstance(pilot.app.screen, screen) and pilot.app.screen.is_mounted)


async def mounted(pilot: Pilot) -> None:
    """Wait until the tabs that open hidden (mounted after the first frame) are there."""
    await until(pilot, lambda: not pilot.app.screen.query("Lazy"))


def text_of(widget: Static) -> str:
    content = widget.content
    if isinstance(content, Group):
        return "\n".join(str(r) for r in content.renderables)
    return str(content)


def footer_keys(app: TensorDbgApp, node: Any = None) -> list[str]:
    """The keys of ``node`` (the app's by default) the footer shows now."""
    node = app if node is None else node
    return [
        b.binding.key
        for b in app.screen.active_bindings.values()
        if b.node is node and b.binding.show and b.enabled
    ]


def active_tab(app: TensorDbgApp) -> str:
    return app.query_one(TabbedContent).active


async def type_slice(pilot: Pilot, text: str) -> None:
    """Type ``text`` into the slice box. A long text's head is put there as typing would
    leave it and only its last keys are pressed: each key pressed waits for the app to idle
    (a 198-character slice took 19 s)."""
    box = pilot.app.query_one(SliceInput)
    box.focus()
    box.value = text[:-8]
    box.cursor_position = len(box.value)
    await pilot.press(*text[-8:])


def test_from_the_origin_hit_to_its_values_and_back_to_training() -> None:
    """Opened on a training paused at a NaN: Enter on the origin hit opens net.2's output; a
    slice narrows it, a bad slice is refused without harm, the Provenance tab names the producer
    and the user's line; c resumes the training and q detaches."""
    source = FakeSource()
    h2 = source.arrays[3][3]

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            assert active_tab(app) == "hits"
            assert hits.current is not None and hits.current["origin"]
            assert sorted(footer_keys(app)) == sorted(["c", "n", "s", "k", "q", "slash", "P", "i"])

            await pilot.press("enter")
            inspector = app.main.tensor_inspector
            grid = app.query_one(TensorGrid)
            await until(pilot, lambda: grid.rows == 8 and grid.cell_text(1, 2) is not None)
            assert active_tab(app) == "tensor"
            assert inspector.ref == 3

            await type_slice(pilot, "[1]")
            await pilot.press("enter")
            await until(pilot, lambda: inspector.text == "[1]" and grid.cell_text(3, 0))
            summary = text_of(app.query_one("#tensor-summary", Static))
            assert summary.startswith("tensor[4] float32 n=4") and "NaN×1!" in summary
            # A 1-D slice reads down, one value a row labelled with its index (at 80x24 a row
            # of values showed 3 of 4, found trying the product as a new user).
            assert (grid.rows, grid.cols) == (4, 1)
            assert grid.cell_text(2, 0) == "NaN"
            assert grid.cell_text(0, 0) == f"{h2[1, 0]:.4g}"
            assert grid.render_line(0).text.split() == []
            rows = [grid.render_line(y).text.split() for y in range(1, 5)]
            assert rows == [[str(i), "NaN" if i == 2 else f"{h2[1, i]:.4g}"] for i in range(4)]
            histogram = app.query_one(HistogramView)
            await until(pilot, lambda: "NaN 1" in text_of(histogram))
            compare = app.query_one("#stats-compare", Static)
            assert "step 2" in str(compare.content.columns[2].header)

            # A slice that does not parse is refused as it is typed...
            await type_slice(pilot, "[1:x]")
            error = app.query_one("#slice-error", Static)
            assert "'x' is not allowed in a slice" in text_of(error)
            # ...and one the tensor cannot take is refused by the source, with its reason.
            await type_slice(pilot, "[1, 99]")
            assert text_of(error) == ""
            await pilot.press("enter")
            await until(pilot, lambda: "does not fit a tensor of shape 8x4" in text_of(error))
            assert inspector.text == "[1]" and grid.cell_text(2, 0) == "NaN"  # still shown
            await type_slice(pilot, "[:, 0]")
            await pilot.press("enter")
            await until(pilot, lambda: inspector.text == "[:, 0]" and grid.cell_text(5, 0))
            assert text_of(error) == "" and grid.cell_text(5, 0) == "NaN"
            grid.focus()
            await pilot.press("f")  # the NaN found in the column: its row, by its index
            await until(pilot, lambda: grid.border_subtitle == "f: NaN/Inf at [5]")

            app.main.show_tab("provenance")
            tree = app.query_one(Tree)
            await until(pilot, lambda: "net.2.output" in str(tree.root.label))
            leaves = [str(node.label) for node in tree.root.children]
            assert any("produced by net.2" in label and "Linear" in label for label in leaves)
            inputs = tree.root.children[1]
            assert "net.1.output  ← net.1" in str(inputs.children[0].label)
            assert "✓ finite" in str(inputs.children[0].label)
            listing = text_of(app.query_one("#provenance-source", Static))
            assert "fake.py:12 in forward" in listing
            assert "→ 12         return self.net[2](h)" in listing

            app.query_one(TensorGrid).focus()  # keys for the debugger, not for a text box
            await pilot.press("c")
            await until(pilot, lambda: app.state == "running")
            assert source.controls == [("continue", 1)]
            assert sorted(footer_keys(app)) == sorted(["p", "q", "slash", "P"])
            assert "RUNNING" in text_of(app.query_one("#run-state", Static))

            await pilot.press("q")
            await until(pilot, lambda: not app.is_running)
        assert source.controls[-1] == ("detach", 1)
        assert app.return_code == 0

    asyncio.run(flow())


def test_ctrl_q_detaches_like_q_and_the_palette_quits_one_way() -> None:
    """Textual's own quit (ctrl+q, the palette's Quit) detaches too: a paused training must not
    wait for a UI that is gone."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await mounted(pilot)
            helps = {c.title: c.help for c in app.get_system_commands(app.screen)}
            assert "Detach and quit" in helps and "Quit" not in helps
            assert "the training goes on, unwatched (q)" in helps["Detach and quit"]
            await pilot.press("ctrl+q")
            await until(pilot, lambda: not app.is_running)
        assert source.controls == [("detach", 1)]
        assert app.return_code == 0
        # What tensordbg tui prints once the UI is gone: it quit without a word.
        assert app.farewell.startswith("tensordbg tui: detached from run ")
        assert app.farewell.endswith("; the training goes on, unwatched")

    asyncio.run(flow())


@pytest.mark.parametrize("key", ["q", "ctrl+q"])
def test_a_training_that_ends_with_the_ui_is_quit_not_detached(key: str) -> None:
    """tensordbg demo's UI: q detached its training, which then said "detached: the training
    goes on unwatched" and stopped the next moment (the demo stops it with its UI). Its q is
    "Quit", says what it does, and detaches nothing: the demo stops the training itself."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source), ends_training=True)
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            assert app.active_bindings["q"].binding.description == "Quit"
            helps = {c.title: c.help for c in app.get_system_commands(app.screen)}
            assert "Detach and quit" not in helps
            assert helps["Quit"] == (
                "Quit: the training stops with the UI, as tensordbg demo's does (q)"
            )
            await pilot.press(key)
            await until(pilot, lambda: not app.is_running)
        assert source.controls == [] and app.farewell == ""  # nothing detached, nothing said
        assert app.return_code == 0

    asyncio.run(flow())


def test_step_takes_a_count_and_the_palette_offers_what_the_state_allows() -> None:
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert {"Continue", "Next hit", "Step"} <= set(titles) and "Pause" not in titles
            await pilot.press("1", "2", "s")
            await until(pilot, lambda: app.state == "running")
            assert source.controls == [("step", 12)]
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "Pause" in titles and "Continue" not in titles
            await pilot.press("c")  # not valid while running: nothing is sent
            await pilot.press("p")
            await until(pilot, lambda: app.state == "paused")
            assert source.controls == [("step", 12), ("pause", 1)]

    asyncio.run(flow())


def test_pushed_events_update_the_run_tab_and_the_hits() -> None:
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = app.query_one(HitTable)
            await until(pilot, lambda: hits.row_count == 2)
            last = {"step": 3, "loss": 1.5, "grad_norm": 0.7, "steps_per_sec": 9.0}
            status = {"state": "paused", "step": 4, "phase": "forward", "hits_total": 2}
            source.emit("status", {**status, "last": last})
            numbers = app.query_one("#run-numbers", Static)
            await until(pilot, lambda: "1.5" in str(list(numbers.content.columns[1].cells)))
            hit = dict(source.hits()[0], id=7, step=4, message="a later NaN")
            source.emit("hit", hit)
            await until(pilot, lambda: hits.row_count == 3)
            assert hits.next_id == 8
            run = app.query_one(RunStatus)
            assert run._info["hits_total"] == 3

    asyncio.run(flow())


def test_a_flood_of_pushed_hits_is_drawn_only_where_it_is_on_screen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thousand hits pushed one by one take their places in execution order (an origin hit of
    a step already shown goes before that step's other hits), and the table draws only the rows
    on screen, not one row per hit."""
    source = FakeSource()
    drawn = 0
    render_line = HitTable.render_line

    def counted(table: HitTable, y: int) -> Any:
        nonlocal drawn
        drawn += 1
        return render_line(table, y)

    monkeypatch.setattr(HitTable, "render_line", counted)

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = app.main.hit_table
            await until(pilot, lambda: app.state == "paused" and hits.row_count == 2)
            before = drawn
            origin, passed_on = source.hits()
            for i in range(1000):
                source.emit("hit", dict(passed_on, id=2 + i, step=4 + i // 10))
            source.emit("hit", dict(origin, id=1002, step=4))
            await until(pilot, lambda: hits.row_count == 1003)
            await pilot.pause(0.1)
            assert drawn - before < 1000  # a few frames of the visible rows
            assert hits.ids[:4] == [0, 1, 1002, 2]  # step 3, then step 4's origin first
            assert hits.ids[4:] == list(range(3, 1002))

    asyncio.run(flow())


def test_two_rules_that_say_the_same_of_a_tensor_share_a_row_that_names_both() -> None:
    """A NaN gradient fires NaN and ExplodingGradient with one sentence: one row, naming both
    rules, found by either name; the same rule saying it again (a second backward pass) and
    another sentence keep rows of their own."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = app.main.hit_table
            await until(pilot, lambda: app.state == "paused" and hits.row_count == 2)
            origin, _ = source.hits()
            grad = dict(origin, step=5, phase="backward", tensor="net.2.weight.grad",
                        message="net.2.weight.grad holds 1 NaN among 3 values.")  # fmt: skip
            source.emit("hit", dict(grad, id=2, rule="NaN"))
            source.emit("hit", dict(grad, id=3, rule="ExplodingGradient"))
            source.emit("hit", dict(grad, id=4, rule="NaN"))  # the second pass of the step
            source.emit("hit", dict(grad, id=5, rule="ExplodingGradient",
                                    message="net.2.weight.grad has norm 3e+07."))  # fmt: skip
            await until(pilot, lambda: hits.known == 6)
            assert hits.ids == [0, 1, 2, 4, 5]
            assert [hits.rules_of(hits._hits[i]) for i in hits.ids[2:]] == [
                ["NaN", "ExplodingGradient"],
                ["NaN"],
                ["ExplodingGradient"],
            ]
            hits.select_hit(3)  # the hit that shares a row: its row
            await pilot.pause()
            assert hits.current["id"] == 2
            assert text_of(app.main.hit_detail).startswith(
                "[NaN, ExplodingGradient] net.2.weight.grad"
            )
            hits.set_filter("exploding")
            assert hits.ids == [2, 5]

    asyncio.run(flow())


def test_a_tensor_that_cannot_be_opened_leaves_nothing_of_the_last_one_on_screen() -> None:
    """Opening a tensor the source refuses (its phase ended) names that tensor and says why:
    the last tensor's title, numbers and summary do not stay under the new request."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            grid = await open_tensor(pilot, 3, "net.2.output", TensorGrid)
            await until(pilot, lambda: grid.rows == 8 and grid.cell_text(1, 2) is not None)
            app.main.post_message(OpenTensor(999, "net.0.weight.grad"))
            title = app.query_one("#tensor-title", Static)
            await until(pilot, lambda: text_of(title) == "net.0.weight.grad")
            await until(pilot, lambda: grid.rows == 0)
            assert grid.message == "No values to show (why is said above)."
            assert text_of(app.query_one("#tensor-summary", Static)) == ""
            assert "no tensor 999" in text_of(app.query_one("#slice-error", Static))
            tree = app.query_one(Tree)  # by its name, not the source's id ("tensor 999")
            await until(pilot, lambda: "No provenance for" in str(tree.root.label))
            assert str(tree.root.label) == "No provenance for net.0.weight.grad"
            # The why in full, wrapped below (a tree's one-line label cut it mid-word).
            why = text_of(app.query_one("#provenance-source", Static))
            assert why.startswith("No provenance for net.0.weight.grad: ") and "999" in why

    asyncio.run(flow())


def test_a_long_slice_the_source_took_is_asked_again_as_typed_not_refused() -> None:
    """39 Nones typed in 198 characters: the source's canonical text spaces the commas (240),
    and a histogram asked again for it (a resize) was refused as over 200 characters."""
    source = FakeSource()
    typed = "[" + "None," * 39 + "1]"

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await open_tensor(pilot, 3, "net.2.output", TensorGrid)
            inspector = app.main.tensor_inspector
            await type_slice(pilot, typed)
            await pilot.press("enter")
            await until(pilot, lambda: inspector.text == typed)
            histogram = app.query_one(HistogramView)
            histogram.post_message(HistogramView.Rebin())
            await until(pilot, lambda: "NaN 1" in text_of(histogram))
            assert "No histogram" not in text_of(histogram)

    asyncio.run(flow())


def test_a_tensor_left_open_when_the_training_goes_on_says_its_values_are_the_pauses() -> None:
    """After c, the Tensor tab kept the paused step's values with nothing saying so (found
    trying it as a new user): its title now says they are the pause's, and the next pause
    leaves it so until the tensor is opened again."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            grid = await open_tensor(pilot, 3, "net.2.output", TensorGrid)
            await until(pilot, lambda: grid.rows == 8)
            title = app.query_one("#tensor-title", Static)
            assert text_of(title) == "net.2.output"
            source.state = "running"
            source.emit("state", {"state": "running", "step": 2})
            said = "net.2.output  (values as at the pause: the training went on)"
            await until(pilot, lambda: text_of(title) == said)
            source.state = "paused"
            source.emit("state", {"state": "paused", "step": 3})
            await until(pilot, lambda: app.state == "paused")
            assert text_of(title) == said

    asyncio.run(flow())


def test_a_ui_opened_on_a_pause_after_the_steps_update_offers_no_skip() -> None:
    """k was offered to a UI opened after the pause (only state events said "skippable"), and
    pressing it was refused: the welcome says it too."""

    class AfterUpdate(FakeSource):
        def info(self):
            return {**super().info(), "skippable": False}

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(AfterUpdate()))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            keys = {k for k, b in app.active_bindings.items() if b.binding.show and b.enabled}
            assert "c" in keys and "k" not in keys

    asyncio.run(flow())


def test_a_training_that_finishes_without_a_hit_is_not_said_to_have_none_yet() -> None:
    """ "No hits yet." is what a running training has; once it finished it has had none."""
    source = FakeSource()
    source._hits, source.paused_at, source.state = [], None, "running"
    said: list[str] = []

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "running")
            detail = app.main.hit_detail
            await until(pilot, lambda: "hits" in str(detail.render()))
            said.append(str(detail.render()))
            source.state = "finished"
            source.emit("state", {"state": "finished", "step": 3, "phase": ""})
            await until(pilot, lambda: "finished" in str(detail.render()))
            said.append(str(detail.render()))

    asyncio.run(flow())
    assert said == ["No hits yet.", "No hits: the training finished without one."]


def test_a_training_ended_by_ctrl_c_is_not_shown_as_simply_finished() -> None:
    """The session's last word says how the script ended when it did not end by itself: the
    header and the Run tab say so next to FINISHED."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            source.state = "finished"
            source.emit("state", {"state": "finished", "step": 3, "phase": "",
                                  "reason": "interrupted by Ctrl-C"})  # fmt: skip
            await until(pilot, lambda: app.state == "finished")
            assert app.main.title == "FINISHED after step 2 · interrupted by Ctrl-C"
            # Nothing is left to detach from: q quits, and the footer says so.
            shown = [b.binding.description for b in app.screen.active_bindings.values()
                     if b.binding.key == "q" and b.enabled and b.binding.show]  # fmt: skip
            assert shown == ["Quit"]
            app.main.show_tab("run")
            await until(pilot, lambda: "(interrupted by Ctrl-C)" in text_of(
                app.main.run_status.query_one("#run-state", Static)))  # fmt: skip

    asyncio.run(flow())


def test_f5_with_no_tensor_open_shows_the_provenance_of_the_highlighted_hit() -> None:
    """It said "No tensor open" with the origin hit under the cursor: Enter had to come
    first. The Tensor tab opens it too; a tensor already open stays."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            assert hits.current is not None and hits.current["ref"] == 3
            await pilot.press("f5")
            tree = app.query_one(Tree)
            await until(pilot, lambda: "net.2.output" in str(tree.root.label))
            assert active_tab(app) == "provenance"
            assert app.main.tensor_inspector.ref == 3
            await pilot.press("f2", "down", "f4")  # another hit highlighted: the open one stays
            await pilot.pause()
            assert active_tab(app) == "tensor" and app.main.tensor_inspector.ref == 3

    asyncio.run(flow())


def test_f5_then_f4_on_a_hit_leaves_each_tab_where_the_person_put_it() -> None:
    """F5 opened the hit's tensor and focused its values in the hidden Tensor tab: from F4 on,
    the app switched between the two tabs by itself, twice a second, at 100 % CPU."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            await pilot.press("f5")
            tree = app.query_one(Tree)
            await until(pilot, lambda: "net.2.output" in str(tree.root.label))
            for pane in ("provenance", "tensor", "provenance", "tensor"):
                if active_tab(app) != pane:
                    await pilot.press("f4" if pane == "tensor" else "f5")
                seen = set()
                for _ in range(8):
                    await pilot.pause(0.05)
                    seen.add(active_tab(app))
                assert seen == {pane}, (pane, seen)

    asyncio.run(flow())


def test_tabs_asked_for_in_quick_succession_end_on_the_last_one_and_stay_there() -> None:
    """Each tab switch focuses the new tab's main widget a little later; focusing a widget
    switches to its tab. Switches asked for faster than that (the Log tab, the Hits tab, then a
    tensor opened) left late focuses for tabs no longer asked for: the app switched back to one
    of them, or between them for ever, and the tensor opened last was not on screen."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            for _ in range(3):
                app.main.show_tab("log")
                app.main.show_tab("hits")
                app.main.post_message(OpenTensor(3, "net.2.output"))
                seen = []
                for _ in range(10):
                    await pilot.pause(0.05)
                    seen.append(active_tab(app))
                assert set(seen[2:]) == {"tensor"}, seen
                assert isinstance(app.focused, TensorGrid)

    asyncio.run(flow())


def test_an_output_no_module_took_says_who_used_it_instead_of_a_bare_consumers_0() -> None:
    """A block's attention output is used by the block's own code (x + attn(x)): "consumers
    (0)" looked like a fault of the debugger."""
    source = FakeSource()
    original = source.provenance
    source.provenance = lambda *args, **kwargs: {  # type: ignore[method-assign]
        **original(*args, **kwargs),
        "consumers": [],
    }

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            await pilot.press("enter")
            app.main.show_tab("provenance")
            tree = app.query_one(Tree)
            await until(pilot, lambda: "net.2.output" in str(tree.root.label))
            consumers = next(n for n in tree.root.children if "consumers" in str(n.label))
            assert str(consumers.label) == "consumers (0)"
            # Paused: the call that takes it may not have run yet (a pause at attn.output in
            # the forward, before the head ran, once said no module took it).
            assert app.state == "paused"
            assert [str(n.label) for n in consumers.children] == [
                "no module call took it so far: code between modules used it (x + "
                "self.attn(x)), or it is what the model returned, or the call that takes it has "
                "not run yet (the training paused before it)"
            ]

    asyncio.run(flow())


def test_a_previous_step_that_recorded_little_says_so_instead_of_a_column_of_dashes() -> None:
    """A replay's previous dumped step may hold only what its checks measured (whether the
    tensor was finite): its column of dashes says why."""
    from textual.app import App, ComposeResult

    from tensordbg.tui.components.stats_compare import StatsCompare

    now = {"mean": 0.5, "std": 1.0, "min": -2.0, "max": 3.0, "abs_mean": 0.8, "l2": 9.0,
           "nan": 0, "posinf": 0, "neginf": 0, "zeros": 0}  # fmt: skip

    class One(App):
        def compose(self) -> ComposeResult:
            yield StatsCompare()

    async def flow() -> None:
        async with One().run_test() as pilot:
            compare = pilot.app.query_one(StatsCompare)
            compare.show({"summary": now, "previous": {"step": 4, "summary": {"finite": 1.0}}})
            await pilot.pause()
            caption = compare.content.title
            assert (
                caption == "step 4 recorded none of these statistics, only what its checks measured"
            )
            compare.show({"summary": now, "previous": {"step": 4, "summary": {"mean": 0.1}}})
            assert compare.content.title == (
                "step 4 recorded only mean of these (what its checks measured)"
            )
            compare.show({"summary": now, "previous": {"step": 4, "summary": now}})
            assert compare.content.title is None
            # None at all, and the source says why: that reason, not a blank "none".
            why = "deferred checks (the CPU's default) measure a clean step's activations only"
            compare.show({"summary": now, "previous": None, "previous_why": why})
            assert compare.content.title == why
            compare.show({"summary": now, "previous": None})
            assert compare.content.title == "no statistics of this tensor from the previous step"
            # An empty slice ([3:1]): its moments are none, not NaN.
            nothing = {
                **dict.fromkeys(("mean", "std", "min", "max", "abs_mean"), math.nan),
                "l2": 0.0,
                "numel": 0,
                "nan": 0,
                "posinf": 0,
                "neginf": 0,
                "zeros": 0,
            }
            compare.show({"summary": nothing, "previous": None})
            assert compare.content.title == "the slice selects no value"
            assert "NaN" not in str(list(compare.content.columns[1].cells))

    asyncio.run(flow())


def test_the_rules_hit_counts_follow_the_hits_that_come_after_the_pause() -> None:
    """The training said each rule's count when the UI asked (0 here); the hits that came since
    (resumed, or finished) count too, each once, by the rule that made it."""
    source = FakeSource()

    async def check(app: TensorDbgApp, pilot: Pilot, panel: RulePanel) -> None:
        hit = source._hits[1]
        for i in range(3):
            source.emit("hit", dict(hit, id=10 + i, step=4))
        source.emit("hit", dict(hit, id=12, step=4))  # heard twice: one hit
        source.emit("hit", dict(hit, id=13, rule="VanishingGradient", kind="grad"))

        def counts() -> list[str]:
            return [str(panel.table.get_row_at(i)[2]) for i in range(panel.table.row_count)]

        await until(pilot, lambda: counts() == ["5", "1"])  # the 2 listed at the pause too

    on_the_rules_tab(source, check)


def on_the_rules_tab(source: FakeSource, check: Callable[..., Any]) -> None:
    """Run ``check(app, pilot, panel)`` with the UI on the Rules tab, its rules read."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            panel = app.main.rule_panel
            await until(pilot, lambda: panel.current is not None)
            app.main.show_tab("rules")
            await check(app, pilot, panel)

    asyncio.run(flow())


def test_rules_toggle_edit_add_and_recheck() -> None:
    source = FakeSource()

    async def check(app: TensorDbgApp, pilot: Pilot, panel: RulePanel) -> None:
        await pilot.pause()
        assert panel.current["name"] == "NaN"

        await pilot.press("space")
        await until(pilot, lambda: not panel.current["enabled"])
        assert source._rules[0]["enabled"] is False

        await pilot.press("down", "e")
        await shown(pilot, RuleEditScreen)
        box = app.screen.query_one(Input)
        assert box.name == "threshold" and box.value == "1e-07"
        box.value = "not a number"
        await pilot.press("enter")
        assert "threshold: 'not a number' is not a number" in text_of(
            app.screen.query_one(".dialog-error", Static)
        )
        box.value = "1e-5"
        await pilot.press("enter")
        await until(pilot, lambda: source._rules[1]["params"]["threshold"] == 1e-5)
        await until(pilot, lambda: panel.current["params"]["threshold"] == 1e-5)

        await pilot.press("a")
        await shown(pilot, RuleAddScreen)
        # fnmatch's [ab] has the shape of a Rich markup tag: it must show as written.
        app.screen.query_one("#rule-match", Input).value = "net.[ab]*"
        app.screen.query_one(".param-input", Input).value = "100"
        app.screen.query_one("#save").press()
        await until(pilot, lambda: len(source._rules) == 3)
        added = source._rules[2]
        assert (added["name"], added["match"], added["params"]) == (
            "TensorRange",
            ["net.[ab]*"],
            {"max_gt": 100},
        )
        # The heading is line 0; DataTable sizes its columns when idle.
        await until(pilot, lambda: "net.[ab]*" in panel.table.render_line(3).text)

        await pilot.press("r")
        result = app.query_one("#rule-result", Static)
        await until(pilot, lambda: "Recheck of step 3, forward found 1 hit" in text_of(result))
        assert "[NaN] net.2.output" in text_of(result)
        assert "could not be judged" not in text_of(result)

        # Tensors the rules could not judge: "no new hit" would be a claim about them.
        why = "net.1.output: the phase's tensors passed retain_bytes=0 MiB"
        source.recheck = lambda: {"at": "step 3, forward", "hits": [], "unjudged": 2, "why": why}
        await pilot.press("r")
        await until(pilot, lambda: "among the tensors it could judge" in text_of(result))
        assert f"2 tensors could not be judged (never measured, no longer held): {why}" in (
            " ".join(text_of(result).split())
        )
        assert "no new hit with the rules" not in text_of(result)

    on_the_rules_tab(source, check)


def test_the_highlighted_rules_selection_is_shown_whole_at_80_columns() -> None:
    """The Rules table's match column showed "* !bl…" at 120 columns and "…" at 80: the
    exclusions i adds (the README says they show in the Rules tab) could not be read."""
    source = FakeSource()
    source._rules[0]["exclude"] = ["blocks.0.attn.output", "blocks.1.attn.output"]

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(80, 24)) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            app.main.show_tab("rules")
            panel = app.main.rule_panel
            await until(pilot, lambda: panel.current is not None)
            panel.table.focus()
            await pilot.press("home")
            shown = app.query_one("#rule-selection", Static)
            await until(pilot, lambda: "except" in text_of(shown))
            assert text_of(shown) == (
                "NaN: on *, except blocks.0.attn.output, blocks.1.attn.output"
            )
            assert shown.region.height >= 1 and shown.region.bottom <= 24  # on screen

    asyncio.run(flow())


def test_end_and_home_move_to_the_last_and_first_rule() -> None:
    """End in the Rules table scrolled sideways and left the cursor on NaN: End, then Space,
    turned the NaN rule off instead of the last one."""
    source = FakeSource()

    async def check(app: TensorDbgApp, pilot: Pilot, panel: RulePanel) -> None:
        await pilot.pause()
        await pilot.press("end")
        assert panel.table.cursor_row == panel.table.row_count - 1 > 0
        await pilot.press("home")
        assert panel.current["name"] == "NaN"

    on_the_rules_tab(source, check)


def test_the_rules_keys_follow_the_state_of_the_training() -> None:
    """Rules change while the training runs or is paused, but a recheck judges the paused step:
    r and the palette's Recheck are offered only while paused, and nothing once disconnected."""
    source = FakeSource()
    clients: list[CuttableClient] = []

    async def connect(path: str | None) -> CuttableClient:
        if clients:
            raise ConnectionRefusedError("no training at ipc:///tmp/x")
        clients.append(CuttableClient(source))
        return clients[-1]

    def palette(app: TensorDbgApp) -> list[str]:
        return [c.title for c in app.get_system_commands(app.screen)]

    async def flow() -> None:
        app = TensorDbgApp(connect, reconnect_delay=0.02)
        async with app.run_test(size=SIZE) as pilot:
            panel = app.main.rule_panel
            await until(pilot, lambda: app.state == "paused" and panel.current is not None)
            app.main.show_tab("rules")
            await until(pilot, lambda: footer_keys(app, panel))
            assert sorted(footer_keys(app, panel)) == ["a", "e", "r", "space"]
            assert "Recheck" in palette(app)

            await pilot.press("c")
            await until(pilot, lambda: app.state == "running")
            assert sorted(footer_keys(app, panel)) == ["a", "e", "space"]
            assert "Recheck" not in palette(app)
            await pilot.press("r")  # not while running: nothing is asked
            assert text_of(app.query_one("#rule-result", Static)) == ""
            await pilot.press("space")  # a rule can be switched off while the training runs
            await until(pilot, lambda: not panel.current["enabled"])

            clients[0].cut.set()
            await until(pilot, lambda: app.state == "disconnected")
            assert footer_keys(app, panel) == []
            await pilot.press("enter")  # Enter edits a rule: not while disconnected
            assert app.screen is app.main

    asyncio.run(flow())


def test_the_modules_tab_follows_the_training_after_it_resumes() -> None:
    """Read at the pause (step 3), the tree's statistics are marked as of step 3 once the training
    moves on, and each module's hit count follows the hits that come after (to the end)."""
    source = FakeSource()
    read = source.modules

    def modules() -> list[dict]:
        rows = read()
        for row in rows:
            for stats in row["stats"].values():
                stats["step"] = 3  # as the live server says: the step they are of
        return rows

    source.modules = modules  # type: ignore[method-assign]

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            table = app.main.module_browser.table
            app.main.show_tab("modules")
            hit = source._hits[0]
            await until(pilot, lambda: table.row_count > 0)
            row = next(i for i, m in enumerate(table._modules) if m["path"] == hit["module"])

            def cells() -> tuple[str, ...]:
                return table._cells[row]

            await until(pilot, lambda: cells()[2] == "● 1")
            assert not any(c.startswith("step 3:") for c in cells())
            source.emit(
                "status",
                {"state": "running", "step": 4, "phase": "forward", "hits_total": 2, "last": None},
            )
            await until(pilot, lambda: any(c.startswith("step 3:") for c in cells()))
            for i in range(3):
                source.emit("hit", dict(hit, id=20 + i, step=4))
            source.emit("state", {"state": "finished", "step": 5})
            await until(pilot, lambda: cells()[2] == "● 4")

    asyncio.run(flow())


def test_search_among_2000_modules_and_open_a_tensor() -> None:
    source = FakeSource(modules=2000)

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            table = app.main.module_browser.table
            await until(pilot, lambda: table.row_count == 2006)
            await pilot.press("f1", "slash")  # on the Hits tab, / filters the hits
            assert active_tab(app) == "modules"
            assert isinstance(app.focused, Input)
            started = time.perf_counter()
            await pilot.press(*"extra.19")
            per_key = (time.perf_counter() - started) / len("extra.19")
            assert table.row_count == 1 + 10 + 100  # extra.19, extra.190-199, extra.1900-1999
            assert table.current is not None and table.current["path"] == "extra.19"
            assert per_key < 0.5, f"{per_key:.3f} s a key while searching 2,000 modules"
            await pilot.press("enter", "down")
            assert app.focused is table and table.current["path"] == "extra.190"

            await pilot.press("slash", *"\b" * 0)
            app.query_one("#module-search", Input).value = "net.2"
            await until(pilot, lambda: table.row_count == 1)
            assert "net.2" in table.render_line(1).text and "● 1" in table.render_line(1).text
            tensors = app.main.module_browser.tensor_table
            await until(pilot, lambda: tensors.row_count == 1)
            table.focus()
            await pilot.press("enter")
            assert app.focused is tensors
            await pilot.press("enter")
            inspector = app.main.tensor_inspector
            await until(pilot, lambda: inspector.ref == 3 and active_tab(app) == "tensor")

    asyncio.run(flow())


def test_a_module_lists_the_tensor_it_returned_from_a_child() -> None:
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            table = app.main.module_browser.table
            await until(pilot, lambda: table.row_count == 6)
            app.main.show_tab("modules")
            await until(pilot, lambda: app.query("#module-search"))  # the tab mounts lazily
            app.query_one("#module-search", Input).value = "Sequential"
            await until(pilot, lambda: table.row_count == 1)
            assert table.current is not None and table.current["path"] == "net"
            tensors = app.main.module_browser.tensor_table
            await until(pilot, lambda: tensors.row_count == 1)
            # DataTable sizes its columns when idle, after adding the row (later under load).
            await until(pilot, lambda: "net.2.output" in tensors.render_line(1).text)

    asyncio.run(flow())


class CountingSource(FakeSource):
    """Counts the values the grid asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.windows: list[list[list[int]] | None] = []

    def slice(self, ref: int, text: str = "", window: list[list[int]] | None = None):
        reply = super().slice(ref, text, window)
        self.windows.append(window)
        self.sent += reply["data"].data.size
        return reply


async def big_grid(pilot: Pilot) -> TensorGrid:
    """CountingSource's 1000 x 1000 tensor open in the grid, its first window drawn."""
    grid = await open_tensor(pilot, 5, "big.output", TensorGrid)
    await until(pilot, lambda: grid.rows == 1000 and grid.cell_text(0, 0) is not None)
    return grid


def test_the_grid_fetches_only_the_windows_on_screen() -> None:
    source = CountingSource()
    big = source.arrays[5][3]

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            grid = await big_grid(pilot)
            assert grid.cell_text(0, 0) == f"{big[0, 0]:.4g}"
            assert app.focused is grid
            await pilot.press(*["pagedown"] * 6, *["right"] * 20)
            await until(pilot, lambda: not grid.fetching)
            top = round(grid.scroll_y)
            first_col = round(grid.scroll_x) // 11
            assert top > 150 and first_col >= 19
            assert grid.cell_text(top, first_col) == f"{big[top, first_col]:.4g}"
            line = grid.render_line(1).text
            assert line.split()[0] == str(top) and f"{big[top, first_col]:.4g}" in line
        # A few blocks of 64 x 16 values, not the million values of the tensor.
        assert all(
            w is not None and w[0][1] - w[0][0] <= BLOCK_ROWS and w[1][1] - w[1][0] <= BLOCK_COLS
            for w in source.windows
        )
        assert 0 < source.sent <= 12 * BLOCK_ROWS * BLOCK_COLS

    asyncio.run(flow())


@pytest.mark.parametrize("size", [(80, 24), SIZE])
def test_the_grid_shows_whole_numbers_up_to_its_edge(size: tuple[int, int]) -> None:
    """The last column on screen was cut by the scrollbar mid-number (0.120 for 0.12084,
    -0.0312 for -0.031284): they read as values. Whole columns only, then a "…"."""
    source = CountingSource()
    big = source.arrays[5][3]

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=size) as pilot:
            grid = await big_grid(pilot)
            await until(pilot, lambda: not grid.fetching)
            shown = grid.render_line(1).text[: grid.scrollable_content_region.width].split()
            assert shown[-1] == "…", shown  # more columns to the right, said so
            values = shown[1:-1]  # after the row's label
            assert values == [f"{big[0, c]:.4g}" for c in range(len(values))], shown

    asyncio.run(flow())


class CuttableClient:
    """A LocalClient whose connection can be cut, as when the training dies."""

    def __init__(self, source: FakeSource) -> None:
        self._inner = LocalClient(source)
        self.welcome = self._inner.welcome
        self.cut = asyncio.Event()

    LOST = "the training at ipc:///tmp/x has not answered for 10 s"

    async def call(self, method: str, **params: Any) -> Any:
        if self.cut.is_set():
            raise ConnectionLost(self.LOST)
        return await self._inner.call(method, **params)

    async def events(self):
        """The source's events, as a real client passes them on, until the cut."""
        inner = self._inner.events().__aiter__()
        cut = asyncio.ensure_future(self.cut.wait())
        try:
            while True:
                event = asyncio.ensure_future(inner.__anext__())
                await asyncio.wait({event, cut}, return_when=asyncio.FIRST_COMPLETED)
                if cut.done():
                    event.cancel()
                    raise ConnectionLost(self.LOST)
                try:
                    yield event.result()
                except StopAsyncIteration:
                    return
        finally:
            cut.cancel()

    async def close(self) -> None:
        await self._inner.close()


def test_a_lost_connection_shows_a_banner_keeps_the_state_and_reconnects() -> None:
    source = FakeSource()
    clients: list[CuttableClient] = []
    training_back = asyncio.Event()

    async def connect(path: str | None) -> CuttableClient:
        if clients and not training_back.is_set():
            raise ConnectionRefusedError("no training at ipc:///tmp/x")
        clients.append(CuttableClient(source))
        return clients[-1]

    async def flow() -> None:
        app = TensorDbgApp(connect, reconnect_delay=0.02)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            banner = app.query_one(ConnectionBanner)
            assert not banner.has_class("-visible")
            clients[0].cut.set()
            await until(pilot, lambda: app.state == "disconnected")
            assert banner.has_class("-visible")
            assert "has not answered for 10 s" in text_of(banner)
            assert "The last state stays on screen" in text_of(banner)
            await until(pilot, lambda: "Last attempt: no training at" in text_of(banner))
            assert "last seen paused at step 3" in text_of(app.query_one("#run-state", Static))
            assert app.query_one(HitTable).row_count == 2  # still there
            assert sorted(footer_keys(app)) == ["q", "slash"]
            await pilot.press("c")  # nothing to continue
            assert source.controls == []
            # The training comes back: everything is read again from the hello reply.
            training_back.set()
            await until(pilot, lambda: app.state == "paused" and len(clients) == 2)
            assert not banner.has_class("-visible")
            assert "PAUSED" in text_of(app.query_one("#run-state", Static))

    asyncio.run(flow())


def test_the_session_picker_hands_the_chosen_file_to_the_connection() -> None:
    source = FakeSource()
    picked: list[str | None] = []
    sessions = [
        {
            "path": f"/tmp/run{i}-0.json",
            "script": f"train{i}.py",
            "run_id": f"run{i}",
            "rank": 0,
            "pid": 100 + i,
            "host": "h",
            "started": 0.0,
        }
        for i in range(3)
    ]

    async def connect(path: str | None) -> LocalClient:
        picked.append(path)
        return LocalClient(source)

    async def flow() -> None:
        app = TensorDbgApp(connect, sessions=sessions)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert type(app.screen).__name__ == "SessionPicker"
            # Before a session is chosen, no key offers to detach from one or to search it.
            assert footer_keys(app) == []
            assert footer_keys(app, app.screen) == ["escape"]
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "Quit" in titles and "Search modules" not in titles
            assert "Detach and quit" not in titles
            await pilot.press("slash")  # nothing to search yet
            assert type(app.screen).__name__ == "SessionPicker"
            await pilot.press("down", "enter")
            await until(pilot, lambda: app.state == "paused")
            assert sorted(footer_keys(app)) == sorted(["c", "n", "s", "k", "q", "slash", "P", "i"])
        assert picked == ["/tmp/run1-0.json"]


def test_q_on_the_session_list_quits_without_choosing() -> None:
    picked: list[str | None] = []

    async def connect(path: str | None) -> LocalClient:
        picked.append(path)
        return LocalClient(FakeSource())

    sessions = [{"path": f"/tmp/run{i}-0.json", "run_id": f"run{i}", "rank": 0} for i in range(2)]

    async def flow() -> None:
        app = TensorDbgApp(connect, sessions=sessions)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running)
        assert picked == [] and app.return_code == 0

    asyncio.run(flow())

    asyncio.run(flow())


def test_waiting_for_a_run_that_is_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(runtime))
    info = ConnectionInfo(
        run_id="demo1",
        rank=0,
        pid=os.getpid(),
        host=socket.gethostname(),
        script="demo.py",
        started=time.time(),
        endpoint="ipc:///nowhere",
        transport="ipc",
        key="ab" * 32,
    )

    async def flow() -> str:
        async def start_later() -> None:
            await asyncio.sleep(0.2)
            write_connection_file(info, runtime)

        writer = asyncio.ensure_future(start_later())
        path = await wait_for_run("demo1", wait=5.0, poll=0.02)
        await writer
        with pytest.raises(TimeoutError, match="no session of run other"):
            await wait_for_run("other", wait=0.05, poll=0.02)
        return path

    assert asyncio.run(flow()) == str(runtime / "demo1-0.json")


def test_a_training_that_exits_is_no_longer_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tensordbg demo` tells the UI whether its training still runs: once it has exited (an error
    in the training, say), the UI stops waiting and reconnecting, and says so."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(runtime))

    async def wait() -> None:
        with pytest.raises(TrainingExited, match="the training of run gone1 has exited"):
            await wait_for_run("gone1", wait=30.0, poll=0.02, alive=lambda: False)

    started = time.monotonic()
    asyncio.run(wait())
    assert time.monotonic() - started < 5  # not the 30 s of the wait

    app = session_app(run_id="gone1", wait=30.0, alive=lambda: False)
    assert app is not None

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            banner = app.query_one(ConnectionBanner)
            await until(pilot, lambda: "has exited" in text_of(banner))
            assert text_of(banner) == "The training of run gone1 has exited. Press q to quit."
            await pilot.pause(0.3)
            assert not app.workers  # no more attempts to connect
            assert text_of(banner).endswith("Press q to quit.")

    asyncio.run(flow())


def test_a_training_that_starts_after_the_ui_over_zeromq(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``tensordbg demo`` does: the UI waits for the run, then debugs it over the socket."""
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(tmp_path))
    source = FakeSource()
    server = Server(source, run_id="tui1", rank=0, script="train.py")
    app = session_app(run_id="tui1", wait=10.0)
    assert app is not None

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            assert app.state == "connecting"
            await asyncio.to_thread(server.start)
            hits = app.main.hit_table
            await until(pilot, lambda: app.state == "paused" and hits.row_count == 2)
            # Actions rather than key presses: a press waits for the CPU to idle, and the
            # training's server shares this process.
            app.main.post_message(OpenTensor(hits.current["ref"], hits.current["tensor"]))
            await until(pilot, lambda: app.query(TensorGrid))
            grid = app.query_one(TensorGrid)
            await until(pilot, lambda: grid.rows == 8 and grid.cell_text(5, 0) == "NaN")
            app.action_control("continue")
            await until(pilot, lambda: source.controls == [("continue", 1)])
            await until(pilot, lambda: app.state == "running")
            app.action_detach()
            await until(pilot, lambda: not app.is_running)
        assert source.controls[-1] == ("detach", 1)

    try:
        asyncio.run(flow())
    finally:
        server.stop()


def test_the_ui_never_imports_torch() -> None:
    code = f"""
import asyncio, sys
sys.path.insert(0, {str(TESTS)!r})
import tensordbg.tui
from fake_source import FakeSource
from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.messages import OpenTensor

async def main():
    app = TensorDbgApp(LocalClient(FakeSource()))
    async with app.run_test() as pilot:
        await pilot.pause(0.3)
        app.main.post_message(OpenTensor(3))
        await pilot.pause(0.3)
asyncio.run(main())
print("torch" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False", result.stderr


def test_a_training_that_stops_on_a_hit_brings_that_hit_forward_and_a_pause_by_p_does_not() -> None:
    """Watching the Run tab, the person sees the training stop on a new hit: the Hits tab comes
    forward with that hit under the cursor and Enter opens its tensor. A pause asked for with p
    (no hit) leaves the person on the tab they were on."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            await pilot.press("c")
            await until(pilot, lambda: app.state == "running")
            app.main.show_tab("run")
            await until(pilot, lambda: active_tab(app) == "run")

            await pilot.press("p")
            await until(pilot, lambda: app.state == "paused")
            await pilot.pause(0.2)  # the paused state is re-read: it must not move the person
            assert active_tab(app) == "run"

            await pilot.press("c")
            await until(pilot, lambda: app.state == "running")
            hit = source.pause_on_hit()
            await until(pilot, lambda: hits.row_count == 3 and active_tab(app) == "hits")
            await until(pilot, lambda: hits.current is not None and hits.current["id"] == hit["id"])
            assert app.focused is hits
            await pilot.press("enter")
            await until(pilot, lambda: app.main.tensor_inspector.ref == hit["ref"])
            assert active_tab(app) == "tensor"

    asyncio.run(flow())


def test_each_tab_key_opens_its_tab_with_the_keys_in_it_whatever_tab_was_open() -> None:
    """F1-F7 round the tabs and back (each tab left once with the keys in its main widget:
    hiding a focused widget made Textual focus its neighbour, which switched back to the old
    tab), and / from two tabs, Escape back to the modules."""
    from tensordbg.tui.screens.main import TABS

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await mounted(pilot)

            def keys_in(pane: str, kind: Any) -> bool:
                focused = app.focused
                if kind is None:
                    return True
                return isinstance(focused, kind) and any(a.id == pane for a in focused.ancestors)

            async def opened(pane: str, kind: Any) -> None:
                try:
                    await until(pilot, lambda: active_tab(app) == pane and keys_in(pane, kind))
                    await pilot.pause(0.05)  # a switch back would come in the next frames
                except AssertionError:
                    raise AssertionError((pane, active_tab(app), app.focused)) from None
                assert active_tab(app) == pane and keys_in(pane, kind), (pane, app.focused)

            for tab in (*TABS, TABS[0]):
                await pilot.press(tab.key)
                await opened(tab.pane, tab.keys_to)
            for key in ("f4", "f7"):
                await pilot.press(key, "slash")
                await opened("modules", Input)
                assert app.focused.id == "module-search"
                await pilot.press("escape")
                await opened("modules", ModuleTable)

    asyncio.run(flow())


def test_quitting_on_the_first_screen_before_the_hidden_tabs_are_mounted_exits_cleanly() -> None:
    """q at once: the tabs still waiting to be mounted are left alone, no traceback."""
    app = TensorDbgApp(LocalClient(FakeSource()))
    display = app._display

    def first_frame(screen: Any, renderable: Any) -> None:
        display(screen, renderable)
        if renderable is not None and app.state == "paused" and app.main.hit_table.row_count:
            assert app.main.query("Lazy"), "the hidden tabs are mounted already: nothing tested"
            app.exit()

    app._display = first_frame  # type: ignore[method-assign]
    asyncio.run(app.run_async(headless=True, size=SIZE))

    assert app.return_code == 0, app._exception


def test_a_control_reply_older_than_the_state_events_does_not_undo_them() -> None:
    """c: the training resumes and runs into the next hit before the reply to c leaves the
    server, so the reply says "running" after the events said "paused". The events win."""

    class Quick(FakeSource):
        def control(self, action: str, n: int = 1) -> dict[str, Any]:
            reply = super().control(action, n)
            if action == "continue":
                self.pause_on_hit()  # the events of the next pause go out first
            return reply  # {"state": "running"}: older than the events

    source = Quick()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = await paused_on_the_two_hits(pilot)
            await pilot.press("c")
            await until(pilot, lambda: ("continue", 1) in source.controls and hits.row_count == 3)
            await until(
                pilot, lambda: all(w.is_finished for w in app.workers if w.group == "control")
            )
            assert app.state == "paused"
            assert "c" in footer_keys(app)

    asyncio.run(flow())


def test_the_histogram_keeps_one_bin_a_column_when_the_terminal_is_resized() -> None:
    source = FakeSource()

    def bar_width(histogram: HistogramView) -> int:
        return len(text_of(histogram).splitlines()[1])  # the top row of bars, under "peak"

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            histogram = await open_tensor(pilot, 3, "net.2.output", HistogramView)
            await until(pilot, lambda: histogram.shown_bins and histogram.fits)
            narrow = histogram.shown_bins
            assert narrow == histogram.content_size.width == bar_width(histogram)

            await pilot.resize_terminal(SIZE[0] + 40, SIZE[1])
            await until(pilot, lambda: histogram.shown_bins != narrow and histogram.fits)
            wide = histogram.shown_bins
            assert wide > narrow and wide == bar_width(histogram)
            assert "NaN 2" in text_of(histogram)

    asyncio.run(flow())


def test_a_table_row_drawn_before_its_columns_were_sized_is_drawn_again_once_they_are() -> None:
    """Textual sizes a DataTable's columns when idle; a line drawn before (the screen may draw
    it) kept the old width: the tensor list showed "net.2.ou" now and then."""
    from textual.app import App, ComposeResult

    from tensordbg.tui.components.table import Table

    class OneTable(App):
        def compose(self) -> ComposeResult:
            yield Table()

    async def flow() -> None:
        app = OneTable()
        async with app.run_test(size=SIZE) as pilot:
            table = app.query_one(Table)
            table.add_columns("name", "size")
            table.add_row("net.0", "1")
            await pilot.pause()
            table.clear()
            table.add_row("net.2.output.of.a.long.name", "2")
            assert "net.2.output.of.a.long.name" not in table.render_line(1).text  # not yet
            await pilot.pause()
            assert "net.2.output.of.a.long.name" in table.render_line(1).text

    asyncio.run(flow())


def test_histogram_drawing_scales_bars_and_counts_non_finite() -> None:
    from tensordbg.tui.components.histogram_view import draw

    text = draw(
        {"counts": [0, 1, 8], "min": -1.0, "max": 1.0, "nan": 2, "posinf": 0, "neginf": 1}, height=2
    ).plain.splitlines()
    assert text[0] == "peak 8 per bin"
    assert text[1] == "  █" and text[2] == " ▂█"  # 1/8 of two rows: two eighths
    assert text[3].startswith("-1") and text[3].endswith("1")
    assert "NaN 2" in text[4] and "-Inf 1" in text[4]
    assert len(text) == 5


def test_function_keys_switch_tabs_and_give_them_the_keys() -> None:
    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            for key, pane in (("f2", "hits"), ("f6", "rules"), ("f7", "log"), ("f1", "run")):
                await pilot.press(key)
                await pilot.pause()
                assert active_tab(app) == pane
            await pilot.press("f2")
            await pilot.pause()
            assert isinstance(app.focused, HitTable)

    asyncio.run(flow())


def test_the_comparison_writes_non_finite_statistics_as_the_grid_does() -> None:
    from tensordbg.tui.components.stats_compare import fmt

    assert [fmt(v) for v in (math.nan, math.inf, -math.inf, 0.5, 3, None)] == [
        "NaN", "+Inf", "-Inf", "0.5", "3", "–"
    ]  # fmt: skip


def test_a_change_to_or_from_a_non_finite_value_is_not_written_as_a_missing_one() -> None:
    """The Δ column wrote "–" both where a step recorded no value and where this step's mean
    was NaN or Inf: a person read "not recorded" where the value had gone bad."""
    from tensordbg.tui.components.stats_compare import delta

    changes = [(math.nan, 0.5), (math.inf, 1.0), (-math.inf, 1.0), (0.5, math.nan), (0.5, None),
               (None, 0.5), (0.75, 0.5)]  # fmt: skip
    assert [delta(now, before, "mean").plain for now, before in changes] == [
        "NaN", "+Inf", "-Inf", "NaN", "–", "–", "+0.25"
    ]  # fmt: skip
    assert "red" in str(delta(math.nan, 0.5, "mean").style)  # gone bad: as the NaN count is


def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           run_id: str) -> tuple[FakeSource, Server, TensorDbgApp]:  # fmt: skip
    """A FakeSource served as run ``run_id`` in a private runtime directory, and the app
    ``tensordbg tui --run-id`` would open on it (not yet running)."""
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(tmp_path))
    source = FakeSource()
    server = Server(source, run_id=run_id, rank=0, script="train.py")
    server.start()
    app = session_app(run_id=run_id, wait=10.0)
    assert app is not None
    return source, server, app


def test_a_ui_on_a_training_that_ended_says_it_exited_and_stops_reconnecting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tensordbg tui`` on a training whose script ends: the UI says FINISHED, then that the
    training has finished, once, and does not try to reconnect (it repeated "cannot read
    connection file" every second; over TCP it said "Reconnecting in the background" to a
    training that said it had finished)."""
    source, server, app = served(tmp_path, monkeypatch, "end1")

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            source.state = "finished"
            source.emit("state", {"state": "finished", "step": 3, "phase": ""})  # between steps
            source.emit("detach", {"state": "detached", "step": 3, "phase": ""})
            await until(pilot, lambda: app.state == "finished")
            assert app.main.title.startswith("FINISHED")
            await asyncio.to_thread(server.stop)
            banner = app.query_one(ConnectionBanner)
            await until(pilot, lambda: "has finished" in text_of(banner))
            # It said it finished: not "its training exited or goes on unwatched".
            ended = "The training has finished after step 2. The last state stays on screen."
            assert text_of(banner).startswith(ended)
            assert text_of(banner).endswith("Press q to quit.")
            assert "Reconnecting" not in text_of(banner)
            assert app.main.title.startswith("FINISHED")  # the header says how it ended
            log = app.main.event_log
            errors = len(log.lines)
            await pilot.pause(2.5)
            assert len(log.lines) == errors  # no attempt after it: nothing more is written

    try:
        asyncio.run(flow())
    finally:
        server.stop()


def test_a_script_that_detaches_at_its_end_is_finished_once_its_process_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``session.detach()`` at a script's end (the README's example) left the UI saying the
    training "goes on, unwatched" after its process had exited: once the process is gone, the
    header and the banner say it has finished, and how."""
    import tensordbg.transport.connection as connection

    source, server, app = served(tmp_path, monkeypatch, "end2")
    gone = []
    monkeypatch.setattr(connection, "is_live", lambda info: not gone)

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            source.state = "detached"
            source.emit("state", {"state": "detached", "step": 7, "phase": ""})
            await until(pilot, lambda: app.state == "detached")
            await asyncio.to_thread(server.stop)
            banner = app.query_one(ConnectionBanner)
            await until(pilot, lambda: "goes on, unwatched" in text_of(banner))
            await pilot.pause(1.5)
            assert app.state == "detached"  # its process still runs: it may well go on
            gone.append(True)  # the script exits
            await until(pilot, lambda: app.state == "finished", timeout=5)
            said = ("The training has finished after step 6: its script detached tensordbg, "
                    "then its process exited.")  # fmt: skip
            await until(pilot, lambda: text_of(banner).startswith(said))
            assert app.main.title.startswith("FINISHED after step 6 · its script detached")

    try:
        asyncio.run(flow())
    finally:
        server.stop()


def test_a_session_whose_process_is_gone_has_exited_and_one_whose_file_is_gone_has_ended(
    tmp_path: Path,
) -> None:
    from tensordbg.tui.launch import exited

    file = tmp_path / "run9-0.json"
    file.write_text("{}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = ConnectionInfo(run_id="run9", rank=0, pid=os.getpid(), host=socket.gethostname(),
                           script="train.py", started=0.0, endpoint="ipc:///nowhere",
                           transport="ipc", key="00" * 32, path=file)  # fmt: skip
    assert exited(None) == "" and exited(alive) == ""
    gone = ConnectionInfo(**{**alive.__dict__, "pid": dead.pid})
    assert exited(gone) == f"the training of run run9 (pid {dead.pid}) has exited"
    file.unlink()
    assert exited(alive).startswith(f"the session of run run9 (pid {os.getpid()}) has ended")


def test_k_says_that_the_update_will_be_skipped_and_how_to_go_on() -> None:
    """Skip marks the step and the training stays paused: nothing else on screen changes, so
    the person is told what will happen and that c continues."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            await pilot.press("k")
            await until(pilot, lambda: bool(list(app._notifications)))
            text = " ".join(str(n.message) for n in app._notifications)
            assert source.controls[-1] == ("skip", 1)
            assert f"The update of step {source.step} will be skipped" in text
            assert "c continues" in text
            # Asked for: the footer no longer offers k at this pause (it did), and does at
            # the next one.
            await until(pilot, lambda: "k" not in footer_keys(app))
            await pilot.press("c")
            await until(pilot, lambda: app.state == "running")
            source.pause_on_hit()
            await until(pilot, lambda: app.state == "paused" and "k" in footer_keys(app))

    asyncio.run(flow())


def test_the_rules_table_thresholds_cell_lists_only_those_that_are_set() -> None:
    """A TensorRange's ten bounds, nine unset, would push its match and kinds off the screen."""
    from tensordbg.tui.components.rule_panel import thresholds

    assert thresholds({"min_lt": None, "max_gt": 1.0, "mean_lt": None}) == "max_gt=1.0"
    assert thresholds({"min_lt": None}) == "–"


def test_a_ui_whose_training_vanished_offers_quit_not_detach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training that went without saying it ended (killed): the banner said "Press q to
    quit" while the footer still offered "q Detach & quit"."""
    _, server, app = served(tmp_path, monkeypatch, "gone1")

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "paused")
            # The client calls it lost after SERVER_TIMEOUT (10 s) of silence: 1 s here, the
            # same path, 9 s sooner.
            app.remote.client.server_timeout = 1.0
            await asyncio.to_thread(server.stop)  # no "finished" first
            banner = app.query_one(ConnectionBanner)
            await until(pilot, lambda: "has ended" in text_of(banner), timeout=30)
            q = [b.binding.action for b in app.screen.active_bindings.values()
                 if b.binding.key == "q" and b.enabled]  # fmt: skip
            assert q == ["leave"]

    try:
        asyncio.run(flow())
    finally:
        server.stop()


def test_the_hits_cursor_stays_on_screen_at_80_columns() -> None:
    """At 80x24 the hit rows are wider than the screen: a horizontal scrollbar takes a row of
    the table, and moving down left the cursor one row below the last row shown."""
    source = FakeSource()
    base = source._hits[0]
    source._hits = [base | {"id": i, "tensor": f"blocks.{i}.attention.weight.grad",
                            "origin": i == 0} for i in range(30)]  # fmt: skip

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=(80, 24)) as pilot:
            hits = app.query_one(HitTable)
            await until(pilot, lambda: hits.row_count == 30)
            app.main.show_tab("hits")
            hits.focus()
            await pilot.pause()
            shown = hits.scrollable_content_region.height - 1  # under the heading
            assert shown < hits.size.height - 1  # the scrollbar's row: what the bug missed
            for _ in range(20):
                await pilot.press("down")
                top = round(hits.scroll_y)
                assert top <= hits.cursor < top + shown, (hits.cursor, top, shown)

    asyncio.run(flow())


def test_the_log_says_a_state_once_when_it_is_sent_again() -> None:
    """The Log tab said "state: detached after step 11" twice (the detach, then the session's
    end, each sent it)."""
    from textual.app import App, ComposeResult

    from tensordbg.tui.components.event_log import EventLog

    class Host(App[None]):
        def compose(self) -> ComposeResult:
            yield EventLog()

    async def flow() -> None:
        app = Host()
        async with app.run_test(size=SIZE) as pilot:
            log = app.query_one(EventLog)
            for state in ("paused", "running", "detached", "detached"):
                log.write_event("state", {"state": state, "step": 12})
            await pilot.pause()
            text = "\n".join(line.text for line in log.lines)
            assert text.count("state: detached after step 11") == 1, text
            assert text.count("state: running after step 11") == 1, text

    asyncio.run(flow())


def test_the_run_tab_says_how_many_rows_its_hits_make_when_two_rules_share_one() -> None:
    """The Run tab said "hits 12" while the Hits tab had 6 rows (a NaN gradient is found by NaN
    and ExplodingGradient alike, in one row): it read as hits lost."""
    source = FakeSource()
    first = source._hits[0]
    source._hits = [first, first | {"id": first["id"] + 100, "rule": "ExplodingGradient"}]

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            hits = app.query_one(HitTable)
            await until(pilot, lambda: hits.known == 2)
            app.main.show_tab("run")
            app.main.run_status.add_hit(hits.known)
            await pilot.pause()
            assert hits.rows_unfiltered == 1
            assert app.main.run_status._hits_text() == "2 in 1 row"

    asyncio.run(flow())


def test_a_late_focus_message_does_not_switch_back_to_the_tab_the_keys_left() -> None:
    """F7 F2 Enter typed at once, under load: F7 focused the Log, whose pane tells the tabs so
    by a message; F2 then focused the hits table, and the Log's message, handled last,
    switched back to the Log (the demo's tmux test in CI, 2026-12-06)."""
    from textual.widgets import TabbedContent, TabPane

    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            tabs = app.main.query_one(TabbedContent)
            app.main.show_tab("hits")
            await pilot.pause()
            assert app.focused is app.query_one(HitTable)
            log = tabs.get_pane("log")
            log.post_message(TabPane.Focused(log))  # the Log's, late
            await pilot.pause()
            assert tabs.active == "hits" and app.focused is app.query_one(HitTable)
            # A pane that holds the focused widget still makes itself the active one.
            app.main.event_log.focus()
            await pilot.pause()
            assert tabs.active == "log"

    asyncio.run(flow())


def test_a_0d_tensor_shows_its_one_value_without_an_index_over_it() -> None:
    """A 0-d tensor (a loss) has no index to label a column with: its column said "0", as if
    it were 1-D."""
    source = FakeSource()
    source.arrays[6] = ("loss", "", "observed", np.array(1.5, dtype=np.float32))
    app = TensorDbgApp(LocalClient(source))

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            grid = await open_tensor(pilot, 6, "loss", TensorGrid)
            await until(pilot, lambda: grid.rows == 1 and grid.cell_text(0, 0) == "1.5")
            assert "".join(s.text for s in grid.render_line(0)).strip() == ""

    asyncio.run(flow())


def test_an_input_no_module_returned_says_what_made_it() -> None:
    """An input that no module returned was labelled with the module that took it ("fc1.input[0]
    <- fc1", as if fc1 made it): the batch, or its caller's own code, is named instead."""
    source = FakeSource()
    app = TensorDbgApp(LocalClient(source))

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await open_tensor(pilot, 1, "net.0.output", TensorGrid)
            app.main.show_tab("provenance")
            tree = app.query_one(Tree)
            await until(pilot, lambda: "net.0.output" in str(tree.root.label))
            await until(pilot, lambda: len(tree.root.children) > 1)
            assert "input[0]  ← the batch" in str(tree.root.children[1].children[0].label)

    asyncio.run(flow())


def test_enter_right_after_a_search_opens_the_found_modules_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/ net.2, Enter (back to the modules), Enter: the second Enter did nothing, for the
    module's tensors were listed only once the cursor had rested on it (a loaded machine
    stretches that moment: here, to 5 s)."""
    import tensordbg.tui.components.module_browser as browser

    monkeypatch.setattr(browser, "SETTLE", 5.0)
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            table = app.main.module_browser.table
            await until(pilot, lambda: table.row_count > 0)
            app.main.show_tab("modules")
            await pilot.press("slash", *"net.2", "enter", "enter")
            tensors = app.main.module_browser.tensor_table
            assert table.current is not None and table.current["path"] == "net.2"
            assert app.focused is tensors and tensors.row_count == 1

    asyncio.run(flow())


def test_an_observed_losss_hit_is_not_said_to_come_from_a_modules_call() -> None:
    """A NaN loss given to observe() read "[NaN] loss  observed of (model), call 0" (found trying
    the product as a new user): no module and no call made it. A parameter's hit names its
    module without a call, which any call of it uses."""
    from tensordbg.tui.components.hit_detail import HitDetail

    source = FakeSource()
    source._hits[0].update(kind="observed", module="", tensor="loss")
    source._hits[1].update(kind="param", module="net.2", tensor="net.2.weight")
    app = TensorDbgApp(LocalClient(source))

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            detail = app.query_one(HitDetail)
            await until(pilot, lambda: "loss  observed  step" in str(detail.render()))
            assert "(model)" not in str(detail.render()) and "call" not in str(detail.render())
            await pilot.press("down")
            await until(pilot, lambda: "net.2.weight  param of net.2  step" in str(detail.render()))

    asyncio.run(flow())
