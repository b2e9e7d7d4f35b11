"""``tensordbg replay``: a dump served as a Source, and the same UI over it.

The dumps come from ``dumps.write_dump``: a three-layer network whose ``net.2.output`` holds a
NaN at step 3, the step the dump's one hit names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from dumps import weight_checked_twice, write_dump
from test_tui import SIZE, until
from test_tui_first_use import open_keys_panel
from textual.pilot import Pilot
from textual.widgets import Footer

from tensordbg.cli import main
from tensordbg.dump import load
from tensordbg.dump.writer import DumpWriter
from tensordbg.sources.contract import REPLAY, SourceError, dispatch, refusal
from tensordbg.sources.replay import ReplaySource
from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.connection_banner import ConnectionBanner
from tensordbg.tui.components.histogram_view import HistogramView
from tensordbg.tui.components.hit_detail import HitDetail
from tensordbg.tui.components.stats_compare import StatsCompare
from tensordbg.tui.components.tensor_grid import TensorGrid
from tensordbg.tui.messages import OpenTensor


@pytest.fixture
def dump(tmp_path: Path) -> Path:
    return write_dump(tmp_path / "run", values=[1, 2, 3])  # 0, 4, 5: statistics only


async def opened(app: TensorDbgApp, pilot: Pilot, source: ReplaySource, name: str) -> None:
    """The replay's tensor ``name`` opened, as Enter on it opens it."""
    await until(pilot, lambda: app.state == "replay")
    app.main.post_message(OpenTensor(ref_of(source, name), name))
    await until(pilot, lambda: app.query("#tensor-title"))


def ref_of(source: ReplaySource, name: str) -> int:
    return next(t["ref"] for t in source.tensors() if t["name"] == name)


def test_a_replay_opens_at_its_first_hit_and_says_it_is_a_recording(dump: Path) -> None:
    source = ReplaySource(load(dump))
    info = dispatch(source, "info", {})
    assert info["live"] is False and info["state"] == "replay"
    assert info["step"] == 3 and info["paused_at"]["tensor"] == "net.2.output"
    assert info["replay"] == {"path": str(dump), "recorded": "2026-11-24T10:30:00+00:00",
                              "complete": True, "steps": 6, "index": 3, "broken": "",
                              "lost": "", "stopped": False}  # fmt: skip
    assert info["run_id"] == "replay01" and info["script"] == "train.py"
    assert info["capabilities"] == sorted(REPLAY)
    with pytest.raises(SourceError) as refused:
        dispatch(source, "control", {"action": "continue"})
    assert str(refused.value) == refusal("control", REPLAY)


def test_moving_between_dumped_steps_changes_the_tensors_shown(dump: Path) -> None:
    source = ReplaySource(load(dump))
    at_3 = {t["name"]: t["summary"]["mean"] for t in source.tensors()}
    assert source.goto(move=1)["step"] == 4
    at_4 = {t["name"]: t["summary"]["mean"] for t in source.tensors()}
    assert at_3.keys() == at_4.keys() and at_3["input[0]"] != at_4["input[0]"]
    assert source.goto(move=10)["step"] == 5  # the last: it stays there
    assert source.goto(move=-99)["step"] == 0
    assert source.goto(step=2)["replay"]["index"] == 2
    with pytest.raises(SourceError, match="step 7 was not dumped; the nearest dumped step is 5"):
        source.goto(step=7)


def test_a_hit_opens_its_own_step_while_another_is_shown(dump: Path) -> None:
    source = ReplaySource(load(dump))
    hit = source.hits()[0]
    source.goto(step=1)
    stats = source.stats(hit["ref"])
    assert stats["step"] == 3 and stats["name"] == "net.2.output"
    assert stats["summary"]["nan"] == 1
    assert stats["previous"]["step"] == 2  # the same tensor at the dumped step before


def test_slices_read_the_dumped_values_and_statistics_only_steps_say_so(dump: Path) -> None:
    source = ReplaySource(load(dump))
    ref = ref_of(source, "net.2.output")
    expected = load(dump).tensor("net.2.output").value(3)
    part = source.slice(ref, "[1]", window=[[0, 1], [0, 4]])
    np.testing.assert_array_equal(part["data"].to_numpy()[0], expected[1])
    assert source.stats(ref, "[1]")["summary"]["nan"] == 1
    histogram = source.histogram(ref, bins=4)
    assert sum(histogram["counts"]) == 31 and histogram["nan"] == 1
    source.goto(step=4)
    bare = ref_of(source, "net.2.output")
    assert source.stats(bare)["summary"]["l2"] > 0  # from the index
    with pytest.raises(SourceError, match=r"only the statistics of net\.2\.output were dumped"):
        source.slice(bare, "[1]")


def test_bfloat16_values_come_back_bit_for_bit(tmp_path: Path) -> None:
    value = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7).astype(ml_dtypes.bfloat16)
    writer = DumpWriter(tmp_path / "bf", {"run_id": "bf16"})
    entry = {"name": "fc.output", "module": "fc", "phase": "forward", "kind": "output",
             "shape": [3, 4], "dtype": "bfloat16", "stats": {"l2": 1.0}}  # fmt: skip
    writer.write_step(0, 0, [entry], {"fc.output": value}, [])
    writer.close()
    source = ReplaySource(load(tmp_path / "bf"))
    part = source.slice(ref_of(source, "fc.output"))
    assert part["dtype"] == "bfloat16"
    back = part["data"].to_numpy()
    assert back.dtype == ml_dtypes.bfloat16 and back.tobytes() == value.tobytes()


def test_a_backward_hit_named_after_the_call_that_took_the_value_shows_that_call(
    tmp_path: Path,
) -> None:
    """A dump written while a gradient's provenance was its producer's (fc1's output gradient)
    though the hit names the call whose backward made it (abs.grad_input[0]): Provenance shows
    abs, the call the hit names, fed back to fc1's backward; the tensor's own name without it."""
    fc1, site = (
        {"module": "fc1", "type": "Linear", "call": 0},
        {"module": "abs", "type": "Abs", "call": 0},
    )
    made = {"name": "fc1.grad_output", "kind": "grad_output", "producer": fc1,
            "inputs": [{"name": "input[0]", "module": "", "shape": [4, 8], "dtype": "float32"}],
            "consumers": [site], "source": None, "stack": []}  # fmt: skip
    entry = {"name": "fc1.grad_output", "module": "fc1", "phase": "backward", "shape": [4, 16],
             "kind": "grad_output", "dtype": "float32", "stats": {"nan": 16},
             "provenance": made}  # fmt: skip
    hit = {"rule": "NaN", "tensor": "abs.grad_input[0]", "module": "abs", "kind": "grad_input",
           "step": 0, "phase": "backward", "origin": True, "stored_as": "fc1.grad_output",
           "value": 16.0, "threshold": 0.0, "call": 0,
           "message": "abs.grad_input[0] holds 16 NaN among 64 values."}  # fmt: skip
    writer = DumpWriter(tmp_path / "run", {"run_id": "abs"})
    value = np.full((4, 16), np.nan, dtype=np.float32)
    writer.write_step(0, 0, [entry], {"fc1.grad_output": value}, [hit])
    writer.close()
    source = ReplaySource(load(tmp_path / "run"))
    shown = source.hits()[0]
    prov = source.provenance(shown["ref"], shown["module"], shown["call"])
    assert (prov["name"], prov["kind"], prov["producer"]) == (
        "abs.grad_input[0]",
        "grad_input",
        site,
    )
    assert prov["consumers"] == [fc1] and prov["inputs"] == []  # abs's inputs were not dumped
    assert source.provenance(shown["ref"])["producer"] == fc1


def test_a_broken_step_is_shown_as_broken_and_the_others_stay_readable(dump: Path) -> None:
    """A values file cut short: the step says so, its tensors keep the statistics of its
    index, and only their values are unavailable, with the same sentence."""
    step_file = dump / "rank-0" / "step-00000002.safetensors"
    step_file.write_bytes(step_file.read_bytes()[:100])  # cut short
    source = ReplaySource(load(dump))
    info = source.goto(step=2)
    assert "truncated" in info["replay"]["broken"] and str(step_file) in info["replay"]["broken"]
    assert len(source.tensors()) == 9 and source.modules()[2]["stats"]["output"]["l2"] > 0
    with pytest.raises(SourceError, match="truncated"):
        source.slice(ref_of(source, "net.2.output"))
    assert source.goto(move=1)["replay"]["broken"] == ""
    assert len(source.tensors()) == 9


def test_a_step_whose_values_changed_is_shown_broken_with_the_statistics_of_its_index(
    dump: Path,
) -> None:
    """One byte of step 3's values flipped (the step of the NaN, where the replay opens), its
    index whole: the banner gave no notice, and the tensor showed no statistics at all. The step
    is said to be broken (its file is read whole when it is shown), its tensors show their
    dumped statistics, and only their values say that they fail their checksum. Step 1's file,
    changed too, is read only when step 1 is shown."""
    for step in (1, 3):
        step_file = dump / "rank-0" / f"step-{step:08d}.safetensors"
        data = bytearray(step_file.read_bytes())
        data[-3] ^= 0xFF  # net.2.weight, the step's last value
        step_file.write_bytes(bytes(data))
    loaded = load(dump)
    source = ReplaySource(loaded)
    reason = f"{step_file} fails its checksum at net.2.weight: its bytes changed after writing"
    assert source.info()["replay"]["broken"] == reason
    assert (1, 0) not in loaded.broken  # not read: a replay does not read every file whole
    hit = source.hits()[0]
    stats = source.stats(hit["ref"])
    assert stats["summary"]["nan"] == 1 and "NaN×1!" in stats["line"] and stats["index"] == ""
    weight = source.stats(ref_of(source, "net.2.weight"))  # the very tensor whose bytes changed
    assert weight["summary"]["l2"] == loaded.indexed(3)[-1].stats["l2"] > 0
    for ask in (lambda: source.histogram(hit["ref"]), lambda: source.stats(hit["ref"], "[1]")):
        with pytest.raises(SourceError, match="fails its checksum"):
            ask()
    assert "fails its checksum" in source.goto(step=1)["replay"]["broken"]
    assert source.goto(step=2)["replay"]["broken"] == ""


def test_replay_of_what_is_not_a_dump_is_one_sentence_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "Traceback" not in err


def test_a_dump_without_steps_says_why_instead_of_a_replay_of_step_1_of_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run with no hit and no dump_every writes a dump with no step: the replay says so and
    why, in one sentence, rather than opening a UI at "step 0 (1 of 0 dumped)"."""
    DumpWriter(tmp_path / "clean", {"run_id": "clean", "dump_every": None}).close()
    assert main(["replay", str(tmp_path / "clean")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no step" in err and "dump_every was not set" in err
    DumpWriter(tmp_path / "running", {"run_id": "running"})  # not closed: still running
    with pytest.raises(SourceError, match="holds no step yet: the run did not finish"):
        ReplaySource(load(tmp_path / "running"))


# --- the UI ------------------------------------------------------------------------------


def test_every_key_the_keys_panel_lists_in_a_replay_says_what_it_does(dump: Path) -> None:
    """c, s, k, i and P do not drive a recording: they say why. The keys panel (?) listed them
    with no description ("c s k", "P", "i" and nothing beside them)."""
    rows: list[str] = []

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(ReplaySource(load(dump))))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "replay")
            rows.extend(await open_keys_panel(app, pilot))

    asyncio.run(flow())
    assert "n  Next dumped step" in rows
    assert [row for row in rows if not row.split("  ", 1)[1].strip()] == []
    assert "c s k  Continue, step, skip (not here: says why)" in rows


def test_a_recording_without_hits_is_not_said_to_have_none_yet(tmp_path: Path) -> None:
    """The Hits tab of a clean recording said "No hits yet.", as of a training that may still
    hit: a recording is over."""
    said: list[str] = []

    async def flow() -> None:
        clean = write_dump(tmp_path / "clean", nan_at=None)
        app = TensorDbgApp(LocalClient(ReplaySource(load(clean))))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "replay")
            detail = app.query_one(HitDetail)
            await until(pilot, lambda: "hits" in str(detail.render()))
            said.append(str(detail.render()))

    asyncio.run(flow())
    assert said == ["This recorded run holds no hits."]


def test_the_ui_says_replay_and_moves_between_steps_with_n_and_p(dump: Path) -> None:
    source = ReplaySource(load(dump))

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            banner = app.query_one(ConnectionBanner)
            await until(pilot, lambda: app.state == "replay")
            text = str(banner.content)
            assert "Replay of run replay01 (train.py) recorded 2026-11-24T10:30:00+00:00" in text
            assert "step 3 (4 of 6 dumped)" in text
            shown = app.active_bindings.items()
            footer = {
                k: b.binding.description for k, b in shown if b.binding.show and k in "npcskq"
            }
            # q quits: a recording has no training to detach from
            assert footer == {"n": "Next dumped step", "p": "Previous dumped step", "q": "Quit"}
            await pilot.press("n")
            await until(pilot, lambda: "step 4 (5 of 6" in str(banner.content))
            assert "step 4" in app.screen.title  # the header: the state first, then the step
            await pilot.press("p", "p")
            await until(pilot, lambda: source.step == 2 and "step 2 (3 of 6" in str(banner.content))
            tensors = app.main.module_browser
            await until(pilot, lambda: tensors.table.row_count == 5)
            # The rows are the shown step's: not marked "step 2:" as if of an earlier step
            # (the hit's step, 3, was taken for the step on show).
            await until(pilot, lambda: any("μ=" in c for row in tensors.table._cells for c in row))
            assert not any(c.startswith("step ") for row in tensors.table._cells for c in row)
            app.main.show_tab("modules")  # a module's tensors are the dumped step's, all phases
            await until(pilot, lambda: "in this dumped step" in str(tensors.tensors_title.content))
            await pilot.press("c")  # a recording cannot be driven: it says so
            await until(pilot, lambda: any("recorded run" in str(n.message)
                                           for n in app._notifications))  # fmt: skip
            await pilot.press("n", "n", "n", "n")  # at the last step n cannot move: it says so
            await until(pilot, lambda: any("Step 5 is the last dumped step" in str(n.message)
                                           for n in app._notifications))  # fmt: skip
            assert app.query(Footer)
            # Step 5 holds statistics only: its tensors' values were not dumped (a live
            # session's are "not retained").
            table = tensors.tensor_table
            table.show(source.tensors())
            lines = [str(table.get_row_at(i)[3]) for i in range(table.row_count)]
            assert lines and all(line.endswith("(not dumped)") for line in lines), lines

    asyncio.run(flow())


def test_a_tensor_left_open_on_n_says_which_steps_values_it_shows(dump: Path) -> None:
    """n moved the banner to step 4 while the grid kept step 3's values with nothing saying so
    (found trying the replay as a new user); a second n said "the step before's" of values two
    dumped steps back."""
    from textual.widgets import Static

    source = ReplaySource(load(dump))

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await opened(app, pilot, source, "net.2.output")
            title = app.query_one("#tensor-title", Static)
            await until(pilot, lambda: str(title.content) == "net.2.output")
            await pilot.press("n")
            said = "net.2.output  (step 3's values; the replay is at step 4: open it again)"
            await until(pilot, lambda: str(title.content) == said)
            await pilot.press("n")
            said = "net.2.output  (step 3's values; the replay is at step 5: open it again)"
            await until(pilot, lambda: str(title.content) == said)

    asyncio.run(flow())


def test_a_hit_of_the_replay_opens_its_dumped_values(dump: Path) -> None:
    async def flow() -> None:
        app = TensorDbgApp(LocalClient(ReplaySource(load(dump))))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "replay")
            await until(pilot, lambda: app.main.hit_table.row_count == 1)
            await pilot.press("enter")  # the NaN hit, under the cursor
            grid = app.query_one(TensorGrid)
            await until(pilot, lambda: grid.rows == 8 and grid.cell_text(1, 2))
            assert "nan" in grid.cell_text(1, 2).lower()

    asyncio.run(flow())


def test_the_ui_says_a_step_with_changed_values_is_broken_and_shows_its_statistics(
    dump: Path,
) -> None:
    """The hit's step with one byte of its values flipped: the banner says the step is broken
    and why, the hit's tensor opens with its dumped statistics, and the histogram says why it
    cannot be drawn."""
    step_file = dump / "rank-0" / "step-00000003.safetensors"
    data = bytearray(step_file.read_bytes())
    data[-3] ^= 0xFF
    step_file.write_bytes(bytes(data))

    async def check(app: TensorDbgApp, pilot: Pilot, banner: str) -> None:
        assert "fails its checksum at net.2.weight" in banner
        await until(pilot, lambda: app.main.hit_table.row_count == 1)
        await pilot.press("enter")
        summary = app.query_one("#tensor-summary")
        await until(pilot, lambda: "NaN×1!" in str(summary.render()))
        histogram = app.query_one(HistogramView)
        await until(pilot, lambda: "fails its checksum" in str(histogram.render()))

    in_replay_ui(dump, "this step is broken", check)


def test_the_ui_says_when_the_dumps_index_is_cut_short(dump: Path) -> None:
    """The index's last line gone (a copy cut short): ``tensordbg check`` said the later steps
    are missing, the replay listed the others as if they were all. Its banner says so now, on
    every step it shows."""
    index = dump / "rank-0" / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    index.write_bytes(b"".join(lines[:-1]))
    source = ReplaySource(load(dump))
    assert all("cut short" in source.goto(step=step)["replay"]["lost"] for step in source.steps)

    async def check(app: TensorDbgApp, pilot: Pilot, banner: str) -> None:
        assert "the steps after its last line are missing" in banner
        assert "n / p: next / previous dumped step" in banner  # still said

    in_replay_ui(dump, "cut short", check)


def in_replay_ui(dump: Path, shown: str, check: Callable[..., Awaitable[None]]) -> None:
    """The UI over a replay of ``dump``, once its banner says ``shown``: ``check(app, pilot,
    banner text)``."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(ReplaySource(load(dump))))
        async with app.run_test(size=SIZE) as pilot:
            banner = app.query_one(ConnectionBanner)
            await until(pilot, lambda: shown in str(banner.content))
            await check(app, pilot, str(banner.content))

    asyncio.run(flow())


def test_the_run_tab_of_a_replay_shows_the_step_looked_at_and_says_what_was_not_dumped(
    tmp_path: Path,
) -> None:
    """A replay's Run tab: the loss of the step shown (not the last step's, marked with its
    step), steps missing from the dump are "not dumped" (not "not received", as from a live
    training), and no memory is retained by a recording."""
    from tensordbg.tui.components.run_status import RunStatus

    source = ReplaySource(load(write_dump(tmp_path / "run", steps=[1, 3, 5], nan_at=None)))

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "replay" and source.step == 1)
            app.main.show_tab("run")
            run = app.query_one(RunStatus)
            await until(pilot, lambda: run._history["step"] == [1, 3, 5])
            loss = run._history["loss"][0]

            def shown() -> str:
                return str(run.query_one("#run-numbers").render()) + str(
                    run.query_one("#loss-label").render()
                )

            await until(pilot, lambda: "steps 2, 4 not dumped" in shown())
            numbers = run._numbers().columns[1].cells
            assert [str(c) for c in numbers] == ["loss", f"{loss:.4g}"]  # step 1's, not step 5's
            # Its hit count is the recording's, not the step's: the label says so.
            assert str(next(iter(run._numbers().columns[4].cells))) == "hits in the run"
            assert "retaining" not in str(run.query_one("#run-session").render())

    asyncio.run(flow())


def test_the_run_tab_of_a_replay_says_where_the_loss_was_not_finite(tmp_path: Path) -> None:
    """A training whose loss went NaN: the replay's Run tab says at which dumped steps, as the
    live one does (the curve stopped there without a word)."""
    import torch
    from torch import nn

    import tensordbg
    from tensordbg.tui.components.run_status import RunStatus

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tensordbg.attach(model, opt, on_hit="dump", server=False, dump_dir=tmp_path / "run",
                          dump_every=1, summary_at_exit=False) as session:  # fmt: skip
        for step in range(5):
            x = torch.randn(16, 4)
            if step >= 3:
                x[0, 0] = float("nan")
            loss = model(x).pow(2).mean()
            session.observe("loss", loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    source = ReplaySource(load(tmp_path / "run"))
    history = source.history()
    assert history["step"] == [0, 1, 2, 3, 4]
    assert [v != v for v in history["loss"]] == [False, False, False, True, True]  # NaN kept

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "replay")
            app.main.show_tab("run")
            run = app.query_one(RunStatus)
            label = run.query_one("#loss-label")
            await until(pilot, lambda: "2 non-finite at steps 3–4" in str(label.render()))

    asyncio.run(flow())


def loss_and_gradient_dumps(tmp_path: Path) -> tuple[Path, Path]:
    """Two dumps of real sessions: ``run``, whose loss the script made -Inf at step 2 (a log of
    0, outside the model); ``grad``, whose one step hit ExplodingGradient everywhere, so that
    the gradients of the Tanh's output, which its bias vouched for, were never held."""
    import torch
    from torch import nn

    import tensordbg
    from tensordbg.rules import ExplodingGradient

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tensordbg.attach(model, opt, on_hit="dump", server=False, dump_dir=tmp_path / "run",
                          summary_at_exit=False) as session:  # fmt: skip
        for step in range(3):
            out = model(torch.randn(16, 4))
            loss = torch.log(out.abs() * (0.0 if step == 2 else 1.0)).mean()
            session.observe("loss", loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tensordbg.attach(
        model,
        opt,
        on_hit="dump",
        server=False,
        dump_dir=tmp_path / "grad",
        rules=[ExplodingGradient(max_norm=1e-9)],
        summary_at_exit=False,
    ):
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    return tmp_path / "run", tmp_path / "grad"


def test_a_loss_made_outside_the_model_is_not_said_to_come_from_it(tmp_path: Path) -> None:
    """The script's loss turned Inf (a log of 0): the dump recorded that no module made it,
    and the replay's Provenance said the model did. A gradient the step let go says why its
    values are not there, not that dump_tensors would have kept them (it chooses only the
    values of periodic steps)."""
    run, grad = loss_and_gradient_dumps(tmp_path)
    source = ReplaySource(load(run))
    loss_ref = next(h["ref"] for h in source.hits() if h["tensor"] == "loss")
    assert source.provenance(loss_ref)["producer"] is None
    source = ReplaySource(load(grad))
    let_go = [t for t in source.tensors() if not t["retained"]]
    assert let_go[0]["name"].endswith("grad_output")
    with pytest.raises(SourceError) as why:
        source.slice(let_go[0]["ref"])
    assert "dump_tensors" not in str(why.value)
    assert "a step with a hit keeps the values the training still held" in str(why.value)


def test_the_tensor_tab_says_why_it_has_no_values_and_no_moments(tmp_path: Path) -> None:
    """A tensor whose values were not dumped filled the grid with "?" (the reason was only in
    the Log tab); a loss that is all -Inf showed NaN for its mean, min and max, which are over
    the finite values and so are none."""
    run, grad = loss_and_gradient_dumps(tmp_path)

    async def flow(path: Path, open_it: Callable[[ReplaySource], tuple[int, str]],
                   check: Callable[[TensorDbgApp], bool]) -> None:  # fmt: skip
        source = ReplaySource(load(path))
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "replay")
            app.main.post_message(OpenTensor(*open_it(source)))
            await until(pilot, lambda: check(app))

    def let_go(source: ReplaySource) -> tuple[int, str]:
        tensor = next(t for t in source.tensors() if not t["retained"])
        return tensor["ref"], tensor["name"]

    def grid_says_why(app: TensorDbgApp) -> bool:
        if not app.query(TensorGrid):
            return False
        grid = app.query_one(TensorGrid)
        lines = [grid.render_line(y).text for y in range(3)]
        return "No values to show: only the statistics of" in lines[0] and "?" not in "".join(lines)

    asyncio.run(flow(grad, let_go, grid_says_why))

    def loss(source: ReplaySource) -> tuple[int, str]:
        return next(h["ref"] for h in source.hits() if h["tensor"] == "loss"), "loss"

    def no_moments(app: TensorDbgApp) -> bool:
        if not app.query(StatsCompare):
            return False
        table = app.query_one(StatsCompare).content
        if not hasattr(table, "columns"):
            return False
        now = [str(c) for c in table.columns[1]._cells]
        return now[:6] == ["–"] * 6 and now[8] == "1" and "no finite value" in table.title

    asyncio.run(flow(run, loss, no_moments))


def test_the_rules_keys_of_a_replay_say_a_recorded_run_cannot_change_its_rules(
    dump: Path,
) -> None:
    """Space, e, a and r on the Rules tab of a replay did nothing, without a word (c, s and k
    say that a recorded run cannot be driven)."""

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(ReplaySource(load(dump))))
        app.NOTIFICATION_TIMEOUT = 60  # a notice must not expire before a loaded CI reads it
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state == "replay")
            app.main.show_tab("rules")
            await until(pilot, lambda: app.main.rule_panel.table.row_count > 0)
            table = app.main.rule_panel.table
            await pilot.pause()  # the tab's own focus move lands first
            for key, said in (("space", "change a rule"), ("r", "judge a step again")):
                table.focus()
                await until(pilot, lambda: app.focused is table)
                app.clear_notifications()
                await pilot.press(key)
                await until(pilot, lambda said=said: any(
                    "recorded run" in str(n.message) and said in str(n.message)
                    for n in app._notifications))  # fmt: skip
            assert "Toggle" not in [b.binding.description for b in app.active_bindings.values()
                                    if b.binding.show]  # fmt: skip

    asyncio.run(flow())


def test_a_hit_on_a_parameter_opens_the_value_it_was_about_not_the_one_after_the_update(
    tmp_path: Path,
) -> None:
    """fc.weight checked in the forward (one +Inf: the hit) and after the optimizer step (all
    NaN: the value dumped). Enter on the hit showed the weight after the step, NaN x 6, as if
    that were what the hit was about."""
    weight_checked_twice(tmp_path / "run")
    source = ReplaySource(load(tmp_path / "run"))
    ref = source.paused_at["ref"]
    stats = source.stats(ref)
    assert stats["summary"]["posinf"] == 1.0 and "nan" in stats["summary"]
    assert not stats["summary"]["nan"]  # the hit's own statistics, not the NaN after the step
    assert stats["line"].endswith("(at the hit, forward; its value there was not dumped: the "
                                  "values below are fc.weight after the optimizer step of step "
                                  "6)")  # fmt: skip
    sliced = source.stats(ref, "[0]")
    assert sliced["line"].endswith("(the value at the hit (forward) was not dumped; shown: "
                                   "fc.weight after the optimizer step of step 6)")  # fmt: skip
    assert source.histogram(ref)["nan"] == 6  # the values shown are those named
    listed = source.stats(ref_of(source, "fc.weight"))  # the Tensors tab: the latest, as before
    assert listed["summary"]["nan"] == 6 and "at the hit" not in listed["line"]


def test_n_and_p_pressed_faster_than_a_step_loads_move_one_step_each(dump: Path) -> None:
    """n n n in a burst moved one step: each press cancelled the request of the one before."""

    async def check(app: TensorDbgApp, pilot: Pilot, banner: str) -> None:
        source = app.remote.client.source
        shown = app.query_one(ConnectionBanner)
        for _ in range(3):  # in one burst, before any reply
            app.action_replay_step(-1)
        await until(pilot, lambda: "step 0 (1 of 6" in str(shown.content))
        assert source.step == 0
        app.action_replay_step(1)
        app.action_replay_step(1)
        await until(pilot, lambda: "step 2 (3 of 6" in str(shown.content))

    in_replay_ui(dump, "step 3 (4 of 6", check)


def test_an_index_line_lost_from_its_middle_is_not_said_to_cut_its_end(dump: Path) -> None:
    """Line 4 of a closed run's index deleted (a copy): "index.jsonl is cut short ...: the
    steps after its last line are missing", and the banner said "the run stopped before its
    dump was closed", though the run closed it and the last step is there."""
    index = dump / "rank-0" / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if b'"step":2,' in line)
    index.write_bytes(b"".join(lines[:at] + lines[at + 1 :]))
    opened = load(dump)
    lost = opened.broken[-1, 0]
    assert "lacks lines before its last" in lost and "after its last line" not in lost
    assert 5 in opened.steps() and 2 not in opened.steps()
    info = ReplaySource(opened).info()
    assert info["replay"]["stopped"] is False and info["replay"]["complete"] is False

    async def check(app: TensorDbgApp, pilot: Pilot, banner: str) -> None:
        assert "the run stopped before its dump was closed" not in banner

    in_replay_ui(dump, "lacks lines", check)


def test_an_input_made_by_the_models_own_code_is_named_as_live_names_it(tmp_path: Path) -> None:
    """The Provenance tab of a replay listed an input that the model's own code made (not
    dumped: no ref) as "✓ finite  norm.input[0]  ← not judged", where live it reads "← (model)'s
    own code" (found trying the product as a new user): the replay dropped ``made_by``."""
    inputs = [{"name": "head.input[0]", "module": "", "shape": [2], "dtype": "float32",
               "line": "tensor[2] float32", "nonfinite": False, "made_by": "code"}]  # fmt: skip
    entry = {"name": "head.output", "module": "head", "phase": "forward", "kind": "output",
             "shape": [2], "dtype": "float32", "stats": {"finite": 1.0},
             "provenance": {"producer": {"module": "head", "type": "Linear", "call": 0},
                            "inputs": inputs}}  # fmt: skip
    writer = DumpWriter(tmp_path / "run", {"run_id": "r1"})
    writer.write_step(0, 0, [entry], {"head.output": np.zeros(2, np.float32)}, [])
    writer.close()
    source = ReplaySource(load(tmp_path / "run"))
    [listed] = source.provenance(ref_of(source, "head.output"))["inputs"]
    assert (listed["ref"], listed["made_by"]) == (None, "code")

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await opened(app, pilot, source, "head.output")
            app.main.show_tab("provenance")
            tree = app.query_one("Tree")
            await until(pilot, lambda: len(tree.root.children) > 1
                        and tree.root.children[1].children)  # fmt: skip
            label = str(tree.root.children[1].children[0].label)
            assert "head.input[0]  ← (model)'s own code" in label and "not judged" not in label

    asyncio.run(flow())
