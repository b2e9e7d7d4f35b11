"""``tensordbg replay`` shows what the dump holds, as the live session showed it.

The dump is a tester's run: an MLP 8→16→16→1 trained with SGD, ``fc2.weight[3, 5]`` set to
+Inf by hand before step 6's forward, ``log`` of a negative in step 9's forward, the weights
restored at steps 7 and 10; recorded with ``dump_every=3`` and ``dump_tensors="*.weight"``, so
steps 0, 3, 6 and 9 are dumped and the replay opens on step 6's Overflow of ``fc2.weight``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from test_tui import text_of, until
from textual.pilot import Pilot
from textual.widgets import Static, Tree

from tensordbg.dump import load
from tensordbg.sources.replay import ReplaySource
from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.histogram_view import HistogramView, draw

SMALL = (80, 24)


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from torch import nn

    import tensordbg

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act = nn.Linear(8, 16), nn.ReLU()
            self.fc2, self.head = nn.Linear(16, 16), nn.Linear(16, 1)
            self.bad = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc2(self.act(self.fc1(x)))
            if self.bad:  # step 9: log of a negative in the model's own forward
                h = h.clone()
                h[0] = torch.log(h[0] - 100.0)
            return self.head(h)

    path = tmp_path_factory.mktemp("trial") / "D"
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=path,
                          dump_every=3, dump_tensors="*.weight",
                          summary_at_exit=False):  # fmt: skip
        for step in range(10):
            if step == 6:  # a weight set to +Inf by hand, before the step's forward
                saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
                with torch.no_grad():
                    model.fc2.weight[3, 5] = float("inf")
            if step == 7:
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            model.bad = step == 9
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return path


def hit_of(source: ReplaySource, step: int, tensor: str, phase: str) -> dict:
    return next(h for h in source.hits()
                if (h["step"], h["tensor"], h["phase"]) == (step, tensor, phase))  # fmt: skip


def in_ui(dump: Path, check: Callable[[TensorDbgApp, Pilot], Awaitable[None]],
          size: tuple[int, int] = (120, 40)) -> None:  # fmt: skip
    async def flow() -> None:
        app = TensorDbgApp(LocalClient(ReplaySource(load(dump))))
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.state == "replay")
            await until(pilot, lambda: app.main.hit_table.row_count > 0)
            await check(app, pilot)

    asyncio.run(flow())


# --- 1. a parameter's forward hit has a parameter's provenance --------------------------------


def test_a_weights_forward_hit_is_a_parameter_no_call_made_not_its_modules_grad_input(
    dump: Path,
) -> None:
    """Step 6's Overflow of fc2.weight in the forward: the dump says a parameter, made by no
    call, consumed by fc2. The replay said ``fc2.weight (grad_input)`` produced by fc2 "in
    backward", reading the module the hit names as the call that took a gradient."""
    source = ReplaySource(load(dump))
    hit = source.paused_at
    assert (hit["step"], hit["tensor"], hit["phase"]) == (6, "fc2.weight", "forward")
    fc2 = {"module": "fc2", "type": "Linear", "call": 0}
    forward_params = [h for h in source.hits() if h["kind"] == "param" and h["phase"] == "forward"]
    assert forward_params
    for hit in forward_params:  # each as live shows it: provenance.provenance's "param" branch
        prov = source.provenance(hit["ref"], hit["module"], hit["call"])
        assert (prov["name"], prov["kind"], prov["producer"]) == (hit["tensor"], "param", None)
        assert prov["consumers"] == [fc2] and prov["inputs"] == []

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("enter", "f5")
        tree = app.query_one(Tree)
        await until(pilot, lambda: "fc2.weight" in str(tree.root.label))
        assert str(tree.root.label) == "fc2.weight  (param, step 6)"
        leaves = [str(node.label) for node in tree.root.children]
        assert leaves[0].startswith("a parameter: no call of this step made its value")
        assert not any("produced by" in leaf for leaf in leaves)

    in_ui(dump, check)


# --- 2. a tensor opened from a hit is its hit's step's, and says so ---------------------------


def test_a_hit_of_another_step_opens_as_that_steps_and_its_title_says_so(dump: Path) -> None:
    """Banner on step 6, Enter on step 9's head.bias hit: the title was just ``head.bias``, and
    n then said "step 6's" of values that are step 9's."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        title = app.query_one("#tensor-title", Static)
        await pilot.press("f2", "slash", *"optimizer", "enter")
        table = app.main.hit_table
        await until(pilot, lambda: table.row_count < 20)  # the hits after the update, mostly
        for _ in range(table.row_count):
            if (table.current["step"], table.current["tensor"]) == (9, "head.bias"):
                break
            await pilot.press("down")
        await pilot.press("enter")
        await until(pilot, lambda: str(title.content) == "head.bias  (step 9's)")
        assert app.main.tensor_inspector.step == 9
        await pilot.press("n")  # to step 9: the tensor is this step's, nothing more to say
        await until(pilot, lambda: str(title.content) == "head.bias")

    in_ui(dump, check)


def test_a_later_hit_opened_on_a_small_screen_keeps_its_step_when_n_moves(dump: Path) -> None:
    """At 80x24: p (to step 3), /log, Enter on step 9's ``output``, n (to step 6): it said
    "(step 6's: reopen at step 6)"."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        title = app.query_one("#tensor-title", Static)
        await pilot.press("p")
        await until(pilot, lambda: "step 3" in app.screen.title)
        await pilot.press("f2", "slash", *"log", "enter")
        table = app.main.hit_table
        await until(pilot, lambda: table.row_count < 20)  # step 9's log: its NaN downstream
        for _ in range(table.row_count):
            if (table.current["step"], table.current["tensor"]) == (9, "output"):
                break
            await pilot.press("down")
        await pilot.press("enter")
        await until(pilot, lambda: str(title.content) == "output  (step 9's)")
        await pilot.press("n")
        said = "output  (step 9's values; the replay is at step 6: open it again)"
        await until(pilot, lambda: str(title.content) == said)

    in_ui(dump, check, SMALL)


# --- 3. the previous step's column: like with like, from the dumped values ---------------------


def test_the_previous_column_is_computed_from_dumped_values_and_names_each_phase(
    dump: Path,
) -> None:
    """Step 3 dumped fc2.weight's values after its update (dump_tensors="*.weight"): its column
    said "recorded only L2 norm", and a slice had none; step 6's column (the hit, in the
    forward) and step 3's (after the update) did not say they are other phases."""
    source = ReplaySource(load(dump))
    ref = source.paused_at["ref"]
    step3 = load(dump).tensor("fc2.weight", phase="optimizer").value(3)
    stats = source.stats(ref)
    before = stats["previous"]
    assert before["step"] == 3
    assert before["summary"]["max"] == pytest.approx(float(step3.max()))
    assert before["summary"]["mean"] == pytest.approx(float(step3.mean()), abs=1e-6)
    assert stats["previous_why"] == (
        "this step's column is fc2.weight in the forward pass, step 3's after the optimizer step "
        "(step 3 did not dump it in the forward pass)"
    )
    # The values shown are the hit's own (the step that hit keeps its value in the forward
    # beside the one after the update): step 3's column is still after the update, and says so.
    sliced = source.stats(ref, "[3]")
    assert "+Inf×1" in sliced["line"] and "not dumped" not in sliced["line"]
    assert sliced["previous"]["summary"]["min"] == pytest.approx(float(step3[3].min()))
    assert sliced["previous_why"] == stats["previous_why"]
    # A tensor checked in the same phase at both steps compares that phase, no note.
    grad = next(t for t in source.tensors() if t["name"] == "fc2.weight.grad")
    assert "previous_why" not in source.stats(grad["ref"])

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("enter")
        compare = app.query_one("#stats-compare", Static)
        await until(pilot, lambda: compare.content and compare.content.title)
        table = compare.content
        assert "step 3's after the optimizer step" in str(table.title)
        assert "recorded only" not in str(table.title)
        assert "–" not in list(table.columns[2].cells)  # every row of step 3 is known
        # The histogram is of the value at the hit, its +Inf (not the NaN after the update).
        histogram = app.query_one(HistogramView)
        await until(pilot, lambda: "+Inf 1" in text_of(histogram))
        assert "NaN 0" in text_of(histogram) and not text_of(histogram).startswith("Of ")

    in_ui(dump, check)


def test_a_histogram_of_one_nan_says_the_one_value_is_nan() -> None:
    hist = {"counts": [0] * 8, "edges": [0.0] * 9, "nan": 1, "posinf": 0, "neginf": 0,
            "min": 0.0, "max": 0.0}  # fmt: skip
    assert str(draw(hist)) == "The one value is NaN: no finite value to draw."
    assert str(draw({**hist, "nan": 3})) == "All 3 values are NaN: no finite value to draw."
