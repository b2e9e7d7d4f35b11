"""The Profile tab as a new user met it in an 80x24 terminal (the profiler's trial): each test is
one thing it got wrong there. A profile of steps that mostly sleep drew empty rows at zoom ×1,
the memory chart's scale skipped a value, the Overview did not scroll after P, and the
Operators' status line was cut mid-sentence beside a ``g`` that could not work."""

from __future__ import annotations

import itertools
import re
from typing import Any

from fake_source import FakeSource
from profile_fixtures import cpu_report, cuda_report, sleepy_report
from test_tui import footer_keys, shown, until
from test_tui_profiler import ask_for_a_profile, drawn, with_report
from test_tui_profiler import run as profiler_run
from textual.pilot import Pilot

from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.profiler.timeline import LABEL
from tensordbg.tui.screens.profile_steps import ProfileStepsScreen

SMALL = (80, 24)


def run(source: FakeSource, flow: Any, size: tuple[int, int] = SMALL) -> None:
    profiler_run(source, flow, size)


def line(view: Any, y: int) -> str:
    """Line ``y`` of the timeline as drawn (0 is the ruler)."""
    return "".join(segment.text for segment in view.render_line(y))


# --- the Timeline -------------------------------------------------------------------------------


def test_at_zoom_1_every_phase_shorter_than_a_cell_is_still_drawn_in_a_labelled_lane() -> None:
    """Forward, backward, the optimizer and the DataLoader took 1-2 ms of 65 ms steps; at 80
    columns a cell is 6 ms, and the rows under the steps looked empty, labelled ``·``."""
    report = sleepy_report()
    spans = report["timeline"]["lanes"][0]["spans"]
    phases = [s for s in spans if not s[2].startswith(("step", "aten::"))]

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        view = (await with_report(pilot, "timeline")).timeline
        assert (view.t0, view.t1) == (0.0, report["timeline"]["end"])  # zoom ×1
        dt = (view.t1 - view.t0) / view.columns
        assert all(s[1] < dt / 3 for s in phases)
        rows = [line(view, y) for y in range(1, 4)]
        assert rows[0].startswith("thread 12581 (main)")
        assert rows[1][:LABEL].strip() == "depth 1" and rows[2][:LABEL].strip() == "depth 2"
        for start, _, name in phases:  # each one's cell holds a mark, not a blank
            assert rows[1][LABEL + int(start / dt)] != " ", (name, rows[1])

    run(FakeSource(report=sleepy_report()), flow)


def test_the_ruler_labels_the_whole_window_to_its_end() -> None:
    """At 80 columns it stopped at 187 ms of 327 ms with room for another label."""

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        view = (await with_report(pilot, "timeline")).timeline
        ruler = line(view, 0)
        assert ruler[LABEL:].startswith("|0 ") and ruler.endswith("325 ms|"), ruler
        assert len(re.findall(r"\|\d+ ms", ruler)) >= 2, ruler  # and some between
        await pilot.press(*["plus"] * 7)  # zoomed in, the labels still tell apart
        ruler = line(view, 0)
        values = re.findall(r"([\d.]+) ms", ruler)
        assert len(values) >= 3 and len(set(values)) == len(values), ruler

    run(FakeSource(report=sleepy_report()), flow)


def test_neighbouring_spans_keep_their_names_apart_and_a_cut_name_ends_in_an_ellipsis() -> None:
    """Zoomed in at 120x40: ``enumeratetensordbg: forw  tensordbg: bacOptimizer.step#Ad``."""
    report = sleepy_report()
    loading = next(s for s in report["timeline"]["lanes"][0]["spans"] if "DataLoader" in s[2])

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        view = (await with_report(pilot, "timeline")).timeline
        view._move_to(loading[0], 2.5 * loading[1])  # the batch's loading, then the forward
        await pilot.pause()
        row = line(view, 2)[LABEL:].replace("│", " ")  # the cursor's column, where blank
        assert row.startswith("enumerate(DataLoader)#") and "… tensordbg: forward" in row, row
        for cut in re.finditer("…", row):
            assert row[cut.end() : cut.end() + 1] in ("", " "), row
        for name in re.finditer("enumerate|tensordbg|Optimizer", row):
            assert name.start() == 0 or row[name.start() - 1] == " ", row

    run(FakeSource(report=report), flow, size=(120, 40))


# --- the Memory chart ---------------------------------------------------------------------------


def test_the_memory_axis_is_even_and_true_at_every_size() -> None:
    """At 80x24 the labels read 861.6, 720.7, 579.9, 298.2, 157.3, 16.5 on evenly spaced rows:
    plotext put seven labels on six rows and one was lost."""

    def labels(chart: str) -> list[tuple[int, float]]:
        rows = [r for r in chart.splitlines() if "┤" in r or "│" in r[:6]]
        out = [(n, float(r.split("┤")[0])) for n, r in enumerate(reversed(rows)) if "┤" in r]
        return out

    for size in (SMALL, (100, 30), (120, 40)):

        async def flow(app: TensorDbgApp, pilot: Pilot, size: Any = size) -> None:
            profiler = await with_report(pilot, "memory")
            await pilot.pause(0.05)
            ticks = labels(drawn(profiler.memory.chart))
            assert len(ticks) >= 4, ticks
            (r0, v0), (r1, v1) = ticks[0], ticks[-1]
            per_row = (v1 - v0) / (r1 - r0)
            gaps = {b[0] - a[0] for a, b in itertools.pairwise(ticks)}
            assert len(gaps) == 1, (size, ticks)  # evenly spaced rows
            for row, value in ticks:  # each label the value of its row
                assert abs(value - (v0 + per_row * (row - r0))) < 0.1 * per_row, (size, ticks)
            assert v0 == 0  # memory from nothing up

        run(FakeSource(report=cpu_report()), flow, size=size)


# --- the Overview -------------------------------------------------------------------------------


def test_the_overview_scrolls_with_the_usual_keys_once_a_profile_asked_for_with_P_is_in() -> None:
    """The category table, the advice and the trace were below an 80x24 screen, and PageDown,
    Down and End did nothing: the keys stayed on the tab, which had no view to give them to
    when P was pressed."""
    source = FakeSource()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        await ask_for_a_profile(app, pilot)
        profiler = app.main.profiler_view
        await until(pilot, lambda: source.profiles == [5])
        source.run_profile(cpu_report(), steps=5)
        await until(pilot, lambda: profiler.report is not None)
        overview = profiler.overview
        await until(pilot, lambda: overview.max_scroll_y > 0)
        await pilot.press("pagedown")
        await until(pilot, lambda: overview.scroll_y > 0)
        await pilot.press("end")
        await until(pilot, lambda: overview.scroll_y == overview.max_scroll_y)
        assert app.focused is overview

    run(source, flow)


# --- the Operators ------------------------------------------------------------------------------


def test_the_operators_status_fits_or_ends_in_an_ellipsis() -> None:
    """``58 operators · sorted by self CPU ▼ · o: sort by the next column, O: reverse,``"""
    report = cpu_report()
    for n in range(60):  # as many operators as a real profile
        report["operators"].append({**report["operators"][2], "name": f"aten::op_{n}"})

    for with_shapes in (False, True):
        if not with_shapes:
            for row in report["operators"]:
                row["input_shapes"] = None

        async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
            pane = (await with_report(pilot, "operators")).operators
            shown = drawn(pane.status).rstrip()
            assert shown.endswith(("search", "…")), shown

        run(FakeSource(report=report), flow)


def test_g_is_offered_only_with_shapes_and_otherwise_says_how_to_record_them() -> None:
    """The footer offered ``g Group by shape`` and g said only "This profile has no input
    shapes to group by.": it says how to record them."""

    async def without(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "operators")
        assert "g" not in footer_keys(app, profiler.operators)
        await pilot.press("g")
        await until(pilot, lambda: app._notifications)
        message = [n.message for n in app._notifications][-1]
        assert '"Record input shapes" ticked' in message and "record_shapes=True" in message
        assert not profiler.operators.by_shape

    run(FakeSource(report=cuda_report()), without, size=(160, 40))

    async def with_shapes(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "operators")
        assert "g" in footer_keys(app, profiler.operators)
        await pilot.press("g")
        assert profiler.operators.by_shape

    run(FakeSource(report=cpu_report()), with_shapes, size=(160, 40))


def test_p_asks_for_input_shapes_when_they_are_ticked() -> None:
    """The P dialog had no way to ask for shapes: the Operators view's g had nothing to group
    by in a profile asked for from the UI."""

    def ask(tick: bool) -> list[bool]:
        source = FakeSource()

        async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
            await pilot.press("P")
            await shown(pilot, ProfileStepsScreen)
            if tick:
                app.screen.query_one("#profile-shapes").value = True
            await pilot.press("enter")
            await until(pilot, lambda: source.profiles == [5])

        run(source, flow, size=(80, 24))
        return source.profiled_shapes

    assert ask(False) == [False] and ask(True) == [True]
