"""What a session remembers between hooks, steps and optimizers, and what it lets go of."""

from __future__ import annotations

import gc
import math
import weakref
from dataclasses import replace

import pytest
import torch
from models import mlp
from paused import PausedTraining
from torch import nn

from tensordbg.engine.records import new_record
from tensordbg.rules import NaN


class LogScale(nn.Module):
    """``log(x) * weight``: its own code makes NaN from negative inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) * self.weight


def test_the_second_optimizer_judges_its_parameters_against_the_gradients(watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    session = watch(model, optimizer=[first, second], on_hit="record", rules=[NaN()])
    model[1].weight.register_hook(lambda g: g * float("nan"))  # a NaN gradient, planted
    model(torch.randn(3, 4)).sum().backward()
    first.step()
    second.step()  # steps model[1] with that gradient: its weight turns NaN
    [grad] = [h for h in session.hits if h.kind == "grad"]
    [param] = [h for h in session.hits if h.kind == "param"]
    assert (grad.tensor, grad.origin) == ("1.weight.grad", True)
    assert (param.tensor, param.origin) == ("1.weight", False)  # the gradient made it


def test_a_repaired_parameter_no_longer_explains_a_nan_its_module_makes(watch):
    model = LogScale()
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    session = watch(model, on_hit="record", rules=[NaN()], sync="eager")
    assert [(h.kind, h.origin) for h in session.hits] == [("param", True)]
    with torch.no_grad():
        model.weight.fill_(1.0)
    session.check_parameters()  # finite again
    model(-torch.ones(2, 4))  # log of negatives: this module's own code makes the NaN
    [hit] = [h for h in session.hits if h.kind == "output"]
    assert hit.origin


def test_detach_lets_go_of_the_model_its_optimizer_and_what_a_hit_held(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record")
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    optimizer.step()
    assert session.hits
    refs = [weakref.ref(model), weakref.ref(optimizer), weakref.ref(model[0].weight)]
    session.detach()
    del model, optimizer, x
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert session.hits and session.summary()  # what was found stays readable


def test_eager_checks_keep_recent_tensors_within_the_budget(watch):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(12)))
    nbytes = 16 * 8 * 4  # one activation
    seen: list[tuple[str, bool]] = []

    def on_hit(hit):
        if not seen:
            seen.extend((r.stats.name, r.tensor is not None) for r in session.records)

    # The last layer's forward makes a NaN (a hook of the user's, placed before attach).
    model[11].register_forward_hook(lambda module, args, out: out * float("nan"))
    session = watch(model, on_hit=on_hit, rules=[NaN()], sync="eager", retain_bytes=3 * nbytes)
    model(torch.randn(16, 8))
    names = [name for name, _ in seen]
    kept = [name for name, strong in seen if strong]
    assert names[-1] == "11.output"  # the hit, judged in its hook
    # The budget holds three activations: the hit's own and the two the model made just before
    # it. Everything older was let go.
    assert kept == names[-3:] == ["9.output", "10.output", "11.output"]


def test_without_an_optimizer_detach_completes_the_last_step_and_keeps_its_loss(watch):
    """Without an optimizer a step is one call of the model, completed by the next call; the
    last call has none after it, so detach completes its step: its loss joins the history."""
    model = mlp()
    session = watch(model, on_hit="record")
    for loss in (3.0, 2.0, 1.0):
        model(torch.randn(3, 4)).sum().backward()
        session.observe("loss", torch.tensor(loss))
    session.detach()
    assert [(step, loss) for step, loss, _, _ in session.history] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    assert session.step == 3


def test_a_state_event_gives_the_pauses_reason_only_while_paused():
    """Every state event carried the last pause's reason: "running at step 3 (NaN hit: ...)"
    read as if the training ran because of it."""
    events: list[dict] = []

    def listen(step: int) -> None:  # on the training thread, before the pause can come
        if step == 0:
            training.session.bus.subscribe(lambda e, p: events.append(p), events={"state"})

    training = PausedTraining(before_step=listen)
    with training:
        training.wait_paused()
        training.session.controller.resume()
        training.wait(lambda: any(p["state"] == "running" for p in events))
    said = [(p["state"], bool(p.get("reason"))) for p in events]
    assert ("paused", True) in said and ("running", True) not in said, said
    assert ("running", False) in said


def test_a_loss_observed_as_a_number_is_watched(watch):
    """Scripts log ``loss.item()``: observing that number dropped it unseen, a NaN included."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()])
    for value in (1.5, float("nan")):
        model(torch.randn(3, 4)).sum().backward()
        session.observe("loss", value)
        opt.step()
        opt.zero_grad()
    assert [(h.rule, h.tensor, h.step) for h in session.hits] == [("NaN", "loss", 1)]
    with pytest.raises(TypeError, match=r"observe\(\) takes a tensor or a number, not NoneType"):
        session.observe("loss", None)


def test_attach_says_which_argument_is_not_what_it_takes():
    """A string for the model or the optimizer failed inside attach with an AttributeError
    ("'str' object has no attribute 'modules'")."""
    import tensordbg

    with pytest.raises(TypeError, match=r"attach\(\) takes the model, a torch\.nn\.Module, not"):
        tensordbg.attach("model")
    with pytest.raises(TypeError, match=r"optimizer= is a torch\.optim\.Optimizer or a list of"):
        tensordbg.attach(mlp(), optimizer="adam", server=False)
    with pytest.raises(TypeError, match=r"optimizer= is a torch\.optim\.Optimizer or a list of"):
        tensordbg.attach(mlp(), optimizer=[object()], server=False)


def test_a_loss_observed_at_each_micro_batch_is_a_tensor_per_micro_batch(watch, tmp_path):
    """Four micro-batches a step observed four tensors named "loss": a dump kept only the last
    one's value, and the replay showed it for a hit on the second. The k-th is loss#k, as a
    module's k-th call is; a rule's match="loss" covers them all, and the curve averages them."""
    import tensordbg
    from tensordbg.rules import LossNotDecreasing

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rules = [NaN(), LossNotDecreasing(match="loss")]
    session = watch(model, optimizer=opt, on_hit="record", rules=rules, dump_dir=tmp_path,
                    dump_every=1)  # fmt: skip
    observed: list[float] = []
    for step in range(2):
        for micro in range(4):
            loss = model(torch.randn(3, 4)).pow(2).mean() + micro
            if step == 1 and micro == 1:
                loss = loss * float("nan")
            session.observe("loss", loss)
            observed.append(loss.item())
            (loss / 4).backward()
        opt.step()
        opt.zero_grad()
    assert session.metrics.history[0][1] == pytest.approx(sum(observed[:4]) / 4)  # averaged
    [hit] = [h for h in session.hits if h.origin]
    assert (hit.tensor, hit.step) == ("loss#1", 1)
    later = new_record(torch.tensor(1.0), "loss#1", "observed", "forward", 1, call=1).stats
    assert LossNotDecreasing(match="loss").applies(later)
    assert not LossNotDecreasing(match="loss").applies(replace(later, name="lossy", call=0))
    session.detach()
    dump = tensordbg.load(tmp_path)
    names = [e.name for e in dump.tensors(1) if e.kind == "observed"]
    assert names == ["loss", "loss#1", "loss#2", "loss#3"]
    assert math.isnan(dump.tensor("loss#1").value(1)) and dump.tensor("loss#3").value(1) > 2


def test_the_last_state_of_a_pause_ctrl_c_ended_is_where_the_pause_was(watch):
    """Two ranks paused at step 5 before the update (their safe point, "optimizer"): Ctrl-C
    ended both, each saying "interrupted (Ctrl-C) at step 5, optimizer while paused", and the UI
    then read "FINISHED at step 5 (backward)": detach published the phase the safe point had
    left, not the pause's (found trying two ranks as a new user)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record")
    model(torch.randn(3, 4)).sum().backward()  # step 0, backward
    events: list[dict] = []
    session.bus.subscribe(lambda e, p: events.append(p), events={"state"})
    session.stopped_at = (0, "optimizer")  # as a Ctrl-C at the ranks' safe point leaves it
    session.detach(finished=True)
    last = events[-1]  # (the controller says "detached" first; a UI keeps the last)
    assert (last["state"], last["step"], last["phase"]) == ("finished", 0, "optimizer")
