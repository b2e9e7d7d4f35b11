"""The session's extension bus, its handle group and its control plane: what dumps, profiling and
framework callbacks plug into."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from models import mlp

import tensordbg
from tensordbg.engine import bus as bus_module
from tensordbg.engine.handles import HandleGroup
from tensordbg.rules import NaN


def _train(model, optimizer, steps=2, poison_at=None):
    for step in range(steps):
        x = torch.randn(3, 4)
        if step == poison_at:
            x[0, 0] = float("nan")
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_subscriber_hears_each_phase_step_and_hit_in_order(watch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()])
    heard = []
    session.bus.subscribe(lambda event, payload: heard.append((event, payload)),
                          events={"phase_end", "step_end", "hit"})  # fmt: skip
    _train(model, opt, steps=2, poison_at=1)
    events = [e for e, _ in heard]
    assert events[:4] == ["phase_end", "phase_end", "phase_end", "step_end"]
    phases = [p["phase"] for e, p in heard if e == "phase_end"][:3]
    assert phases == ["forward", "backward", "optimizer"]
    forward = next(p for e, p in heard if e == "phase_end")
    assert any(r.stats.name == "0.output" for r in forward["records"])
    assert [p["step"] for e, p in heard if e == "step_end"] == [0, 1]
    hits = [p for e, p in heard if e == "hit"]
    assert hits and hits[0]["tensor"] == "input[0]" and hits[0]["step"] == 1


def test_a_subscriber_that_raises_is_disabled_once_with_a_warning_and_training_goes_on(watch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record")
    calls = []

    def broken(event, payload):
        calls.append(event)
        raise KeyError("boom")

    session.bus.subscribe(broken, events={"step_end"})
    with pytest.warns(RuntimeWarning, match="subscriber .*broken.* raised KeyError") as warned:
        _train(model, opt, steps=3)
    assert calls == ["step_end"]  # disabled after its first fault
    assert len([w for w in warned if "subscriber" in str(w.message)]) == 1
    assert session.step == 3


def test_an_unknown_event_name_is_refused_at_once(watch):
    session = watch(mlp())
    with pytest.raises(ValueError, match="no such event: phase_ends"):
        session.bus.subscribe(lambda e, p: None, events={"phase_ends"})


def test_installed_extensions_are_loaded_once_and_receive_every_new_session(watch, monkeypatch):
    seen = []

    class EntryPoint:
        name, value = "recorder", "pkg:recorder"

        def load(self):
            seen.append("load")
            return lambda session: seen.append(session.run_id)

    monkeypatch.setattr(bus_module, "_extensions", None)
    monkeypatch.setattr(bus_module, "entry_points", lambda group: [EntryPoint()])
    first = watch(mlp(), run_id="a")
    second = watch(mlp(), run_id="b")
    assert seen == ["load", first.run_id, second.run_id]


def test_detach_is_one_close_of_everything_attach_installed(watch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    session = watch(model, optimizer=opt, scaler=scaler, on_hit="record")
    assert "update" in vars(scaler)  # patched on the instance
    assert len(session.handles) > 0
    session.detach()
    assert len(session.handles) == 0
    assert "update" not in vars(scaler)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_handle_that_cannot_be_removed_does_not_keep_the_others_installed():
    undone = []

    class Stuck:
        def remove(self):
            raise RuntimeError("stuck")

    group = HandleGroup()
    group.callback(lambda: undone.append("first"))
    group.add(Stuck())
    group.callback(lambda: undone.append("last"))
    with pytest.warns(RuntimeWarning, match="could not undo"):
        group.close()
    assert undone == ["last", "first"]  # newest first, past the stuck one
    with pytest.raises(RuntimeError, match="detached"):
        group.callback(lambda: None)


def test_a_change_from_another_thread_waits_for_the_training_threads_next_hook(watch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()])
    applied_on = []
    result = {}

    def from_the_server():
        future = session.control.submit(lambda: applied_on.append(threading.current_thread()))
        result["done_at_once"] = future.done()

    helper = threading.Thread(target=from_the_server)
    helper.start()
    helper.join(10)
    assert not helper.is_alive()
    assert result == {"done_at_once": False} and applied_on == []  # nothing ran under the training
    _train(model, opt, steps=1)
    assert applied_on == [threading.current_thread()]


def test_attach_with_a_nan_parameter_in_raise_mode_leaves_nothing_installed():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(tensordbg.WatchpointHit, match="removed everything it installed"):
        tensordbg.attach(model, optimizer=opt, on_hit="raise", server=False)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    with torch.no_grad():
        model[0].weight[0, 0] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session = tensordbg.attach(model, optimizer=opt, on_hit="raise", server=False)
    session.detach()
