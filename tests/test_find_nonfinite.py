"""``f`` in the Tensor tab: the next NaN or Inf of the tensor shown, found where the tensor lives
(a live training reads it a chunk at a time; a replay reads its dump), and the grid moved to it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from dumps import write_dump
from fake_source import FakeSource
from paused import PausedTraining
from test_tui import SIZE, open_tensor, until

from tensordbg.dump import load
from tensordbg.sources.contract import REPLIES, SourceError, check, dispatch
from tensordbg.sources.live import LiveSource
from tensordbg.sources.replay import ReplaySource, next_nonfinite_array
from tensordbg.statistics.summaries import next_nonfinite
from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.tensor_grid import TensorGrid


def brute(values: np.ndarray, after: int) -> tuple[int, bool] | None:
    """What ``next_nonfinite`` must say, from every position at once."""
    bad = np.flatnonzero(~np.isfinite(values.reshape(-1)))
    later = bad[bad > after]
    if later.size:
        return int(later[0]), False
    return (int(bad[0]), True) if bad.size else None


@pytest.mark.parametrize("size", [1, 3, 7, 64, 1 << 22])
def test_the_next_nan_or_inf_is_found_across_chunks_and_wraps_round(size: int) -> None:
    rng = np.random.default_rng(size)
    values = rng.standard_normal((6, 5, 4)).astype(np.float32)
    values.reshape(-1)[[3, 40, 41, 97]] = [np.nan, np.inf, -np.inf, np.nan]
    tensor = torch.from_numpy(values)
    views = [(tensor, values), (tensor.transpose(0, 2), values.swapaxes(0, 2)),
             (tensor[1:, ::2], values[1:, ::2])]  # fmt: skip
    for view, expected in views:
        for after in (-5, -1, 0, 3, 39, 40, 41, 96, 97, 119, 10**9):
            assert next_nonfinite(view, after, size) == brute(expected, after), (after, size)
            assert next_nonfinite_array(expected, after) == brute(expected, after)


def test_only_values_that_can_be_nan_are_searched() -> None:
    assert next_nonfinite(torch.arange(10)) is None and next_nonfinite(torch.ones(0)) is None
    assert next_nonfinite(torch.ones(5)) is None
    half = torch.tensor([1.0, float("inf"), float("nan")])
    assert next_nonfinite(half.bfloat16()) == (1, False)
    assert next_nonfinite(half.to(torch.float8_e5m2), 1) == (2, False)
    assert next_nonfinite(torch.tensor([1 + 1j, complex("nan+1j")])) == (1, False)
    assert next_nonfinite_array(np.arange(4)) is None


def test_a_paused_training_finds_the_next_nan_of_a_slice_where_it_lies() -> None:
    with PausedTraining() as training:
        training.wait_paused()
        source = LiveSource(training.session)
        ref = source.info()["paused_at"]["ref"]
        tensor = training.session.record(ref).held().detach()
        reply = dispatch(source, "find", {"ref": ref})
        check(reply, REPLIES["find"])
        first = brute(tensor.numpy(), -1)
        assert first is not None and reply["flat"] == first[0]
        assert reply["at"] == [int(i) for i in np.unravel_index(first[0], tensor.shape)]
        assert not reply["wrapped"]
        row = source.find(ref, "[3]", after=tensor.shape[1] - 1)  # past the row's last: wraps
        assert (row["index"], row["shape"], row["flat"], row["wrapped"]) == (
            "[3]", [tensor.shape[1]], 0, True)  # fmt: skip
        batch = source.tensors()[0]  # the batch: finite
        assert source.find(batch["ref"])["at"] is None
        with pytest.raises(SourceError, match="does not fit"):
            source.find(ref, "[0, 1, 2]")
        with pytest.raises(SourceError, match="parameter 'after'"):
            dispatch(source, "find", {"ref": ref, "after": "0; rm -rf /"})


def test_a_replay_finds_the_nan_its_dump_holds(tmp_path: Path) -> None:
    source = ReplaySource(load(write_dump(tmp_path / "run", values=[3])))
    ref = next(t["ref"] for t in source.tensors() if t["name"] == "net.2.output")
    reply = dispatch(source, "find", {"ref": ref})
    check(reply, REPLIES["find"])
    assert (reply["at"], reply["flat"], reply["wrapped"]) == ([1, 2], 6, False)  # (dumps.py)
    assert source.find(ref, after=6)["wrapped"] and source.find(ref, "[2:]")["at"] is None


def test_f_in_the_grid_jumps_from_one_nan_to_the_next_and_marks_it() -> None:
    """Opened, a tensor with a few NaN or Inf among its values shows the first; ``f`` goes on to
    the next; one without any says so when ``f`` is pressed."""
    source = FakeSource()
    big = source.arrays[5][3]
    big[700, 930] = np.inf  # far down and to the right: the grid must move there
    app = TensorDbgApp(LocalClient(source))

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            grid = await open_tensor(pilot, 3, "net.2.output", TensorGrid)
            await until(pilot, lambda: grid.rows == 8)  # opened: its first NaN found at once
            await until(pilot, lambda: grid.border_subtitle == "f: NaN/Inf at [1, 2]")
            await pilot.press("f")
            await until(pilot, lambda: grid.border_subtitle == "f: NaN/Inf at [5, 0]")
            await pilot.press("f")  # the last: from the first again, and said so
            said = "f: NaN/Inf at [1, 2] (from the start again)"
            await until(pilot, lambda: grid.border_subtitle == said)
            # The found cell is drawn marked: its style differs from its neighbour's NaN-less
            # cell and from the same NaN unmarked.
            line = grid.render_line(2)  # row 1 (line 0 is the column labels)
            cells = [s for s in line if s.text.strip() == "NaN"]
            assert cells and cells[0].style.reverse

            inspector = app.main.tensor_inspector
            inspector.load("[4:]")  # a slice: its labels are the tensor's indices
            await until(pilot, lambda: grid.rows == 4 and grid.border_subtitle == "")
            await pilot.press("f")
            await until(pilot, lambda: grid.border_subtitle == "f: NaN/Inf at [5, 0]")

            grid = await open_tensor(pilot, 5, "big.output", TensorGrid)
            await until(pilot, lambda: grid.rows == 1000)  # opened: the grid goes to its Inf
            await until(pilot, lambda: grid.border_subtitle == "f: NaN/Inf at [700, 930]")
            # Its row comes on screen (the scroll may land a frame after the subtitle).
            await until(pilot, lambda: round(grid.scroll_y) <= 700
                        < round(grid.scroll_y) + grid.size.height - 1)  # fmt: skip
            top = round(grid.scroll_y)
            await until(pilot, lambda: grid.cell_text(700, 930) == "+Inf")
            assert any(s.text.strip() == "+Inf" for s in grid.render_line(700 - top + 1))

            grid = await open_tensor(pilot, 0, "input[0]", TensorGrid)
            await until(pilot, lambda: grid.rows == 8)
            await pilot.press("f")
            await until(pilot, lambda: grid.border_subtitle == "no NaN or Inf in this slice")
            app.exit()

    asyncio.run(flow())
