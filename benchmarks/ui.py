"""How quickly the terminal UI answers.

Run: ``python benchmarks/ui.py``. It measures, against the numpy-only FakeSource of the tests
(through the in-process LocalClient, so the numbers are the UI's own, not the socket's):

(a) cold start: from launching a fresh Python process to the first screen showing the paused
    training with its hits (median of 5 processes); target: < 1 s;
(b) key-press latency on a model of 2,000 modules, in the Modules tab: from a key press to the
    screen redrawn, for moving the cursor (down) and for typing into the search (filtering the
    2,000 modules), keys about ten a second; median of 40 presses each (the module's tensor
    list follows the cursor once it rests, SETTLE later);
(c) the values grid on a 10^8-element (10,000 x 10,000) tensor: from showing it to its first
    screen of values drawn, then from the End key to the last rows drawn, and the values it
    fetched for both (next to the 10^8 of the tensor).
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import textual

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fake_source import FakeSource  # noqa: E402

from tensordbg.transport.client import LocalClient  # noqa: E402
from tensordbg.tui.app import TensorDbgApp  # noqa: E402
from tensordbg.tui.components.tensor_grid import TensorGrid  # noqa: E402

COLD_STARTS = 5
PRESSES = 40
SIZE = (160, 50)

# The child process of (a): import the UI, connect, and say when the first frame that shows the
# paused training with its hits goes to the terminal (tabs that open hidden may still be mounting).
COLD_START = """
import sys
sys.path.insert(0, {tests!r})
from fake_source import FakeSource
from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp

app = TensorDbgApp(LocalClient(FakeSource()))
display = app._display

def first_frame(screen, renderable):
    display(screen, renderable)
    if renderable is not None and app.state == "paused" and app.main.hit_table.row_count:
        print("ready", flush=True)  # the parent stops this process

app._display = first_frame
app.run(headless=True, size=(120, 40))
"""


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, "
        f"textual {textual.__version__}, numpy {np.__version__}, {platform.system()}"
    )


def cold_start() -> list[float]:
    code = COLD_START.format(tests=str(ROOT / "tests"))
    times = []
    for _ in range(COLD_STARTS):
        started = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        assert child.stdout is not None
        line = child.stdout.readline()
        times.append(time.perf_counter() - started)
        child.kill()
        child.wait(30)
        if line.strip() != "ready":
            raise RuntimeError(f"the UI did not start: {line!r}")
    return times


class Drawn:
    """Catches the first frame the app sends to the (headless) terminal that shows something."""

    def __init__(self, app: TensorDbgApp) -> None:
        self._condition: Callable[[], object] | None = None
        self._at: float | None = None
        display = app._display

        def timed(screen, renderable):  # type: ignore[no-untyped-def]
            display(screen, renderable)
            if renderable is not None and self._condition is not None and self._condition():
                self._at, self._condition = time.perf_counter(), None

        app._display = timed  # type: ignore[method-assign]

    def expect(self, condition: Callable[[], object] = lambda: True) -> float:
        """Watch for the first frame after now that shows ``condition``; returns now."""
        self._at, self._condition = None, condition
        return time.perf_counter()

    async def seconds_since(self, started: float) -> float:
        while self._at is None:
            await asyncio.sleep(0.0005)
        return self._at - started


async def key_latency() -> tuple[list[float], list[float]]:
    """Presses about ten a second, as a person types; each from the press to its frame."""
    app = TensorDbgApp(LocalClient(FakeSource(modules=2000)))
    async with app.run_test(size=SIZE) as pilot:
        drawn = Drawn(app)
        table = app.main.module_browser.table
        while table.row_count != 2006:
            await pilot.pause(0.01)
        app.main.show_tab("modules")
        await pilot.pause(0.1)
        table.focus()
        await pilot.pause(0.1)
        moves = []
        for _ in range(PRESSES):
            row = table.cursor + 1
            started = drawn.expect(lambda row=row: table.cursor == row)
            await pilot.press("down")
            moves.append(await drawn.seconds_since(started))
            await pilot.pause(0.1)
        await pilot.press("slash")
        await pilot.pause(0.1)
        typing = []
        for i in range(PRESSES):
            key = "z" if i % 2 == 0 else "backspace"  # filter to nothing, then back to 2,000
            rows = 0 if key == "z" else 2006
            started = drawn.expect(lambda rows=rows: table.row_count == rows)
            await pilot.press(key)
            typing.append(await drawn.seconds_since(started))
            await pilot.pause(0.1)
    return moves, typing


class HugeSource(FakeSource):
    """FakeSource with a 10^8-element tensor at ref 5 (filled cheaply: values are not the point)."""

    def __init__(self) -> None:
        super().__init__(big=2)
        self.sent = 0
        self.arrays[5] = ("huge", "big", "output", np.ones((10_000, 10_000), dtype=np.float32))

    def slice(self, ref, text="", window=None):  # type: ignore[no-untyped-def]
        reply = super().slice(ref, text, window)
        self.sent += reply["data"].data.size
        return reply


async def grid_latency() -> tuple[float, float, int]:
    source = HugeSource()
    app = TensorDbgApp(LocalClient(source))
    async with app.run_test(size=SIZE) as pilot:
        drawn = Drawn(app)
        while app.main.rule_panel.current is None:  # the model, its tensors, then the rules
            await pilot.pause(0.01)
        app.main.show_tab("tensor")
        await pilot.pause(0.2)
        grid = app.query_one(TensorGrid)
        grid.focus()
        started = drawn.expect(lambda: not grid.fetching and grid.cell_text(0, 0))
        grid.show(5, "", (10_000, 10_000))
        first = await drawn.seconds_since(started)
        await pilot.pause(0.1)
        started = drawn.expect(lambda: not grid.fetching and grid.cell_text(9_999, 0))
        await pilot.press("end")  # to the last rows: blocks not fetched yet
        last = await drawn.seconds_since(started)
    return first, last, source.sent


def main() -> None:
    print(f"machine: {machine()}")
    starts = cold_start()
    print(
        f"(a) cold start to the first screen: median {statistics.median(starts):.2f} s "
        f"(min {min(starts):.2f}, max {max(starts):.2f}; target < 1 s)"
    )
    moves, typing = asyncio.run(key_latency())
    print(
        f"(b) 2,000 modules: cursor down {statistics.median(moves) * 1e3:.1f} ms, "
        f"search keystroke {statistics.median(typing) * 1e3:.1f} ms (medians of {PRESSES}; "
        f"p90 {np.percentile(moves, 90) * 1e3:.1f} / {np.percentile(typing, 90) * 1e3:.1f} ms)"
    )
    first, last, sent = asyncio.run(grid_latency())
    print(
        f"(c) 10^8-element grid: first screen {first * 1e3:.0f} ms, jump to the last rows "
        f"{last * 1e3:.0f} ms; {sent:,} values fetched, {1e8 / sent:,.0f}x fewer than it holds"
    )


if __name__ == "__main__":
    main()
