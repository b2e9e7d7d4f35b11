"""What a person new to tensordbg meets in the UI, driven as they would: keys typed fast, small
terminals, a training that goes NaN, thousands of hits. Each test is one thing the first trial got
wrong (issue 9)."""

from __future__ import annotations

import asyncio

from fake_source import FakeSource
from test_tui import SIZE, open_tensor, until
from textual import events
from textual.pilot import Pilot

from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.slice_input import SliceInput
from tensordbg.tui.components.tensor_grid import TensorGrid


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


_KEYS = {"[": "left_square_bracket", "]": "right_square_bracket", ":": "colon", ",": "comma"}


def test_a_slice_typed_fast_goes_to_the_slice_box_not_to_the_count() -> None:
    """``[3]`` typed fast on the grid: ``[`` opens the slice box and the rest is text in it, not
    a count prefix for ``s``."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        async with app.run_test(size=SIZE) as pilot:
            grid = await open_tensor(pilot, 3, "net.2.output", TensorGrid)
            await until(pilot, lambda: app.focused is grid)
            await type_at_once(pilot, "[3]")
            box = app.query_one(SliceInput)
            assert box.value == "[3]"
            assert app.focused is box
            assert "count" not in app.main.sub_title

    asyncio.run(flow())
