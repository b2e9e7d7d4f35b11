"""Dumps written by an attached training: hits read back with the fields they had live, the
step that hit holds its values, periodic steps, on_hit="raise" writes before raising, a failed
write leaves the training running and the dump marked incomplete."""

from __future__ import annotations

import inspect
import math
import re
import sys
import threading
import time

import numpy as np
import pytest
import torch
import zygote
from torch import nn

import tensordbg
from tensordbg.dump import DumpError
from tensordbg.dump import writer as dump_writer


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(model, opt, steps: int, bad_step: int = -1, on_step=None) -> None:
    torch.manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 4)
        if step == bad_step:
            x[3, 1] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(step)


def _train_dumped(model: nn.Module, tmp_path, steps: int, **dump) -> tensordbg.Session:
    """Train ``model`` with SGD for ``steps`` steps, attached with a dump in ``tmp_path``;
    the session, detached."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                          summary_at_exit=False, **dump) as session:  # fmt: skip
        _train(model, opt, steps)
    return session


_LINES, _FIRST = inspect.getsourcelines(_train)
_MODEL_CALL_LINE = _FIRST + next(i for i, line in enumerate(_LINES) if "model(x)" in line)


@pytest.mark.parametrize("sync", ["eager", "batched", "deferred"])
def test_a_planted_nan_is_dumped_with_its_hits_and_values(tmp_path, sync):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, on_hit="dump", server=False, sync=sync,
                               dump_dir=tmp_path, summary_at_exit=False)  # fmt: skip
    _train(model, opt, steps=5, bad_step=3)
    live = [h.as_dict() for h in session.hits]
    session.detach()
    hit_steps = sorted({h["step"] for h in live})
    assert hit_steps[0] == 3  # and later steps, once the NaN reached the weights

    dump = tensordbg.load(tmp_path)
    assert dump.meta["complete"] and dump.meta["torch_version"] == torch.__version__
    assert dump.meta["sync"] == sync and any(r["name"] == "NaN" for r in dump.meta["rules"])
    assert dump.steps() == hit_steps  # hits only: no dump_every
    assert [h.as_dict() for h in dump.hits] == live
    entries = dump.tensors(3)
    assert [e.order for e in entries] == sorted(e.order for e in entries)
    assert {"forward", "backward"} <= {e.phase for e in entries}
    origin = next(h for h in dump.hits if h.origin and h.step == 3)
    assert origin.tensor in {e.name for e in entries}
    value = dump.tensor(origin.tensor).value(3)
    assert np.isnan(value).any()  # the bad value itself, as it was
    assert dump.modules[0]["type"] == "Sequential"
    assert [m["path"] for m in dump.modules] == ["", "0", "1", "2"]


def test_periodic_steps_hold_statistics_and_the_chosen_values(tmp_path):
    _train_dumped(_model(), tmp_path, steps=5, dump_every=2, dump_tensors=["*.weight.grad"])
    dump = tensordbg.load(tmp_path)
    assert dump.steps() == [0, 2, 4]
    for step in (0, 2, 4):
        with_values = {e.name for e in dump.tensors(step) if e.has_value}
        assert with_values == {"0.weight.grad", "2.weight.grad"}
        out = next(e for e in dump.tensors(step) if e.name == "0.output")
        assert out.stats and not out.has_value
        assert dump.numbers(step)["step"] == step and "grad_norm" in dump.numbers(step)
    grad = dump.tensor("2.weight.grad")
    assert grad.value(4).shape == (2, 8) and grad.value(4).dtype == np.float32
    assert grad.stats(4)  # the engine's statistics of it


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN where x < 0


class MaskedInside(nn.Module):
    """Its log's output holds NaN, which nan_to_num hides before anything else."""

    def __init__(self) -> None:
        super().__init__()
        self.log = Log()
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nan_to_num(self.log(x)))


def test_a_dumped_step_reads_each_module_output_in_its_hook_not_again_after_the_forward(
    tmp_path, monkeypatch
):
    """On a dumped step deferred mode screens each module's output while it is in the cache
    (read again after the forward, it was 2-3 % of the step); a value it finds not finite is
    dumped as such (the NaN inside, which nan_to_num hides from every guard), and judged, as
    eager checks judge it (it was dumped, and no hit said so)."""
    from tensordbg.engine.pipeline import Pipeline

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), MaskedInside(), nn.ReLU(), nn.Linear(2, 2))
    read_after = []
    real = Pipeline.screen

    def screen(self, record, tensor, *extra):
        if record.stats.kind == "output":
            read_after.append(record.stats.name)
        real(self, record, tensor, *extra)

    monkeypatch.setattr(Pipeline, "screen", screen)
    # A clean model's dumped steps: read after the forward only the model's output (a guard).
    clean = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.ReLU(), nn.Linear(8, 2))
    _train_dumped(clean, tmp_path / "clean", steps=2, dump_every=1, sync="deferred")
    assert sorted(set(read_after)) == ["3.output"]
    session = _train_dumped(model, tmp_path, steps=2, dump_every=1, sync="deferred")
    # Deferred checks see no NaN that no guard shows, but a dumped step reads every output.
    origins = [(h.step, h.tensor) for h in session.hits if h.origin]
    assert origins == [(0, "1.log.output"), (1, "1.log.output")], origins
    dump = tensordbg.load(tmp_path)
    for step in (0, 1):
        stats = {e.name: e.stats for e in dump.tensors(step)}
        assert stats["1.log.output"]["finite"] == 0.0
        # The model's input has its mean too: two runs fed different batches part there.
        assert set(stats["input[0]"]) == {"finite", "mean"}
        assert all(
            stats[name]["finite"] == 1.0 for name in ("0.output", "1.out.output", "2.output")
        )
        # The activation gradients too, screened in their hooks (or vouched for by a bias).
        assert stats["1.out.grad_output"] == stats["0.grad_output"] == {"finite": 1.0}


def test_bfloat16_values_are_dumped_as_bfloat16(tmp_path):
    model = _model().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                               dump_every=1, dump_tensors=["2.output"],
                               summary_at_exit=False)  # fmt: skip
    captured = []
    model[2].register_forward_hook(lambda m, i, o: captured.append(o.detach().clone()))
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    session.detach()
    value = tensordbg.load(tmp_path).tensor("2.output").value(0)
    assert str(value.dtype) == "bfloat16"
    assert value.tobytes() == captured[0].view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("sync", ["eager", "batched", "deferred"])
def test_a_bfloat16_tensor_with_a_nan_keeps_the_range_of_its_finite_values(tmp_path, sync):
    """A bfloat16 output is judged in its hook (its range rules), where min and max are one
    aminmax, NaN when a value is: the index stored that NaN over the hit's finite range, and the
    replay's Modules tab showed x in [nan, nan] where the live one showed the values' range."""
    model = _model().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                               summary_at_exit=False, sync=sync)  # fmt: skip
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    x[1, 2] = float("nan")
    model(x).float().sum().backward()
    opt.step()
    session.detach()
    stats = tensordbg.load(tmp_path).tensor("input[0]").stats(0)
    finite = x.float()[x.float().isfinite()]
    assert stats["nan"] == 1 and (stats["min"], stats["max"]) == (finite.min(), finite.max())


@pytest.mark.parametrize("sync", ["eager", "batched", "deferred"])
def test_a_periodic_step_keeps_the_activation_gradients_dump_tensors_names(tmp_path, sync):
    """``dump_tensors=["*grad_*"]`` on a periodic step: deferred checks (the CPU default)
    dumped no value of an activation gradient, and said nothing (the parameters' gradients
    vouch for them, unread: found trying the product as a new user); eager ones kept the last
    few. Every mode now holds each one the patterns name, and a replay shows it."""
    from tensordbg.sources.replay import ReplaySource

    _train_dumped(_model(), tmp_path, 2, dump_every=1, dump_tensors=["*grad_*"], sync=sync)
    dump = tensordbg.load(tmp_path)
    grads = [e for e in dump.tensors(1) if e.kind in ("grad_output", "grad_input")]
    assert len(grads) >= 3 and all(e.has_value for e in grads), [(e.name, e.has_value)
                                                                 for e in grads]  # fmt: skip
    source = ReplaySource(dump)
    held = [t for t in source.tensors() if t["kind"] == "grad_output" and t["retained"]]
    assert held and source.slice(held[0]["ref"])["data"] is not None


def test_a_replay_says_why_an_activation_gradient_dump_tensors_named_has_no_value(tmp_path):
    """With no room to hold values (``retain_bytes=0``), a chosen activation gradient has only
    its statistics; the replay said to widen dump_tensors, which was as wide as it gets."""
    from tensordbg.sources.contract import SourceError
    from tensordbg.sources.replay import ReplaySource

    _train_dumped(_model(), tmp_path, 2, dump_every=1, dump_tensors=["*"], sync="deferred",
                  retain_bytes=0)  # fmt: skip
    source = ReplaySource(tensordbg.load(tmp_path))
    held = [t for t in source.tensors() if t["kind"] == "grad_output" and not t["retained"]]
    assert held
    with pytest.raises(SourceError, match="did not hold it when its phase ended") as refused:
        source.slice(held[0]["ref"])
    assert "dump_tensors" not in str(refused.value)


def test_a_dump_ended_by_a_detach_while_the_training_goes_on_says_where(tmp_path, capsys):
    """q in a UI detaches tensordbg and the training goes on: the dump ended there, complete,
    and ``check`` said nothing of the steps the script went on to run unwatched."""
    from tensordbg.offline.check import check_dump

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                               dump_every=1, summary_at_exit=False)  # fmt: skip
    _train(model, opt, 3, on_step=lambda step: session.detach() if step == 1 else None)
    dump = tensordbg.load(tmp_path)
    assert dump.steps() == [0, 1] and dump.meta["detached"] == "after step 1"
    said = "the dump ends where tensordbg was detached, after step 1 (a UI's q, or session."
    assert said in check_dump(dump).table()


def test_on_hit_raise_writes_the_step_before_raising(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, on_hit="raise", server=False, dump_dir=tmp_path,
                               summary_at_exit=False)  # fmt: skip
    with pytest.raises(tensordbg.WatchpointHit) as raised:
        _train(model, opt, steps=5, bad_step=2)
    # Read before detaching: what a crash right after the raise would leave.
    dump = tensordbg.load(tmp_path)
    assert dump.steps() == [2]
    assert raised.value.hit.as_dict() in [h.as_dict() for h in dump.hits]
    assert np.isnan(dump.tensor(raised.value.hit.tensor).value(2)).any()
    session.detach()


def test_a_failed_write_keeps_the_training_running_and_marks_the_dump_incomplete(
    tmp_path, monkeypatch, capsys
):
    real = dump_writer.fmt.write_atomic
    calls = []

    def failing(path, chunks, **how):
        if path.name.endswith(".safetensors"):
            calls.append(path)
            raise OSError(28, "No space left on device")
        return real(path, chunks, **how)

    monkeypatch.setattr(dump_writer.fmt, "write_atomic", failing)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                               dump_every=1, dump_tensors=["*"], summary_at_exit=False)  # fmt: skip
    _train(model, opt, steps=6)
    session.detach()
    assert session.step == 6  # the training went on
    err = capsys.readouterr().err
    told = [line for line in err.splitlines() if "No space left" in line]
    # Said once as it happened, once in the closing line (not a warning naming tensordbg's
    # own source line); a loaded machine may add "fell behind".
    assert told[0] == (
        "tensordbg: writing step 0 failed ([Errno 28] No space left on device); "
        "later steps are missing. The training goes on without dumps."
    ), err
    assert told[1].startswith(
        f"tensordbg: no step dumped in {tmp_path}, then writing stopped: writing step 0 failed"
    ), err
    assert len(told) == 2 and "subscriber.py" not in err, err
    assert len(calls) == 1  # and no more writes tried
    dump = tensordbg.load(tmp_path)
    assert dump.meta["complete"] is False
    assert "No space left on device" in dump.meta["reason_incomplete"]
    assert dump.steps() == []


def test_dump_arguments_are_checked(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="on_hit='dump' writes hits into a dump: give dump_dir"):
        tensordbg.attach(model, on_hit="dump", server=False)
    with pytest.raises(ValueError, match="need dump_dir"):
        tensordbg.attach(model, dump_every=3, server=False)
    with pytest.raises(DumpError):
        tensordbg.load(tmp_path)


@pytest.mark.parametrize(
    ("given", "said"),
    [({"dump_every": 2.5}, "dump_every is a number of steps, at least 1 (or None: hits only), "
                           "not 2.5"),
     ({"dump_every": 0}, "dump_every is a number of steps, at least 1"),
     ({"dump_max_bytes": 0}, "dump_max_bytes is a number of bytes, at least 1 (or None: no "
                             "bound), not 0"),
     ({"dump_max_bytes": -1}, "dump_max_bytes is a number of bytes, at least 1"),
     ({"dump_max_bytes": 1.5e9}, "dump_max_bytes is a number of bytes")],
)  # fmt: skip
def test_attach_refuses_dump_settings_the_command_line_refuses(tmp_path, given, said):
    """``attach(dump_max_bytes=-1)`` or ``dump_every=2.5`` were taken (``tensordbg run``
    refuses --dump-max-bytes -1 and --dump-every 2.5); nothing is attached or written."""
    model = _model()
    with pytest.raises(ValueError, match=re.escape(said)):
        tensordbg.attach(model, dump_dir=tmp_path / "d", server=False, **given)
    assert not (tmp_path / "d").exists()
    tensordbg.attach(model, dump_dir=tmp_path / "d", server=False, summary_at_exit=False,
                     dump_every=2, dump_max_bytes=2**20).detach()  # fmt: skip


def test_a_full_disk_is_the_reason_the_dump_gives_and_the_last_line_says_writing_stopped(
    tmp_path, monkeypatch, capsys
):
    """Nothing can be written once the disk is full, meta.json's new copy included: the dump
    said "the run did not finish", and the closing line "3 steps dumped" as if all went well."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                               dump_every=1, dump_tensors=["*"], summary_at_exit=False)  # fmt: skip
    _train(model, opt, steps=3)
    deadline = time.monotonic() + 30
    while session.dumps.writer.steps_written < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # the writer thread has the first steps on disk before the disk fills

    def full(path, chunks, **how):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dump_writer.fmt, "write_atomic", full)
    _train(model, opt, steps=2)
    session.detach()
    dump = tensordbg.load(tmp_path)
    failed = session.dumps.failed
    assert failed.startswith("writing step ") and "[Errno 28] No space left on device" in failed
    assert dump.meta["complete"] is False and dump.meta["reason_incomplete"] == failed
    last = capsys.readouterr().err.splitlines()[-1]
    assert (
        last == f"tensordbg: {len(dump.steps())} steps dumped in {tmp_path}, then writing "
        f"stopped: {failed}"
    )


def test_tensordbg_run_help_says_what_dump_max_bytes_removes(capsys):
    """The help said "steps with hits are kept"; they go too, but for the first and newest."""
    from tensordbg.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "steps with hits are kept" not in help_text
    assert ("the oldest steps without hits go first, then, oldest first, those with hits but "
            "the first and the newest") in help_text  # fmt: skip


RUN_SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(6):
    x = torch.randn(16, 4)
    if step == 3:
        x[0, 0] = float("nan")  # a bad batch
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def test_tensordbg_run_writes_a_dump_without_changing_the_script(tmp_path):
    (tmp_path / "train.py").write_text(RUN_SCRIPT)
    done = zygote.run(
        [sys.executable, "-m", "tensordbg.cli", "run", "--on-hit", "dump", "--dump-dir", "dbg",
         "--dump-every", "2", "--dump-tensors", "*.weight", "train.py"],
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # a watchpoint hit, as with --on-hit record
    dump = tensordbg.load(tmp_path / "dbg")
    assert dump.meta["complete"] and dump.meta["argv"][0] == "train.py"
    assert dump.hits and dump.hits[0].step == 3
    assert {0, 2, 3, 4} <= set(dump.steps())
    assert dump.tensor("loss").steps() == dump.steps()  # the loss the runner observes


def test_tensordbg_run_says_dump_flags_need_a_dump_dir(cli, tmp_path):
    (tmp_path / "train.py").write_text(RUN_SCRIPT)
    code, _, err = cli("run", "--dump-every", "2", "train.py")
    assert code == 2
    assert "give --dump-dir DIR too" in err and "Traceback" not in err
    assert not (tmp_path / "dbg").exists()


class MaskedAttention(nn.Module):
    """Its own code makes the NaN (a softmax over a row its mask hides entirely) and its output
    projection returns it: the hit names the attention, the tensor is the projection's."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
        return self.proj(weights)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.attn = MaskedAttention()

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.attn(self.inp(x), keep)


def test_a_hit_named_after_the_call_that_made_it_keeps_its_origin_in_the_dump(tmp_path):
    from tensordbg.offline.check import check_dump
    from tensordbg.sources.replay import ReplaySource

    torch.manual_seed(0)
    model = Masked()
    session = tensordbg.attach(model, on_hit="record", server=False, summary_at_exit=False,
                               dump_dir=tmp_path)  # fmt: skip
    keep = torch.tensor([[True, True, False, False], [False, False, False, False]])
    with torch.no_grad():
        model(torch.randn(2, 4), keep)
    session.detach()
    origin = next(h for h in session.hits if h.origin)
    assert (origin.tensor, origin.stored_as) == ("attn.output", "attn.proj.output")
    dump = tensordbg.load(tmp_path)
    # check marks the dumped tensor the hit stands for, and says where the NaN arose.
    report = check_dump(dump)
    assert [f.tensor for f in report.findings if f.origin] == ["attn.proj.output"]
    table = report.table()
    assert "it arose at attn.output (dumped as attn.proj.output), step 0 (NaN)" in table
    assert "attn.output (dumped as attn.proj.output)  <- origin" in table  # its row says so too
    assert "\n    attn.output holds " in table
    # The replay opens the hit's tensor, and its provenance is the attention's: the softmax
    # line and the mask that hid the second row.
    source = ReplaySource(dump)
    hit = next(h for h in source.hits() if h["origin"])
    assert source.stats(hit["ref"])["summary"]["nan"] == 4
    prov = source.provenance(hit["ref"])
    assert prov["producer"]["module"] == "attn"
    assert (
        prov["operation"]["op"] == "torch.softmax" and "torch.softmax(" in prov["operation"]["code"]
    )
    # The line that called the projection and the softmax line are one frame of one forward.
    assert [f[1] for f in prov["stack"][-2:]] == [
        inspect.getsourcelines(Masked.forward)[1] + 1, prov["operation"]["line"]]  # fmt: skip
    mask = next(i for i in prov["inputs"] if i["dtype"] == "bool")
    assert mask["line"] == "bool mask: 2 of 8 True; 1 of 2 rows all False"


class _Abs(nn.Module):
    """|x| as sqrt(x * x): finite forward at 0, NaN backward (0/0) there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)


def _abs_of_zero() -> tuple[nn.Module, torch.Tensor]:
    """fc1, abs, fc2 and a batch whose row 1 makes fc1's output 0 there: abs's backward
    divides 0 by 0 (a NaN made by the backward alone)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _Abs(), nn.Linear(16, 4))
    nn.init.zeros_(model[0].bias)
    x = torch.randn(4, 8)
    x[1] = 0
    return model, x


def test_a_backward_hit_named_after_the_module_that_took_the_value_shows_that_module(tmp_path):
    """A NaN made by abs's backward is the hit abs.grad_input[0], though the gradient is stored
    as fc1's output gradient: Provenance, live and replayed, shows abs (whose backward made
    it), fed back to fc1's backward, not fc1 with the stored name."""
    from tensordbg.sources.live import LiveSource
    from tensordbg.sources.replay import ReplaySource

    model, x = _abs_of_zero()
    with tensordbg.attach(model, on_hit="record", server=False, summary_at_exit=False,
                          sync="eager", dump_dir=tmp_path) as session:  # fmt: skip
        model(x).pow(2).mean().backward()
        hit = next(h for h in session.hits if h.origin)
        assert (hit.tensor, hit.module, hit.stored_as) == ("1.grad_input[0]", "1", "0.grad_output")
        live = LiveSource(session).provenance(hit.ref, hit.module, hit.call)
    source = ReplaySource(tensordbg.load(tmp_path))
    replayed = next(h for h in source.hits() if h["origin"])
    dumped = source.provenance(replayed["ref"], replayed["module"], replayed["call"])
    for prov in (live, dumped):
        assert (prov["name"], prov["kind"]) == ("1.grad_input[0]", "grad_input")
        assert prov["producer"] == {"module": "1", "type": "_Abs", "call": 0}
        assert prov["consumers"] == [{"module": "0", "type": "Linear", "call": 0}]
    assert [i["name"] for i in live["inputs"]] == ["0.output"]  # abs's input


@pytest.mark.parametrize("sync", ["eager", "batched", "deferred"])
def test_a_bad_backward_is_dumped_in_the_order_autograd_made_it(tmp_path, sync):
    """Each module's output gradient, then its parameters' gradients, from the loss back. A
    deferred pass registers at its end the gradients it vouched for and those of the
    parameters: ``tensordbg check`` and Dump.tensors numbered the model's output gradient,
    made first, last of the step."""
    model, x = _abs_of_zero()
    with tensordbg.attach(model, on_hit="record", server=False, summary_at_exit=False,
                          sync=sync, dump_dir=tmp_path) as session:  # fmt: skip
        model(x).pow(2).mean().backward()
        assert any(h.origin for h in session.hits)
    names = [e.name for e in tensordbg.load(tmp_path).tensors(0) if e.phase == "backward"]
    order = ["2.grad_output", "2.bias.grad", "2.weight.grad", "0.grad_output",
             "0.bias.grad", "0.weight.grad"]  # fmt: skip
    assert [n for n in names if n in order] == order, names


def test_a_periodic_steps_dumped_value_keeps_where_it_came_from(tmp_path):
    """Values dumped on periodic steps (dump_tensors) carry their provenance, as a hit step's
    do: the replay names the module that made the value, its input and the line that called it."""
    from tensordbg.sources.replay import ReplaySource

    _train_dumped(_model(), tmp_path, steps=2, dump_every=1, dump_tensors=["2.output"])
    source = ReplaySource(tensordbg.load(tmp_path))
    source.goto(1)
    ref = next(m["ref"] for m in source.tensors() if m["name"] == "2.output")
    prov = source.provenance(ref)
    assert prov["producer"]["module"] == "2"
    assert [i["name"] for i in prov["inputs"]] == ["1.output"]
    # The line that called the model (the Sequential runs its children itself).
    assert (prov["source"]["function"], prov["source"]["line"]) == ("_train", _MODEL_CALL_LINE)


class _Nudged(nn.Module):
    """Adds ``nudge`` to its output at step ``at`` (counted by its own calls)."""

    def __init__(self, nudge: float, at: int) -> None:
        super().__init__()
        self.inner, self.nudge, self.at, self.calls = nn.Linear(8, 8), nudge, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x) + (self.nudge if self.calls - 1 == self.at else 0.0)


def test_diff_of_two_default_periodic_dumps_parts_at_the_activation_that_changed(tmp_path):
    """Under the default (deferred) checks a dumped step screens each module's output in its
    hook; that one sum gives its mean too, so two statistics-only dumps part at the module
    whose output changed (step 2, forward), not at the loss or a gradient after it."""
    from tensordbg.offline.diff import diff_dumps

    for name, nudge in (("a", 0.0), ("b", 1e-3)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _Nudged(nudge, at=2), nn.Linear(8, 2))
        _train_dumped(model, tmp_path / name, steps=4, dump_every=1)
    a, b = tensordbg.load(tmp_path / "a"), tensordbg.load(tmp_path / "b")
    assert "mean" in a.tensor("2.output").stats(0)
    first = diff_dumps(a, b).first
    assert (first.step, first.tensor, first.phase) == (2, "2.output", "forward")


def test_a_dumped_step_on_a_device_reads_its_activations_and_their_gradients_in_one_transfer(
    tmp_path, monkeypatch
):
    """Deferred checks leave a clean pass's tensors unscreened. On the host a dumped step
    screens them in their hooks, while they are in the cache; on a device, reading them one by
    one would synchronize once per tensor: a phase's come over in one transfer (the forward's
    and the dump's, the backward's with the parameter gradients' norms), and the dump holds the
    statistics of every one, the activations' mean included. (The device is played by the CPU:
    deferred checks as they run on a device, and the dump's tensors count as not on the
    host.)"""
    from tensordbg.dump import subscriber
    from tensordbg.engine import modes, param_grads
    from tensordbg.engine import session as engine

    monkeypatch.setattr(subscriber, "on_host", lambda tensor: False)
    monkeypatch.setattr(engine, "choose", lambda sync, device: modes.Deferred(on_device=True))
    flushes, norms = [], []
    real_flush, real_norms = subscriber.StatsBatch.flush, param_grads.norms_of
    monkeypatch.setattr(subscriber.StatsBatch, "flush",
                        lambda self: flushes.append(len(self)) or real_flush(self))  # fmt: skip
    monkeypatch.setattr(param_grads, "norms_of",
                        lambda ts: norms.append(len(ts)) or real_norms(ts))  # fmt: skip
    _train_dumped(_model(), tmp_path, steps=2, dump_every=1, sync="deferred")
    # One transfer a phase, and the dump's own of what the forward left unscreened: at attach
    # (the 4 parameters); then each step's forward (the model's output, its guard), the dump's
    # (the input, the two module outputs, and the model's output for its mean), the backward
    # (the norms of the 4 parameter gradients and of the 2 activation gradients the pass kept,
    # and the model output's gradient) and the optimizer step (the 4 parameters, whose ranges
    # tell their updates).
    assert flushes == [4, 1, 4, 7, 4, 1, 4, 7, 4]
    assert norms == []  # the parameter gradients' norms came with the backward's transfer
    dump = tensordbg.load(tmp_path)
    for i in range(3):  # every activation with its mean, the guard's too
        stats = dump.tensor(f"{i}.output").stats(1)
        assert stats["finite"] == 1.0 and math.isfinite(stats["mean"])
    gradients = [e for e in dump.tensors(1) if e.kind == "grad_output"]
    assert sorted(e.name for e in gradients) == ["0.grad_output", "1.grad_output", "2.grad_output"]
    assert all(e.stats == {"finite": 1.0} for e in gradients)


def test_a_writer_slower_for_a_moment_than_a_small_models_steps_loses_no_step(
    tmp_path, monkeypatch, capsys
):
    """A small model steps faster than the writer writes for a while (a hit step's fsync, a
    busy disk): statistics-only steps wait for it, they are not dropped."""
    from tensordbg.dump.writer import DumpWriter

    write_step = DumpWriter.write_step

    def slow(self, *args, **kwargs):
        time.sleep(0.02)
        return write_step(self, *args, **kwargs)

    monkeypatch.setattr(DumpWriter, "write_step", slow)
    _train_dumped(_model(), tmp_path, steps=30, dump_every=1)
    dump = tensordbg.load(tmp_path)
    assert dump.steps() == list(range(30)) and dump.meta["complete"]
    assert "fell behind" not in capsys.readouterr().err


def test_values_past_the_queues_bound_drop_periodic_steps_never_hit_steps(
    tmp_path, monkeypatch, capsys
):
    """Values waiting for the writer are bounded (QUEUE_STEPS x retain_bytes): a writer that
    cannot keep up makes the periodic steps past it go, said once and in the dump's metadata;
    a step with a hit waits for room and is written."""
    from tensordbg.dump import subscriber
    from tensordbg.dump.writer import DumpWriter

    write_step, go = DumpWriter.write_step, threading.Event()

    def stuck(self, *args, **kwargs):
        go.wait(30)
        return write_step(self, *args, **kwargs)

    monkeypatch.setattr(DumpWriter, "write_step", stuck)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    nbytes = model[0].weight.numel() * 4
    session = tensordbg.attach(model, opt, on_hit="dump", server=False, dump_dir=tmp_path,
                               dump_every=1, dump_tensors=["0.weight"], retain_bytes=nbytes,
                               summary_at_exit=False)  # fmt: skip
    _train(model, opt, steps=8, bad_step=6, on_step=lambda step: step == 6 and go.set())
    session.detach()
    said = [line for line in capsys.readouterr().err.splitlines() if "fell behind at step" in line]
    assert len(said) == 1
    dump = tensordbg.load(tmp_path)
    assert 6 in dump.steps() and any(h.step == 6 for h in dump.hits)
    dropped = [s for s in range(6) if s not in dump.steps()]
    assert dropped and len(dump.steps()) >= subscriber.QUEUE_STEPS
    assert "dropped periodic steps" in dump.meta["reason_incomplete"]


def test_check_says_how_often_a_periodic_dump_held_a_step(tmp_path, capsys):
    from tensordbg.offline.check import check_dump

    _train_dumped(_model(), tmp_path, steps=7, dump_every=3)
    said = capsys.readouterr().err  # where the dump is, when the session ends
    assert f"tensordbg: 3 steps dumped in {tmp_path}: tensordbg replay {tmp_path}" in said
    dump = tensordbg.load(tmp_path)
    assert dump.meta["dump_every"] == 3 and dump.steps() == [0, 3, 6]
    notes = check_dump(dump).notes
    assert any("(the dump holds one step in 3 and the steps with hits)" in n for n in notes)


@pytest.mark.parametrize("sync", ["eager", "batched", "deferred"])
def test_a_healthy_dump_passes_a_strict_check_in_every_mode(tmp_path, sync, capsys):
    """Every record a dump lists holds what its rules need: a healthy run's dump passes
    ``tensordbg check --strict`` (which fails on a rule that could not judge). A device's
    first step once listed updates it could not tell apart, with no statistics."""
    from tensordbg.cli import main

    _train_dumped(_model(), tmp_path, steps=4, dump_every=1, sync=sync)
    assert main(["check", str(tmp_path), "--strict"]) == 0, capsys.readouterr().out
    dump = tensordbg.load(tmp_path)
    updates = [e for s in dump.steps() for e in dump.tensors(s) if e.kind == "update"]
    assert all(e.stats for e in updates), [e.name for e in updates if not e.stats]


def test_check_marks_the_origins_the_run_named_and_lists_them_first_in_their_step(tmp_path):
    """A weight set to Inf between steps is the origin where its module runs (forward); after
    the update the same weight is checked again and is no origin there. ``check`` marks exactly
    the run's origins, phase included, and puts a step's origin first in its table."""
    from tensordbg.offline.check import check_dump

    model = _model()

    def break_weight(step):
        if step == 1:
            with torch.no_grad():
                model[2].weight[0, 0] = float("inf")

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                          summary_at_exit=False) as session:  # fmt: skip
        _train(model, opt, 4, on_step=break_weight)
    live = {(h.step, h.phase, h.tensor) for h in session.hits if h.origin}
    assert (2, "forward", "2.weight") in live
    report = check_dump(tensordbg.load(tmp_path))
    marked = {(f.step, f.phase, f.tensor) for f in report.findings if f.origin}
    assert marked == live
    first = report.table().splitlines()[0]
    assert first.startswith("step 2 forward") and "2.weight" in first and "<- origin" in first


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_a_hit_steps_clean_activations_are_dumped_with_their_mean(tmp_path, sync):
    """Checks read a hit step's clean activations for NaN alone, and a dumped step kept only
    that ("finite"): tensordbg diff then parted two runs at the NaN, not at the activation
    whose mean changed first. Every dumped activation has its mean."""
    model = _model()
    armed = {"on": False}
    model[2].register_forward_hook(lambda m, i, o: o * float("nan") if armed["on"] else o)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tensordbg.attach(model, opt, on_hit="record", server=False, sync=sync, dump_every=1,
                          dump_dir=tmp_path, summary_at_exit=False):  # fmt: skip
        _train(model, opt, steps=4, on_step=lambda step: armed.update(on=step == 1))
    dump = tensordbg.load(tmp_path)
    entries = {e.name: e for e in dump.tensors(2)}  # armed after step 1: step 2 hits
    assert entries["2.output"].stats["finite"] == 0.0
    for name in ("input[0]", "0.output", "1.output"):
        assert entries[name].stats["finite"] == 1.0 and "mean" in entries[name].stats, (
            name, entries[name].stats)  # fmt: skip


def test_a_weight_bad_at_attach_is_dumped_as_it_was_there_beside_its_value_after_the_update(
    tmp_path,
):
    """attach's check found a +Inf in 2.weight, and the step's optimizer phase checked it again:
    the dump kept one value a name a step, the later one, so the replay of the attach hit showed
    the weight after the update and said that its value at the hit "was not dumped"."""
    from tensordbg.sources.replay import ReplaySource

    model = _model()
    with torch.no_grad():
        model[2].weight[0, 0] = float("inf")
        model[2].bias.fill_(float("nan"))  # so the update writes NaN into the weight
    at_attach = model[2].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                               summary_at_exit=False)  # fmt: skip
    assert (session.hits[0].tensor, session.hits[0].phase) == ("2.weight", "attach")
    _train(model, opt, 1)
    session.detach()
    dump = tensordbg.load(tmp_path)
    there = dump.tensor("2.weight", phase="attach").value(0)
    assert there.tobytes() == at_attach.numpy().tobytes()
    after = dump.tensor("2.weight").value(0)
    assert np.isnan(after).all() and after.tobytes() == model[2].weight.detach().numpy().tobytes()
    assert dump.verify() == {}
    replay = ReplaySource(dump)
    shown = replay.stats(replay.paused_at["ref"])
    summary = shown["summary"]
    assert (shown["name"], summary["posinf"], summary["nan"]) == ("2.weight", 1, 0)
    assert "not dumped" not in shown["line"]


def test_a_clean_run_with_a_dump_directory_says_that_nothing_was_dumped_and_why(tmp_path, capsys):
    """A healthy run given a dump directory said nothing of it at exit: a CI job could not tell
    a clean run from a dump that was never written (found trying the product as a new user)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = tensordbg.attach(model, opt, on_hit="record", server=False, dump_dir=tmp_path,
                               summary_at_exit=False)  # fmt: skip
    _train(model, opt, 3)
    session.detach()
    assert not session.hits
    said = capsys.readouterr().err
    assert f"tensordbg: no step dumped in {tmp_path}: none hit" in said
    assert tensordbg.load(tmp_path).steps() == []
