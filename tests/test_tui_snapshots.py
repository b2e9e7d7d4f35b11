"""What a person sees on each tab of the debugger, paused on the NaN at net.2 (FakeSource), at
120 x 40. Regenerate with ``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at the
SVGs under tests/__snapshots__ before committing them."""

from __future__ import annotations

from fake_source import FakeSource
from test_tui import SIZE, until
from textual.pilot import Pilot
from textual.widgets import Input, Tree

from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.histogram_view import HistogramView
from tensordbg.tui.components.tensor_grid import TensorGrid


def app() -> TensorDbgApp:
    return TensorDbgApp(LocalClient(FakeSource()))


async def paused(pilot: Pilot) -> None:
    """Connected, everything loaded, and no blinking cursor to make snapshots differ."""
    app = pilot.app
    await until(pilot, lambda: app.state == "paused")
    await until(pilot, lambda: app.main.module_browser.table.row_count == 6)
    await until(pilot, lambda: app.main.rule_panel.current is not None)
    await until(pilot, lambda: all(w.is_mounted for w in app.main.query("TabPane > *")))
    await until(pilot, lambda: not app.main.query("Lazy"))
    for box in app.query(Input):
        box.cursor_blink = False


async def tensor_open(pilot: Pilot) -> None:
    await paused(pilot)
    await pilot.press("enter")  # on the origin hit
    grid = pilot.app.query_one(TensorGrid)
    histogram = pilot.app.query_one(HistogramView)
    await until(pilot, lambda: grid.rows == 8 and not grid.fetching and grid.cell_text(7, 3))
    await until(pilot, lambda: "NaN 2" in str(histogram.content) and histogram.fits)


def test_run_tab(snap_compare) -> None:
    async def run_before(pilot: Pilot) -> None:
        await paused(pilot)
        pilot.app.main.show_tab("run")

    assert snap_compare(app(), terminal_size=SIZE, run_before=run_before)


def test_hits_tab(snap_compare) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=paused)


def test_modules_tab(snap_compare) -> None:
    async def run_before(pilot: Pilot) -> None:
        await paused(pilot)
        pilot.app.main.show_tab("modules")
        await pilot.pause()
        await pilot.press("down", "down", "down", "down")  # to net.2, which has a hit
        tensors = pilot.app.main.module_browser.tensor_table
        await until(pilot, lambda: tensors.row_count == 1)

    assert snap_compare(app(), terminal_size=SIZE, run_before=run_before)


def test_tensor_tab(snap_compare) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=tensor_open)


def test_provenance_tab(snap_compare) -> None:
    async def run_before(pilot: Pilot) -> None:
        await tensor_open(pilot)
        pilot.app.main.show_tab("provenance")
        tree = pilot.app.query_one(Tree)
        await until(pilot, lambda: "net.2.output" in str(tree.root.label))

    assert snap_compare(app(), terminal_size=SIZE, run_before=run_before)


def test_rules_tab(snap_compare) -> None:
    async def run_before(pilot: Pilot) -> None:
        await paused(pilot)
        pilot.app.main.show_tab("rules")

    assert snap_compare(app(), terminal_size=SIZE, run_before=run_before)


def test_replay_of_a_dump(snap_compare, tmp_path) -> None:
    """tensordbg replay: the banner says which run and when, the footer offers n / p."""
    from dumps import write_dump

    from tensordbg.dump import load
    from tensordbg.sources.replay import ReplaySource

    source = ReplaySource(load(write_dump(tmp_path / "run")))

    async def run_before(pilot: Pilot) -> None:
        app = pilot.app
        await until(pilot, lambda: app.state == "replay")
        await until(pilot, lambda: app.main.hit_table.row_count == 1)
        await until(pilot, lambda: all(w.is_mounted for w in app.main.query("TabPane > *")))
        for box in app.query(Input):
            box.cursor_blink = False

    app = TensorDbgApp(LocalClient(source))
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def profiled_app() -> TensorDbgApp:
    from profile_fixtures import cpu_report

    return TensorDbgApp(LocalClient(FakeSource(report=cpu_report())))


async def profile_view(pilot: Pilot, view: str) -> None:
    """The Profile tab on ``view``, its report drawn."""
    await paused(pilot)
    app = pilot.app
    app.show_profile_view(view)
    profiler = app.main.profiler_view
    await until(pilot, lambda: profiler.report is not None and profiler.active_view == view)
    await pilot.pause(0.1)


def test_profile_overview(snap_compare) -> None:
    async def run_before(pilot: Pilot) -> None:
        await profile_view(pilot, "overview")

    assert snap_compare(profiled_app(), terminal_size=SIZE, run_before=run_before)


def test_profile_operators(snap_compare) -> None:
    async def run_before(pilot: Pilot) -> None:
        await profile_view(pilot, "operators")
        await pilot.press("g")  # by operator and input shape

    assert snap_compare(profiled_app(), terminal_size=SIZE, run_before=run_before)
