"""What a second new-user trial of the UI found, each driven as that person did: the keys panel,
the dialogs (where they open, what they say, what they keep), a replay's log and an 80x24
terminal.

Like test_tui, each test runs the real app headless against the numpy-only FakeSource.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fake_source import FakeSource
from test_tui import SIZE, mounted, paused_on_the_two_hits, shown, text_of, until
from test_tui_errors import in_the_log, log_text
from test_tui_newcomer import screen_text
from textual.css.query import NoMatches
from textual.pilot import Pilot
from textual.widgets import Input, Static
from textual.widgets._key_panel import BindingsTable

from tensordbg.sources.contract import SourceError
from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.dialog_body import DialogBody
from tensordbg.tui.components.rule_doc import RuleDoc, plain
from tensordbg.tui.screens.main import TABS
from tensordbg.tui.screens.profile_steps import ProfileStepsScreen
from tensordbg.tui.screens.rule_add import RuleAddScreen
from tensordbg.tui.screens.rule_edit import RuleEditScreen

Check = Callable[[TensorDbgApp, Pilot], Awaitable[None]]


def run(source: FakeSource, check: Check, size: tuple[int, int] = SIZE, **options: Any) -> None:
    """Run ``check(app, pilot)`` on the UI paused on the FakeSource's two hits, every tab there."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source), **options)
        async with app.run_test(size=size) as pilot:
            await paused_on_the_two_hits(pilot)
            await mounted(pilot)
            await check(app, pilot)

    asyncio.run(flow())


async def edit_rule(app: TensorDbgApp, pilot: Pilot, row: int) -> RuleEditScreen:
    """The edit dialog of the rule on ``row`` of the Rules tab."""
    panel = app.main.rule_panel
    await pilot.press("f6")
    await until(pilot, lambda: panel.current is not None)
    panel.table.move_cursor(row=row)
    await pilot.press("e")
    await shown(pilot, RuleEditScreen)
    await pilot.pause(0.1)
    return app.screen  # type: ignore[return-value]


async def open_keys_panel(app: TensorDbgApp, pilot: Pilot) -> list[str]:
    """Open the keys panel (?) and read its rows once it settles: it builds its table again as
    the focus settles, and a read between the two found no table (CI, and ~1 run in 2 here)."""
    app.action_show_help_panel()
    rows: list[str] = []

    def settled() -> bool:
        try:
            now = keys_panel_rows(app)
        except NoMatches:
            return False
        same = bool(now) and now == rows
        rows[:] = now
        return same

    await until(pilot, settled)
    return rows


def keys_panel_rows(app: TensorDbgApp) -> list[str]:
    """The rows of the keys panel (ctrl+p, "Keys"), each "keys  description"."""
    table = app.screen.query_one(BindingsTable).render_bindings_table()
    keys, descriptions = table.columns
    return [
        f"{key}  {description}"
        for key, description in zip(keys._cells, descriptions._cells, strict=True)
    ]


# --- 1. ctrl+q -----------------------------------------------------------------------------------


def test_the_keys_panel_says_ctrl_q_detaches_as_q_does() -> None:
    """The keys panel listed ctrl+q as Textual's "Quit ... return to the command prompt", while
    it detaches from the training as q does: it is listed with q, under q's description."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        rows = await open_keys_panel(app, pilot)
        assert "^q q  Detach & quit" in rows, rows
        assert not any("command prompt" in row for row in rows)

    run(FakeSource(), check)


def test_the_keys_panel_lists_the_count_keys_once_with_what_they_do() -> None:
    """Ten rows of bare digits, with no description, were listed for the count typed before a
    key: one row says what they do."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        rows = await open_keys_panel(app, pilot)
        assert sum("Steps for the next s (5s: five steps)" in row for row in rows) == 1, rows
        assert not any(row.strip() in {str(d) for d in range(10)} for row in rows), rows

    run(FakeSource(), check)


def test_question_mark_opens_the_keys_panel_but_not_in_the_slice_box() -> None:
    """? did nothing: the keys were only under ctrl+p, Keys (found by a new user's trial). In
    the Tensor tab's slice box a ? is text."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("question_mark")
        await until(pilot, lambda: app.screen.query(BindingsTable))
        await pilot.press("escape")
        await until(pilot, lambda: not app.screen.query("HelpPanel"))
        box = Input()
        await app.screen.mount(box)
        box.focus()
        await pilot.press("question_mark")
        await pilot.pause()
        assert box.value == "?" and not app.screen.query("HelpPanel")

    run(FakeSource(), check)


def test_escape_closes_the_keys_panel() -> None:
    """It took ctrl+p and Keys again to close it (found trying the UI as a new user)."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        app.action_show_help_panel()
        await until(pilot, lambda: app.screen.query(BindingsTable))
        await pilot.press("escape")
        await until(pilot, lambda: not app.screen.query("HelpPanel"))
        assert app.is_running and app.screen is app.main

    run(FakeSource(), check)


def test_the_keys_panel_lists_the_ranks_keys_for_a_job_of_several_ranks_only() -> None:
    """F9 (the ranks side by side) and R (the next rank) were listed for a training of one
    process, where they do nothing."""

    class Job(FakeSource):
        def info(self) -> Any:
            return {**super().info(), "world_size": 2}

    def listed(source: FakeSource) -> list[str]:
        rows: list[str] = []

        async def check(app: TensorDbgApp, pilot: Pilot) -> None:
            rows.extend(await open_keys_panel(app, pilot))

        run(source, check)
        return [row for row in rows if row.endswith(("  Ranks", "  Next rank"))]

    assert listed(FakeSource()) == []
    assert listed(Job()) == ["f9  Ranks", "R  Next rank"]


def test_where_q_only_quits_the_keys_panel_says_ctrl_q_only_quits() -> None:
    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        assert app.active_bindings["ctrl+q"].binding.description == "Quit"
        assert "^q q  Quit" in await open_keys_panel(app, pilot)
        await pilot.press("ctrl+q")
        await until(pilot, lambda: not app.is_running)

    source = FakeSource()
    run(source, check, ends_training=True)
    assert source.controls == []  # the training ends with this UI: nothing is detached


def test_ctrl_q_on_a_dialog_still_detaches_and_quits() -> None:
    source = FakeSource()

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("P")
        await shown(pilot, ProfileStepsScreen)
        await pilot.press("ctrl+q")
        await until(pilot, lambda: not app.is_running)

    run(source, check)
    assert source.controls == [("detach", 1)]


# --- 2. the profile dialog -----------------------------------------------------------------------


def test_the_profile_dialog_opens_in_the_middle_of_the_screen_as_the_others_do() -> None:
    """P's dialog opened at the top left of the terminal."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("P")
        await shown(pilot, ProfileStepsScreen)
        await pilot.pause(0.1)
        dialog = app.screen.query_one(".dialog").region
        width, height = SIZE
        assert abs(dialog.x - (width - dialog.right)) <= 1, dialog
        assert abs(dialog.y - (height - dialog.bottom)) <= 1, dialog

    run(FakeSource(), check)


# --- 3. a threshold the training refuses ---------------------------------------------------------


class StrictSource(FakeSource):
    """Its VanishingGradient has two thresholds, which need numbers; an edit is checked whole
    before any of it is made, as the live session checks it."""

    def __init__(self) -> None:
        super().__init__()
        self._rules[1]["params"] = {"threshold": 1e-7, "window": 10}

    def set_rule(
        self, id: int, enabled: bool | None = None, params: dict[str, Any] | None = None
    ) -> Any:
        for key, value in (params or {}).items():
            if value is None:
                raise SourceError(f"VanishingGradient.{key} takes a number, not None")
        return super().set_rule(id, enabled, params)


def test_an_emptied_threshold_is_refused_in_the_dialog_which_keeps_the_other_edits() -> None:
    """Emptying one threshold sent None, which the training refused, and the dialog closed: the
    other edits made in it were lost. The dialog stays open, says why, and keeps them."""
    source = StrictSource()

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        dialog = await edit_rule(app, pilot, row=1)
        threshold, window = dialog.query(Input)
        threshold.value = "1e-5"
        window.value = ""
        error = dialog.query_one(".dialog-error", Static)
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is not dialog or "refused" in text_of(error))
        assert app.screen is dialog, "the dialog closed, and the threshold typed was lost"
        assert "VanishingGradient.window takes a number, not None" in text_of(error)
        assert threshold.value == "1e-5"
        assert source._rules[1]["params"] == {"threshold": 1e-7, "window": 10}

        window.value = "20"
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is app.main)
        assert source._rules[1]["params"] == {"threshold": 1e-5, "window": 20}
        panel = app.main.rule_panel
        await until(pilot, lambda: panel.current["params"]["window"] == 20)
        # What changed, said whole and logged (it said "VanishingGradient thresholds.").
        said = "VanishingGradient thresholds changed: threshold=1e-05  window=20"
        assert f"{said}." in text_of(panel.result)
        await in_the_log(pilot, " ".join(f"rules: {said}".split()))  # as the Log wraps it

    run(source, check)


def test_at_80x24_the_training_refusing_an_edit_is_said_where_it_can_be_seen() -> None:
    """The error sat at the foot of the dialog's body, which scrolls on a short terminal: Enter
    on a refused value seemed to do nothing (found trying the UI at 80x24 in tmux)."""
    source = StrictSource()
    # A doc as long as a real rule's (ExplodingGradient's: its defaults and their sources).
    source._rules[1]["doc"] = "\n".join(f"Line {i} of what the rule does." for i in range(30))
    source._rules[1]["params"] = {"threshold": 1e-7, **{f"p{i}": 1.0 for i in range(5)},
                                  "window": 10}  # fmt: skip

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        dialog = await edit_rule(app, pilot, row=1)
        threshold, *_, window = dialog.query(Input)
        window.value = ""
        error = dialog.query_one(".dialog-error", Static)
        body = dialog.query_one(DialogBody)
        threshold.focus()
        await pilot.pause(0.1)
        assert not body.scrollable_content_region.contains_region(error.region)  # below
        await pilot.press("enter")
        await until(pilot, lambda: "refused" in text_of(error))
        await until(pilot, lambda: body.scrollable_content_region.contains_region(error.region))

    run(source, check, size=(80, 24))


def test_a_rule_the_training_refuses_to_add_keeps_the_add_dialog_open() -> None:
    source = FakeSource()

    def refuse(name: str, match: str = "*", params: dict[str, Any] | None = None) -> Any:
        raise SourceError("TensorRange.max_gt takes a number, not 'x'")

    source.add_rule = refuse  # type: ignore[method-assign]

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("f6")
        await until(pilot, lambda: app.main.rule_panel.current is not None)
        await pilot.press("a")
        await shown(pilot, RuleAddScreen)
        app.screen.query_one("#rule-match", Input).value = "net.*"
        app.screen.query_one("#save").press()
        error = app.screen.query_one(".dialog-error", Static)
        await until(pilot, lambda: "refused" in text_of(error))
        assert "max_gt takes a number" in text_of(error)
        assert app.screen.query_one("#rule-match", Input).value == "net.*"

    run(source, check)


# --- 4. descriptions -----------------------------------------------------------------------------

SPHINX_DOC = (
    "A tensor that is all zeros (or as close to it as ``threshold``); see :meth:`~Rule.check` "
    "and :class:`TensorRange`, or `the guide`."
)
PLAIN_DOC = (
    "A tensor that is all zeros (or as close to it as threshold); see Rule.check and "
    "TensorRange, or the guide."
)


def test_plain_strips_restructuredtext_and_leaves_other_text_as_written() -> None:
    assert plain(SPHINX_DOC) == PLAIN_DOC
    assert plain("net.[ab]* holds 2 NaN") == "net.[ab]* holds 2 NaN"


def test_a_rules_description_shows_without_its_restructuredtext_markup() -> None:
    """The dialogs showed descriptions (docstrings) with ``threshold`` and :meth:`x` in them."""
    source = FakeSource()
    source._rules[1]["doc"] = SPHINX_DOC
    rules = source.rules()
    source.rules = lambda: {  # type: ignore[method-assign]
        **rules,
        "available": [{"name": "TensorRange", "doc": SPHINX_DOC, "params": {"max_gt": None}}],
    }

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        dialog = await edit_rule(app, pilot, row=1)
        assert text_of(dialog.query_one(RuleDoc)) == PLAIN_DOC
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main)
        await pilot.press("a")
        await shown(pilot, RuleAddScreen)
        assert text_of(app.screen.query_one(RuleDoc)) == PLAIN_DOC

    run(source, check)


# --- 5. long threshold names ---------------------------------------------------------------------


def test_at_80_columns_a_long_threshold_name_is_shown_whole() -> None:
    """LossNotDecreasing's increase_threshold_percent showed as "increase_threshold_pe"."""
    source = FakeSource()
    source._rules[1]["params"] = {"num_steps": 10, "increase_threshold_percent": 5.0}

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await edit_rule(app, pilot, row=1)
        assert "increase_threshold_percent" in screen_text(app)
        assert all(box.region.width >= 20 for box in app.screen.query(Input))

    run(source, check, size=(80, 24))


# --- 6. a replay's log ---------------------------------------------------------------------------


def test_a_replay_names_no_process_in_the_log(tmp_path: Path) -> None:
    """tensordbg replay's Log said "pid 0": a recorded run has no process."""
    from dumps import write_dump

    from tensordbg.dump import load
    from tensordbg.sources.replay import ReplaySource

    source = ReplaySource(load(write_dump(tmp_path / "run")))

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "replay")
            await mounted(pilot)
            await in_the_log(pilot, "connected to")
            assert "rank 0)" in log_text(app) and "pid" not in log_text(app)
            assert len(source.hits()) == 1 and log_text(app).endswith("replay at step 3, 1 hit")

    asyncio.run(flow())


def test_a_slices_rows_and_columns_are_labelled_with_the_tensors_indices() -> None:
    """``[1:7:2, 1:]`` of an 8x4 tensor was labelled 0 1 2 down and across, as if it were the
    tensor's first rows and columns (found trying the UI as a new user): 1 3 5 and 1 2 3."""
    from test_tui import TensorGrid, type_slice

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await paused_on_the_two_hits(pilot)
        await mounted(pilot)
        await pilot.press("enter")
        inspector, grid = app.main.tensor_inspector, app.query_one(TensorGrid)
        await until(pilot, lambda: grid.rows == 8 and grid.cell_text(1, 2) is not None)
        await type_slice(pilot, "[1:7:2, 1:]")
        await pilot.press("enter")
        await until(pilot, lambda: inspector.text == "[1:7:2, 1:]" and grid.cell_text(2, 2))
        assert grid.render_line(0).text.split() == ["1", "2", "3"]
        assert [grid.render_line(y).text.split()[0] for y in (1, 2, 3)] == ["1", "3", "5"]

    run(FakeSource(), check)


def test_the_labels_of_a_slice_follow_numpys_indexing() -> None:
    from tensordbg.sources.slicing import axis_labels, parse_index, result_shape

    def labels(text: str, shape: tuple[int, ...] = (8, 10)) -> list[list[int] | None]:
        index = parse_index(text)
        found = axis_labels(shape, index)
        assert len(found) == len(result_shape(shape, index))  # one a dim of the result
        return [None if axis is None else list(axis) for axis in found]

    assert labels("[3, 2:5]") == [[2, 3, 4]]  # an integer drops its dim
    assert labels("[1::3]") == [[1, 4, 7], list(range(10))]  # a step, from 1 up
    assert labels("[..., [0, -1]]") == [list(range(8)), [0, 9]]  # negatives as the tensor's
    assert labels("[None, 2]") == [None, list(range(10))]  # a new axis has no index
    assert labels("[[0, 1], [1, 2]]") == [None]  # lists pair up: no single index a position
    assert len(axis_labels((10**9,), parse_index("[5:]"))[0]) == 10**9 - 5  # a range, not a list


# --- 7. 80 x 24 ----------------------------------------------------------------------------------


def test_at_80_by_24_every_tab_names_its_key_and_the_footer_ends_whole() -> None:
    """At 80x24 the tab bar dropped its F-keys (with them it was cut) and the footer could end
    cut: the tabs close up to keep their keys, the footer keeps the palette key whole."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.pause(0.1)
        lines = screen_text(app).splitlines()
        bar, footer = lines[1], lines[23]
        for tab in TABS:
            assert f"{tab.title} {tab.key.upper()}" in bar, bar  # "Provenance F5"
        # Keys left out, and a sign that there are more (ctrl+p has them): it was silent.
        assert re.search(r"\^p \+\d keys?$", footer.rstrip()), footer
        await pilot.resize_terminal(120, 30)
        await pilot.pause(0.1)
        assert "Provenance F5  Rules F6" in screen_text(app).splitlines()[1]
        await pilot.resize_terminal(250, 30)
        await pilot.pause(0.1)
        assert screen_text(app).splitlines()[29].rstrip().endswith("^p palette")  # all shown

    run(FakeSource(), check, size=(80, 24))


def test_at_80_columns_the_operation_that_made_the_nan_and_its_line_are_shown_whole() -> None:
    """The operation and its line of code shared one line of the provenance tree, cut at the
    right edge without a mark: "... softmax  line 53: weights = F.softm"."""
    source = FakeSource()
    original = source.provenance
    code = "weights = F.softmax(scores.masked_fill(mask, -inf), dim=-1)"
    source.provenance = lambda *args, **kwargs: {  # type: ignore[method-assign]
        **original(*args, **kwargs),
        "operation": {
            "op": "torch.nn.functional.softmax",
            "file": "model.py",
            "line": 53,
            "function": "forward",
            "code": code,
            "first_line": 40,
        },
    }

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("f5")
        await until(pilot, lambda: "made by" in screen_text(app))
        await pilot.pause(0.1)
        lines = screen_text(app).splitlines()
        assert any(line.rstrip().endswith("made by torch.nn.functional.softmax") for line in lines)
        assert any(line.rstrip().endswith(f"line 53: {code}") for line in lines), lines

    run(source, check, size=(80, 24))


def test_a_gradients_source_is_said_to_be_the_forward_call_it_flows_back_through() -> None:
    """A NaN made in backward by code between modules (a sqrt of a zero distance) showed the
    arrow at ``logits = model(x)`` under "source", read as the line that made it."""
    source = FakeSource()
    original = source.provenance

    def provenance(*args: Any, **kwargs: Any) -> Any:
        return {**original(*args, **kwargs), "kind": "grad_output"}

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("f5")
        box = app.query_one("#provenance-source", Static)
        await until(pilot, lambda: "Made in backward" in screen_text(app))
        assert box.border_title == "the forward call it flows back through"
        source.provenance = original  # type: ignore[method-assign]
        app.main.provenance_view.load(3)
        await until(pilot, lambda: box.border_title == "source")
        assert "Made in backward" not in screen_text(app)

    source.provenance = provenance  # type: ignore[method-assign]
    run(source, check)
