"""The Profile tab (F8) driven like a person would, against the numpy-only FakeSource and the
fixture reports of ``profile_fixtures``: P asks how many steps and starts a profile, the views
fill when it is done, and each view answers its question (where the time went, which operator,
which kernel, how much memory, what ran when, how the GPU is doing, what to change)."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fake_source import FakeSource
from profile_fixtures import MIB, big_report, cpu_report, cuda_report
from test_tui import SIZE, active_tab, footer_keys, mounted, shown, text_of, until
from textual.pilot import Pilot
from textual.widgets import Input, TabbedContent, Tabs

from tensordbg.sources.contract import READ_ONLY
from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.launch import session_app
from tensordbg.tui.profiler.operators import by_operator
from tensordbg.tui.profiler.overview import categories_of
from tensordbg.tui.profiler.view import VIEWS, ProfilerView
from tensordbg.tui.screens.main import TABS
from tensordbg.tui.screens.profile_steps import ProfileStepsScreen


async def ask_for_a_profile(app: TensorDbgApp, pilot: Pilot) -> None:
    """P at a pause, and Enter in its dialog: the default five steps."""
    await pilot.press("P")
    await shown(pilot, ProfileStepsScreen)
    await pilot.press("enter")


def run(source: FakeSource, flow: Any, size: tuple[int, int] = SIZE) -> None:
    """Run ``flow(app, pilot)`` on the UI of ``source``, paused, at ``size``."""

    async def main() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await mounted(pilot)
            await flow(app, pilot)

    asyncio.run(main())


async def on_view(pilot: Pilot, view: str) -> ProfilerView:
    """The Profile tab open on ``view``, with the keys in it."""
    app = pilot.app
    app.show_profile_view(view)
    profiler = app.main.profiler_view
    await until(pilot, lambda: profiler.is_mounted and profiler.active_view == view)
    await until(pilot, lambda: app.focused in (profiler, *profiler.query("*")))
    return profiler


async def with_report(pilot: Pilot, view: str) -> ProfilerView:
    """The view, once the source's report has been fetched and drawn."""
    profiler = await on_view(pilot, view)
    await until(pilot, lambda: profiler.report is not None)
    await pilot.pause(0.05)
    return profiler


def drawn(widget: Any) -> str:
    """What ``widget`` shows on screen now, as text."""
    return "\n".join(strip.text for strip in widget.render_lines(widget.region.reset_offset))


# --- getting a profile --------------------------------------------------------------------------


def test_without_a_profile_every_view_says_how_to_get_one() -> None:
    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await on_view(pilot, "overview")
        assert "No profile yet." in text_of(profiler.status)
        assert "Press P" not in text_of(profiler.status)  # the view says it: once is enough
        for view in VIEWS:
            if view.key == "gpu":  # live samples, not a report
                continue
            note = profiler._empty[view.key]
            assert note.display, view
            text = text_of(note)
            assert "Press P" in text and "session.profile(steps=5)" in text, text
            assert "tensordbg run --profile 5" in text

    run(FakeSource(), flow)


def test_P_asks_how_many_steps_profiles_them_and_the_views_fill_when_it_is_done() -> None:
    source = FakeSource()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        assert "P" in footer_keys(app)
        await pilot.press("P")
        await shown(pilot, ProfileStepsScreen)
        box = app.screen.query_one(Input)
        assert box.value == "5"  # the default
        box.value = ""
        await pilot.press("3", "enter")
        await until(pilot, lambda: source.profiles == [3])
        profiler = app.main.profiler_view
        assert active_tab(app) == "profile"
        await until(pilot, lambda: "Profiling the next 3 steps" in text_of(profiler.status))
        # Paused on a hit: the profile waits for the training, and the line says so.
        assert "the training is paused: c continues it" in text_of(profiler.status)
        message = "profiling steps 4..6 after the warm-up step 3"
        source.emit("profile", {"state": "running", "step": 3, "steps": 3, "message": message})
        await until(pilot, lambda: f"Profiling 3 steps: {message}…" in text_of(profiler.status))
        source.run_profile(cpu_report(), steps=3)
        await until(pilot, lambda: profiler.report is not None)
        await until(pilot, lambda: "Profile of steps 2–6 on cpu" in text_of(profiler.status))
        assert "5 steps (2–6) on cpu" in text_of(profiler.overview.head)
        assert not profiler._empty["overview"].display

    run(source, flow)


def test_a_profile_cut_off_by_the_trainings_end_is_not_shown_in_progress() -> None:
    """The training finished while its profile ran: the line says so (and where the report
    goes), not "Profiling…" for ever."""
    source = FakeSource()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = app.main.profiler_view
        app.main.show_tab("profile")
        message = "profiling steps 4..8 after the warm-up step 3"
        source.emit("profile", {"state": "running", "step": 3, "steps": 5, "message": message})
        await until(pilot, lambda: "Profiling 5 steps" in text_of(profiler.status))
        source.emit("state", {"state": "finished", "step": 6})
        await until(pilot, lambda: "ended while profiling" in text_of(profiler.status))
        assert "Profiling 5 steps" not in text_of(profiler.status)

    run(source, flow)


def test_while_a_profile_is_pending_every_view_says_so_and_P_waits_for_it() -> None:
    """After P and Enter at a pause the line said "Profiling the next 5 steps" while the views
    below still said "Press P to profile", and P stayed in the footer."""
    source = FakeSource()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        await ask_for_a_profile(app, pilot)
        profiler = app.main.profiler_view
        await until(pilot, lambda: "Profiling the next 5 steps" in text_of(profiler.status))
        for note in profiler._empty.values():
            assert text_of(note).startswith("This view fills once the next 5 steps are profiled")
        await until(pilot, lambda: "P" not in footer_keys(app))
        titles = [c.title for c in app.get_system_commands(app.main)]
        assert "Profile the next N steps" not in titles
        source.run_profile(cpu_report(), steps=5)
        await until(pilot, lambda: profiler.report is not None)
        await until(pilot, lambda: "P" in footer_keys(app))

    run(source, flow)


def test_a_training_that_ended_says_so_in_every_view_not_press_P() -> None:
    """After the training finished the views still said "Press P to profile…", a key that
    does nothing any more; a profile that was still pending is said never to have started."""

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await on_view(pilot, "overview")
        source.emit("state", {"state": "finished", "step": 3})
        await until(pilot, lambda: app.state == "finished")
        await until(pilot, lambda: "has ended" in text_of(profiler._empty["overview"]))
        for note in profiler._empty.values():
            assert "Press P" not in text_of(note) and "has ended" in text_of(note)

    source = FakeSource()
    run(source, flow)

    async def pending(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = app.main.profiler_view
        await ask_for_a_profile(app, pilot)
        await until(pilot, lambda: "Profiling the next 5" in text_of(profiler.status))
        source.emit("state", {"state": "finished", "step": 3})
        await until(pilot, lambda: "before the profile started" in text_of(profiler.status))
        assert "no step was profiled" in text_of(profiler.status)
        note = text_of(profiler._empty["memory"])
        assert note.startswith("No profile reached this UI: the training ended first"), note

    source = FakeSource()
    run(source, pending)


def test_a_step_count_that_is_not_a_positive_number_gets_a_sentence_and_no_profile() -> None:
    source = FakeSource()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("P")
        await shown(pilot, ProfileStepsScreen)
        for bad in ("0", "-"):
            app.screen.query_one(Input).value = bad
            await pilot.press("enter")
            error = text_of(app.screen.query_one(".dialog-error"))
            assert "a whole number from 1 to 1000" in error
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ProfileStepsScreen))
        await pilot.pause(0.05)
        assert source.profiles == []

    run(source, flow)


def test_the_palette_offers_profiling_and_every_view() -> None:
    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        helps = {c.title: c.help for c in app.get_system_commands(app.main)}
        assert "Profile the next N steps" in helps
        assert "Show Profile" in helps
        for n, view in enumerate(VIEWS, 1):
            # Each said "(F8, then F8 again)": Memory, the fourth view, is not one F8 away.
            help = helps[f"Show Profile: {view.title}"]
            assert f"view {n} of {len(VIEWS)}" in help and "F8 again" not in help, help

    run(FakeSource(), flow)


def test_F8_goes_round_the_views_with_the_keys_in_each() -> None:
    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("f8")  # the tab
        profiler = app.main.profiler_view
        await until(pilot, lambda: active_tab(app) == "profile" and profiler.is_mounted)
        seen = [profiler.active_view]
        for _ in VIEWS:
            await pilot.press("f8")  # then the next view
            await until(pilot, lambda: profiler.active_view != seen[-1])
            seen.append(profiler.active_view)
        assert seen == [v.key for v in VIEWS] + [VIEWS[0].key]
        assert active_tab(app) == "profile"
        await pilot.press("f1", "f8")  # away and back: the tab is as it was left
        await until(pilot, lambda: active_tab(app) == "profile")
        assert profiler.active_view == "overview"

    run(FakeSource(report=cpu_report()), flow)


def test_F8_on_the_profile_tab_moves_to_the_next_view_wherever_the_keys_are() -> None:
    """After the profile dialog the keys were on the tab bar: the first F8 only gave them to
    the view, and the view moved at the second (found trying it as a new user)."""

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("f8")
        profiler = app.main.profiler_view
        await until(pilot, lambda: active_tab(app) == "profile" and profiler.is_mounted)
        first = profiler.active_view
        app.set_focus(app.main.query(Tabs).first())  # the keys on the main tab bar
        await pilot.pause()
        await pilot.press("f8")
        await until(pilot, lambda: profiler.active_view != first)
        assert active_tab(app) == "profile"

    run(FakeSource(report=cpu_report()), flow)


def test_a_recorded_run_shows_its_stored_report_and_says_profiling_needs_a_live_run() -> None:
    source = FakeSource(capabilities=READ_ONLY, report=cpu_report())

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "overview")
        assert "5 steps (2–6) on cpu" in text_of(profiler.overview.head)
        await pilot.press("P")
        await pilot.pause(0.05)
        assert not isinstance(app.screen, ProfileStepsScreen)
        assert source.profiles == []
        notes = [n.message for n in app._notifications]
        assert any("profiling needs a live training" in m for m in notes), notes

    run(source, flow)


def test_a_recorded_run_without_a_profile_says_so_in_each_view() -> None:
    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await on_view(pilot, "operators")
        await until(pilot, lambda: "recorded run" in text_of(profiler._empty["operators"]))

    run(FakeSource(capabilities=READ_ONLY), flow)


# --- the views ----------------------------------------------------------------------------------


def test_overview_stacks_each_steps_categories_in_proportion_and_counts_the_advice() -> None:
    report = cpu_report()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "overview")
        bars = profiler.overview.bars.render()
        lines = bars.plain.splitlines()
        assert [c for c, _ in categories_of(report["breakdown"])] == [
            "DataLoader", "forward", "backward", "optimizer", "other",
        ]  # fmt: skip
        rows = {int(line.split()[1]): line for line in lines[1:]}
        assert sorted(rows) == report["steps"]
        lengths = {s: line.count("█") for s, line in rows.items()}
        slowest = max(report["breakdown"], key=lambda r: r["total"])
        assert max(lengths, key=lengths.get) == slowest["step"]
        for row in report["breakdown"]:  # as long as the step took, within a cell
            expected = row["total"] / slowest["total"] * lengths[slowest["step"]]
            assert abs(lengths[row["step"]] - expected) <= 1
        # The slowest step's DataLoader part (its first colour) is about its share of the bar.
        start = bars.plain.index(rows[slowest["step"]])
        first = next(s for s in bars.spans if s.start >= start + 11)
        share = (first.end - first.start) / lengths[slowest["step"]]
        assert abs(share - slowest["DataLoader"] / slowest["total"]) < 0.05
        assert profiler.overview.spark.data == [r["total"] for r in report["breakdown"]]
        notes = text_of(profiler.overview.notes)
        assert "2 pieces of advice" in notes
        assert "step 5 took" in notes  # the outlier
        assert report["trace"] in notes

    run(FakeSource(report=report), flow)


def test_operators_sort_by_each_column_group_by_shape_and_search() -> None:
    report = cpu_report()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "operators")
        pane, table = profiler.operators, profiler.operators.table
        assert app.focused is table
        # Grouped by operator first: the two shapes of aten::addmm are one row.
        names = [r["name"] for r in table.shown_rows()]
        assert names.count("aten::addmm") == 1
        addmm = next(r for r in table.shown_rows() if r["name"] == "aten::addmm")
        assert addmm["calls"] == 20
        assert addmm["self_cpu"] == sum(
            r["self_cpu"] for r in report["operators"] if r["name"] == "aten::addmm"
        )
        assert table.sort_key == "self_cpu"
        keys = [c.key for c in table.columns]
        for n in range(len(keys)):  # o: each column in turn, from the one after self CPU
            column = table.columns[(keys.index("self_cpu") + 1 + n) % len(keys)]
            await pilot.press("o")
            key = column.key
            assert table.sort_key == key
            values = [r.get(key) for r in table.shown_rows()]
            known = [v for v in values if v is not None]
            order = sorted(known, key=lambda v: v.lower() if isinstance(v, str) else v)
            assert known == (order[::-1] if column.numeric else order), key
            assert values[: len(known)] == known, key  # unknown values last
            await pilot.press("O")
            assert table.descending is not column.numeric
            assert key in text_of(pane.status) or column.title in text_of(pane.status)
        await pilot.press("g")  # by operator and input shape
        assert [r["name"] for r in table.shown_rows()].count("aten::addmm") == 2
        assert "grouped by operator and input shape" in text_of(pane.status)
        await pilot.press("slash")
        assert app.focused is pane.search
        await pilot.press(*"relu")
        assert [r["name"] for r in table.shown_rows()] == ["aten::relu"]
        assert "1 of 5 operators" in text_of(pane.status)
        await pilot.press("escape")
        assert app.focused is table and table.row_count == 5

    run(FakeSource(report=report), flow)


def test_operators_drop_the_device_columns_on_a_cpu_and_keep_them_on_a_gpu() -> None:
    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "operators")
        keys = [c.key for c in profiler.operators.table.columns]
        assert "self_device" in keys and "flops" in keys
        assert "input_shapes" not in keys  # the report has no shapes
        await pilot.press("g")
        assert not profiler.operators.by_shape

    run(FakeSource(report=cuda_report()), flow)


def test_kernels_on_a_gpu_and_why_there_are_none_on_a_cpu() -> None:
    async def flow_cpu(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "kernels")
        # Said once (it was "No kernels: profiled on the CPU: no kernels.").
        assert text_of(profiler.kernels.note) == "Profiled on the CPU: no kernels."
        assert not profiler.kernels.table.display

    run(FakeSource(report=cpu_report()), flow_cpu)

    async def flow_gpu(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "kernels")
        table = profiler.kernels.table
        assert app.focused is table
        assert [r["name"] for r in table.shown_rows()] == [  # longest total first
            "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8",
            "flash_fwd_kernel",
            "Memcpy HtoD (Pageable -> Device)",
        ]
        assert "Tensor Cores 29.9 % of kernel time" in text_of(profiler.kernels.note)

    run(FakeSource(report=cuda_report()), flow_gpu)


def test_memory_draws_the_curve_and_lists_the_top_allocators_with_the_peak_and_limit() -> None:
    async def flow_cpu(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "memory")
        memory = profiler.memory
        assert text_of(memory.summary) == "peak allocated 15 MiB"
        assert [r["bytes"] for r in memory.table.shown_rows()] == [42 * MIB, 10 * MIB, 3 * MIB]
        await pilot.pause(0.05)
        chart = drawn(memory.chart)
        assert "allocated" in chart and "reserved" not in chart  # a CPU reserves nothing
        assert "memory (MiB)" in chart

    run(FakeSource(report=cpu_report()), flow_cpu)

    async def flow_gpu(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "memory")
        summary = text_of(profiler.memory.summary)
        assert "peak reserved 60 GiB" in summary
        assert "limit 80 GiB (61.2 % used at the peak)" in summary
        await pilot.pause(0.05)
        chart = profiler.memory.chart
        text = drawn(chart)
        assert "reserved" in text and "memory (GiB)" in text

    run(FakeSource(report=cuda_report()), flow_gpu)


def test_timeline_zooms_pans_and_names_the_span_under_the_cursor() -> None:
    report = cpu_report()
    timeline = report["timeline"]
    lane = timeline["lanes"][0]

    def outermost_at(t: float) -> list[Any] | None:
        covering = [s for s in lane["spans"] if s[0] <= t < s[0] + s[1]]
        return max(covering, key=lambda s: s[1]) if covering else None

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "timeline")
        view = profiler.timeline
        assert app.focused is view
        full = view.t1 - view.t0
        assert (view.t0, view.t1) == (timeline["start"], timeline["end"])
        assert [r.lane for r in view.rows if r.depth == 0] == [x["name"] for x in timeline["lanes"]]
        await pilot.press("plus")
        assert abs((view.t1 - view.t0) - full / 2) < 1e-12
        await pilot.press("minus", "minus")  # never wider than the whole profile
        assert (view.t0, view.t1) == (timeline["start"], timeline["end"])
        await pilot.press(*["plus"] * 10)
        width = view.t1 - view.t0
        assert abs(width - full / 1024) < 1e-12
        for key, direction in (("right", 1), ("l", 1), ("left", -1), ("h", -1)):
            before = view.t0
            await pilot.press(key)
            assert abs(view.t0 - (before + direction * width / 4)) < 1e-12, key
        await pilot.press("end")
        assert abs(view.t1 - timeline["end"]) < 1e-12
        await pilot.press("home")
        assert view.t0 == timeline["start"]
        for _ in range(40):  # pan until the cursor is on a span
            centre = (view.t0 + view.t1) / 2
            span = outermost_at(centre)
            if span is not None and span[0] < centre - width and span[0] + span[1] > centre + width:
                break
            await pilot.press("right")
        assert span is not None
        status = text_of(profiler.timeline_status)
        assert status.startswith(f"{lane['name']}: {span[2]}  "), (status, span)
        await pilot.press("down")  # the row of spans inside it
        assert text_of(profiler.timeline_status).startswith(f"{lane['name']}, depth 1: ")
        row = "".join(s.text for s in view.render_line(1))  # the first lane, drawn
        assert row.startswith(lane["name"])
        assert span[2].removeprefix("aten::")[:4] in row

    run(FakeSource(report=report), flow)


def test_gpu_polls_nvml_samples_while_on_screen_and_stops_when_hidden() -> None:
    source = FakeSource(report=cuda_report(), gpus=2)

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await on_view(pilot, "gpu")
        gpu = profiler.gpu
        await until(pilot, lambda: len(source.gpu_requests) >= 2, timeout=5)
        numbers = drawn(gpu.numbers)
        assert "210.5 W" in numbers and "61 °C" in numbers and "1980" in numbers
        assert "51.8 MiB/s" in numbers and "8 GiB / 80 GiB" in numbers
        assert "NVIDIA H100 80GB HBM3" in text_of(gpu.head)
        assert "XID  Xid 79: GPU has fallen off the bus" in text_of(gpu.events)
        assert source.gpu_requests[1] > 0  # only the samples not yet seen
        assert len(gpu.util.data) == len(source.gpu_requests)
        profiler.show_view("advisor")
        await until(pilot, lambda: not gpu.polling)
        asked = len(source.gpu_requests)
        await pilot.pause(1.5)
        assert len(source.gpu_requests) == asked  # nothing asked while hidden

    run(source, flow)


def test_gpu_of_a_training_that_has_ended_says_so_and_asks_nothing() -> None:
    source = FakeSource(report=cuda_report(), gpus=2)

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        source.emit("state", {"state": "finished", "step": 6})
        await until(pilot, lambda: app.state == "finished")
        profiler = await on_view(pilot, "gpu")
        await until(pilot, lambda: "has ended" in text_of(profiler.gpu.head))
        await pilot.pause(1.0)
        assert source.gpu_requests == [] and not profiler.gpu.polling

    run(source, flow)


def test_gpu_without_nvml_is_one_line_with_the_reason() -> None:
    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await on_view(pilot, "gpu")
        await until(pilot, lambda: "NVML unavailable" in text_of(profiler.gpu.head))
        assert text_of(profiler.gpu.head) == (
            "NVML unavailable: libnvidia-ml.so.1 not found (no NVIDIA driver)"
        )
        assert not profiler.gpu.query_one("#gpu-live").display

    run(FakeSource(), flow)


def test_advisor_shows_each_rule_its_evidence_and_the_change_to_try() -> None:
    report = cpu_report()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await with_report(pilot, "advisor")
        text = drawn(profiler.advisor.body)
        for n, advice in enumerate(report["advice"], 1):
            assert f"{n}. {advice['rule']}" in text
            assert f"   evidence  {advice['evidence']}" in text
            assert f"   try       {advice['message']}" in text

    run(FakeSource(report=report), flow)


def test_advisor_keeps_a_sentence_that_wraps_beside_its_label() -> None:
    """A "try" line that wrapped went on at the left edge, under the label."""
    report = cpu_report()
    report["advice"][0]["message"] = "Load the batches in parallel worker processes " * 4

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.resize_terminal(80, 24)
        profiler = await with_report(pilot, "advisor")
        lines = drawn(profiler.advisor.body).splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("   try "))
        wrapped = lines[start + 1]
        assert wrapped.startswith(" " * 13) and wrapped[13] != " ", lines[start : start + 3]

    run(FakeSource(report=report), flow)


def test_grouping_sums_each_operators_shapes() -> None:
    rows = cpu_report()["operators"]
    merged = {r["name"]: r for r in by_operator(rows)}
    assert merged["aten::addmm"]["flops"] == 1_310_720 + 40_960
    assert merged["aten::relu"]["flops"] is None  # unknown for every shape: still unknown
    assert merged["aten::addmm"]["input_shapes"] is None


# --- a big report -------------------------------------------------------------------------------


def test_a_report_at_the_bounds_draws_every_view_without_freezing_the_ui() -> None:
    """20,000 timeline spans and 2,000 operators: filling the views and drawing each one stays
    well under a frame budget a person notices (the figure is printed: pytest -s)."""
    report = big_report()

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await on_view(pilot, "overview")
        fills, draws = [], {}
        for _ in range(3):
            started = time.perf_counter()
            profiler.show_report(report)
            fills.append(time.perf_counter() - started)
        for view in ("operators", "timeline", "memory", "overview"):
            profiler.show_view(view)
            await pilot.pause(0.05)
            widgets = {
                "operators": profiler.operators.table,
                "timeline": profiler.timeline,
                "memory": profiler.memory.chart,
                "overview": profiler.overview,
            }
            widget = widgets[view]
            times = []
            for _ in range(3):
                widget.refresh()
                if hasattr(widget, "_cache"):
                    widget._cache.clear()
                started = time.perf_counter()
                widget.render_lines(widget.region.reset_offset)
                times.append(time.perf_counter() - started)
            draws[view] = statistics.median(times)
        assert profiler.operators.table.row_count == 2000
        assert sum(len(r.starts) for r in profiler.timeline.rows) + profiler.timeline.hidden == (
            20_000
        )
        print(f"\nfill {statistics.median(fills) * 1e3:.0f} ms; draw (median of 3) "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in draws.items()))  # fmt: skip
        assert statistics.median(fills) < 1.0
        assert all(v < 0.5 for v in draws.values()), draws
        await pilot.press(*["plus"] * 4, "right", "minus")  # keys stay quick too
        started = time.perf_counter()
        profiler.timeline.render_lines(profiler.timeline.region.reset_offset)
        assert time.perf_counter() - started < 0.5

    run(FakeSource(), flow)


def test_the_views_are_switchable_in_the_nested_tabs() -> None:
    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await on_view(pilot, "overview")
        inner = profiler.query_one("#profile-views", TabbedContent)
        for view in VIEWS:
            inner.active = f"profile-{view.key}-pane"
            await until(pilot, lambda v=view: profiler.active_view == v.key)
        assert active_tab(app) == "profile"  # the outer tabs did not move

    run(FakeSource(report=cpu_report()), flow)


# --- the demo, live -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_offers_profiling_and_every_tab_is_reachable_and_fills_from_a_real_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's training, live over ZeroMQ: the footer and the palette offer P, every tab and
    every view of the Profile tab is a key away, and P then Enter profiles five real steps whose
    report fills the views."""
    from tensordbg import demo

    assert "P" in (demo.__doc__ or "") and "profiles the next steps" in demo.__doc__
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(runtime))
    env = {**os.environ, "TENSORDBG_RUN_ID": "demoprof"}
    # No broken batch within reach: the training runs while it is profiled.
    training = subprocess.Popen(
        [sys.executable, "-m", "tensordbg.demo", "--steps", "3000", "--bad-step", "100000"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    app = session_app(run_id="demoprof", wait=120.0, alive=lambda: training.poll() is None)
    assert app is not None

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "running", timeout=120)
            await mounted(pilot)
            assert "P" in footer_keys(app)
            titles = [c.title for c in app.get_system_commands(app.main)]
            assert "Profile the next N steps" in titles
            for tab in TABS:
                await pilot.press(tab.key)
                await until(pilot, lambda t=tab: active_tab(app) == t.pane)
            profiler = app.main.profiler_view
            for view in VIEWS[1:]:
                await pilot.press("f8")
                await until(pilot, lambda v=view: profiler.active_view == v.key)
            # No GPU (CI): it says why; a GPU: the view asked the training for samples, and
            # stopped asking once hidden (the views after it were shown).
            head = text_of(profiler.gpu.head)
            assert head.startswith("NVML unavailable") or (
                head.startswith("NVML: ") and profiler.gpu.polls >= 1
            ), head
            await pilot.press("f8")  # round to the Overview
            await ask_for_a_profile(app, pilot)
            await until(pilot, lambda: profiler.report is not None, timeout=120)
            report = profiler.report
            assert len(report["steps"]) == 5
            assert "5 steps" in text_of(profiler.overview.head)
            assert profiler.operators.table.row_count > 10
            assert "aten::" in " ".join(r["name"] for r in profiler.operators.table.shown_rows())
            assert sum(len(r.starts) for r in profiler.timeline.rows) > 0
            if report["device"] == "cpu":
                assert text_of(profiler.kernels.note) == "Profiled on the CPU: no kernels."
            assert "Profile of steps" in text_of(profiler.status)
            app.action_detach()
            await until(pilot, lambda: not app.is_running)

    try:
        asyncio.run(flow())
    finally:
        training.terminate()
        training.wait(timeout=30)


def test_operators_at_80_columns_keep_the_times_in_view_beside_a_long_name() -> None:
    """A backward operator's long name ("autograd::engine::evaluate_function: ...") made the
    name column 52 wide: at 80 columns only the calls were left in view, and the times the
    table is sorted by were off the right edge. The name gives way, cut with an ellipsis (the
    input shapes, last, may still be cut at the edge)."""
    report = cpu_report()
    report["operators"][0]["name"] = "autograd::engine::evaluate_function: AddmmBackward0"

    async def main() -> None:
        app = TensorDbgApp(LocalClient(FakeSource(report=report)))
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state == "paused")
            await mounted(pilot)
            table = (await with_report(pilot, "operators")).operators.table
            heading, *rows = drawn(table).splitlines()
            assert "self CPU ▼" in heading and "total CPU" in heading, heading
            assert any(row.startswith("autograd::engine::") and "…" in row[:30] for row in rows)

    asyncio.run(main())


def test_gpu_whose_request_fails_says_why_instead_of_asking_for_good() -> None:
    """The training stopped answering (it exited while the UI had not heard it finish): the
    GPU view said "Asking the training for GPU samples…" for as long as it was open."""
    from tensordbg.sources.contract import SourceError

    source = FakeSource(report=cuda_report(), gpus=2)

    def refuse(since: float = 0.0) -> dict[str, Any]:
        raise SourceError("not connected to a training")

    source.gpu = refuse  # type: ignore[method-assign]

    async def flow(app: TensorDbgApp, pilot: Pilot) -> None:
        profiler = await on_view(pilot, "gpu")
        await until(pilot, lambda: "No GPU samples" in text_of(profiler.gpu.head))
        assert "not connected to a training" in text_of(profiler.gpu.head)

    run(source, flow)


def test_a_range_that_crosses_another_s_end_keeps_no_later_span_deeper() -> None:
    """A trace's ranges need not nest (one began inside a step and ended after it): a span that
    ended under it stayed counted as open, each later step went a row deeper, past the rows
    drawn, and only the first step was on screen."""
    from tensordbg.tui.profiler.timeline import rows_of

    spans = [[0.0, 10.0, "step 1"], [5.0, 10.0, "crossing"], [12.0, 2.0, "after step 1"]]
    rows, hidden = rows_of({"lanes": [{"name": "main", "spans": spans}]})
    depth = {name: row.depth for row in rows for name in row.names}
    # Under the crossing range alone (step 1 ended at 10): one row down, not two.
    assert depth == {"step 1": 0, "crossing": 1, "after step 1": 1} and hidden == 0, depth
