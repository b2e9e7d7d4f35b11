"""The debugger engine: what attach watches, where it says a problem started, and that it changes
nothing else about the training."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from conftest import DEADLINE, DEFERRED_ON_DEVICE, wait_until
from models import GptRun, LogHead, SqrtOfSquare, mlp, run_gpt, train_gpt
from torch import nn
from torch.nn import functional as F

import tensordbg
from tensordbg.engine.session import EAGER_WINDOW
from tensordbg.rules import NaN, Rule, VanishingGradient, WeightNotChanging, default_rules
from tensordbg.rules.base import Finding
from tensordbg.statistics import L2

MODES = ("eager", "batched", "deferred", DEFERRED_ON_DEVICE)


def origins(session):
    return [h for h in session.hits if h.origin]


def when_paused(session, then: Callable[[], None]) -> Callable[[], None]:
    """Call ``then()`` from another thread, as the UI would, once the training pauses; returns
    ``join()``, which fails the test when no pause came within DEADLINE seconds or ``then``
    raised. A helper that fails detaches the session, so that a training it should have resumed
    goes on: a bug fails the test in seconds instead of hanging it.

    >>> join = when_paused(session, session.controller.resume)
    >>> model(bad_batch)  # pauses, and is resumed
    >>> join()
    """
    failures: list[BaseException] = []

    def helper() -> None:
        try:
            wait_until(lambda: session.controller.state == "paused")
            then()
        except BaseException as e:
            failures.append(e)
            session.controller.detach()

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()

    def join() -> None:
        thread.join(DEADLINE)
        assert not thread.is_alive(), f"the helper did not finish within {DEADLINE} s"
        if failures:
            raise failures[0]

    return join


# --- healthy training ------------------------------------------------------------------------


def test_a_healthy_transformer_trains_for_dozens_of_steps_without_a_single_hit(watch):
    _, session = train_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record"), steps=40)
    assert session.step == 40
    assert session.hits == []


def assert_same_training(bare: GptRun, watched: GptRun) -> None:
    """Bitwise: every loss, the final weights, and the global generator (a hook that drew a
    random number would move it, even where nothing else in the training draws one)."""
    assert all(torch.equal(a, b) for a, b in zip(bare.losses, watched.losses, strict=True))
    assert torch.equal(bare.rng_state, watched.rng_state)
    assert bare.weights.keys() == watched.weights.keys()
    assert all(torch.equal(bare.weights[k], watched.weights[k]) for k in bare.weights)


def test_attaching_changes_no_number_of_the_training(watch):
    bare = run_gpt(None, steps=12)
    watched = run_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record"), steps=12)
    assert_same_training(bare, watched)


@pytest.mark.parametrize("sync", MODES)
def test_attaching_changes_no_number_in_any_mode(watch, sync):
    bare = run_gpt(None, steps=6)
    watched = run_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record", sync=sync), steps=6)
    assert_same_training(bare, watched)


@pytest.mark.parametrize("sync", ["batched", DEFERRED_ON_DEVICE])
def test_checks_on_a_device_read_no_tensor_alone_in_a_clean_step(watch, monkeypatch, sync):
    """On CUDA each read of one tensor's statistics is a synchronization: batched checks, and
    deferred checks of a model on a device, read none (the phase's transfer brings what they
    screen), whatever the rules ask; a planted NaN is still named where it was made."""
    from tensordbg.engine.pipeline import Pipeline

    reads = []
    measure = Pipeline.measure
    monkeypatch.setattr(Pipeline, "measure", lambda self, stats, *a: reads.append(
        (self.step, stats.name)) or measure(self, stats, *a))  # fmt: skip
    _, session = train_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record", sync=sync),
                           steps=8, bad_step=6)  # fmt: skip
    assert [r for r in reads if 0 < r[0] < 6] == []  # step 0 may answer a rule's Refine
    first = origins(session)[0]
    assert (first.module, first.kind, first.step) == ("blocks.0.attn", "output", 6)


class NormAbove(Rule):
    """Fires on every parameter gradient whose norm is above ``bound``."""

    kinds = frozenset({"grad"})
    needs = (L2,)

    def __init__(self, *, bound: float = 0.0, **selection):
        super().__init__(**selection)
        self.bound = bound

    def check(self, t, state):
        norm = t.get(L2)
        return Finding(norm, self.bound, f"{t.name}: {norm}") if norm > self.bound else None


@pytest.mark.parametrize("sync", MODES)
def test_a_rule_added_or_turned_off_between_steps_judges_the_parameter_gradients_from_the_next(
    watch, sync
):
    """What a parameter gradient's record is checked for is not kept from one step to the next
    when the rules change: a rule added after step 1 judges every gradient of step 2 on, and
    one turned off after step 3 judges none of step 4."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    added = None
    for step in range(5):
        if step == 2:
            added = session.add_rule(NormAbove(match="*.grad"))
        if step == 4:
            added.enabled = False
            session.rules_changed()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    steps = sorted({h.step for h in session.hits if h.rule == added.rule.name})
    assert steps == [2, 3]
    named = {h.tensor for h in session.hits if h.rule == added.rule.name and h.step == 2}
    assert named == {f"{n}.grad" for n, _ in model.named_parameters()}


def test_deferred_checks_of_a_language_model_read_no_tensor_alone_in_a_clean_step(
    watch, monkeypatch
):
    """An embedding table's gradient is mostly zero rows: its bound from the norm (mean |grad|
    >= L2 / n) is below VanishingGradient's threshold every step here, but not below the
    model's typical gradient times ``relative``, which decides it without reading the table
    again (it read the table's min and max every step)."""
    from tensordbg.engine.pipeline import Pipeline

    reads = []
    measure = Pipeline.measure
    monkeypatch.setattr(Pipeline, "measure", lambda self, stats, *a: reads.append(
        (self.step, stats.name)) or measure(self, stats, *a))  # fmt: skip
    torch.manual_seed(0)
    vocab = 4096
    model = nn.Sequential(nn.Embedding(vocab, 64), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, vocab))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = watch(model, optimizer=optimizer, on_hit="record", sync="deferred")
    bounds = []
    for _ in range(6):
        tokens = torch.randint(0, vocab, (16, 65))
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
        table = model[0].weight.grad
        bounds.append(table.norm().item() / table.numel())
        optimizer.step()
        optimizer.zero_grad()
    assert max(bounds) < VanishingGradient().threshold  # the bound alone does not decide
    assert [r for r in reads if r[0] > 0] == []
    assert session.hits == []


# --- where a problem started -------------------------------------------------------------------


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_made_by_attention_is_named_at_the_attention_module_and_step(watch, sync):
    _, session = train_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record", sync=sync),
                           steps=8, bad_step=5)  # fmt: skip
    first = origins(session)[0]
    assert (first.rule, first.module, first.kind, first.step, first.phase) == (
        "NaN",
        "blocks.0.attn",
        "output",
        5,
        "forward",
    )
    assert "blocks.0.attn.output" in first.message
    assert [h for h in session.hits if h.step < 5] == []
    # Everything downstream of it in that forward is reported as passed on, not as an origin.
    forward = [h for h in session.hits if h.step == 5 and h.phase == "forward"]
    assert len(forward) > 5
    assert [h.module for h in forward if h.origin] == ["blocks.0.attn"]
    assert {h.module for h in forward if not h.origin} >= {
        "blocks.0.mlp.0",
        "blocks.1.attn.qkv",
        "head",
    }


@pytest.mark.parametrize("sync", MODES[1:])
def test_every_mode_finds_the_same_hits_as_eager_checks(watch, sync):
    """Batched checks read statistics once per phase; deferred checks screen a phase's tensors
    only when its outputs, loss or gradients show a problem. Once there is one, all three
    report the same hits in the same order."""
    _, eager = train_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record", sync="eager"),
                         steps=7, bad_step=5)  # fmt: skip
    _, other = train_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record", sync=sync),
                         steps=7, bad_step=5)  # fmt: skip
    key = lambda h: (h.rule, h.tensor, h.module, h.kind, h.step, h.phase, h.origin)  # noqa: E731
    assert [key(h) for h in other.hits] == [key(h) for h in eager.hits]


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_in_the_batch_is_an_input_hit_at_the_root(watch, sync):
    model = mlp()
    session = watch(model, on_hit="record", sync=sync)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    model(x)
    session.flush()
    first = session.hits[0]
    assert (first.kind, first.module, first.tensor, first.origin) == ("input", "", "input[0]", True)
    assert all(not h.origin for h in session.hits[1:])


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_made_by_a_modules_own_code_between_its_submodules_names_that_module(watch, sync):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), LogHead())
    session = watch(model, on_hit="record", sync=sync)
    model(torch.randn(6, 4))
    session.flush()
    [origin] = origins(session)
    assert (origin.module, origin.kind) == ("1", "output")
    assert not [h for h in session.hits if h.module == "1.out" and h.origin]


def test_a_non_finite_parameter_is_found_at_attach_as_a_param_of_its_module(watch):
    model = mlp()
    with torch.no_grad():
        model[2].weight[3, 1] = float("inf")
    session = watch(model, on_hit="record")
    [hit] = [h for h in session.hits if h.rule == "Overflow"]
    assert (hit.kind, hit.module, hit.tensor, hit.step) == ("param", "2", "2.weight", 0)
    # In the next forward the module it feeds is not blamed: the parameter is the origin.
    model(torch.randn(2, 4))
    assert [h for h in session.hits if h.phase == "forward" and h.origin] == []


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_made_by_backward_only_is_named_at_the_module_whose_backward_made_it(watch, sync):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfSquare(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()  # sqrt's input is 0: d sqrt(u)/du is infinite, times 0 is NaN
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[NaN()], sync=sync)
    loss = model(torch.randn(3, 4)).sum()
    session.observe("loss", loss)
    loss.backward()
    assert [h for h in session.hits if h.phase == "forward"] == []
    [origin] = origins(session)
    assert (origin.module, origin.kind, origin.phase, origin.step) == (
        "1",
        "grad_input",
        "backward",
        0,
    )
    assert {h.tensor for h in session.hits if not h.origin} >= {"0.weight.grad", "0.bias.grad"}


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_loss_from_clean_outputs_is_an_origin_at_the_observed_loss(watch, sync):
    model = mlp()
    session = watch(model, on_hit="record", sync=sync)
    out = model(torch.randn(3, 4))
    session.observe("loss", torch.log(out - 100).mean())
    session.flush()
    [hit] = session.hits
    assert (hit.kind, hit.tensor, hit.origin) == ("observed", "loss", True)


# --- pausing, raising, recording -------------------------------------------------------------


def test_raise_mode_raises_with_the_origin_hit_and_the_training_can_go_on(watch):
    model = mlp()
    session = watch(model, on_hit="raise")
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    with pytest.raises(tensordbg.WatchpointHit) as caught:
        model(x)
    assert (caught.value.hit.kind, caught.value.hit.origin) == ("input", True)
    model(torch.randn(3, 4)).sum().backward()  # the session's bookkeeping survived the raise
    assert session.capture.stack == []


def test_pause_blocks_the_training_until_resumed_and_says_how_to_inspect(watch, capfd):
    model = mlp()
    session = watch(model, on_hit="pause")
    seen = {}

    def inspect_then_resume():
        seen["hit"] = session.controller.paused_at
        seen["tensor"] = session.record(seen["hit"].ref).tensor
        session.controller.resume()

    join = when_paused(session, inspect_then_resume)
    x = torch.randn(3, 4)
    x[2, 1] = float("nan")
    model(x)
    join()
    assert seen["hit"].tensor == "input[0]"
    assert torch.isnan(seen["tensor"]).sum() == 1  # the offending tensor is there to inspect
    assert session.controller.state == "running"
    err = capfd.readouterr().err
    assert "training paused" in err and "input[0]" in err and "resume" in err


def test_a_gradient_hit_pauses_before_the_bad_update_lands(watch):
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfSquare(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="pause", rules=[NaN()])
    before = model[0].weight.detach().clone()
    seen = {}

    def inspect_then_resume():
        seen["phase"] = session.controller.paused_at.phase
        seen["weight unchanged"] = torch.equal(model[0].weight, before)
        session.controller.resume()

    join = when_paused(session, inspect_then_resume)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    join()
    assert seen == {"phase": "backward", "weight unchanged": True}


def test_a_callable_on_hit_is_called_with_each_hit(watch):
    seen = []
    model = mlp()
    session = watch(model, on_hit=seen.append)
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x)  # a NaN in the batch, passed on by every layer
    assert [h.tensor for h in seen] == [
        "input[0]",
        "0.output",
        "1.output",
        "2.output",
        "3.output",
        "4.output",
    ]
    assert seen == session.hits  # the origin and every hit passed on, in the order found


def test_a_rule_that_raises_is_disabled_with_a_warning_and_the_training_goes_on(watch):
    class Broken(Rule):
        """Always raises."""

        def check(self, t, state):
            raise ZeroDivisionError("bad rule")

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="Broken raised ZeroDivisionError"):
        session = watch(model, optimizer=optimizer, on_hit="record", rules=[Broken(), NaN()])
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    assert session.step == 3
    broken = session.rules[0]
    assert not broken.enabled and "bad rule" in broken.disabled_reason
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x)
    assert session.hits  # the other rules still work


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
@pytest.mark.parametrize("kind", ["output", "grad"])
def test_a_rule_that_answers_what_is_no_verdict_is_disabled_and_the_others_watch_on(
    watch, sync, kind
):
    """A rule whose check returned True (not a Finding) stopped all watching: its hit could
    not be made ("internal error ... stopped watching"), and the NaN the other rules would have
    found went unseen; on the gradients it raised out of attach."""

    class SaysTrue(Rule):
        kinds = frozenset({kind})

        def check(self, t, state):
            return True

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match=r"SaysTrue answered wrongly \(it returned bool") as w:
        session = watch(model, optimizer=optimizer, on_hit="record", rules=[SaysTrue(), NaN()],
                        sync=sync)  # fmt: skip
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
    assert any(r.filename == __file__ for r in w)  # the warning points at the rule's code
    assert not session.broken and not session.rules[0].enabled
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    assert [h.tensor for h in session.hits if h.origin] == ["input[0]"]


class GradNorms(Rule):
    """Notes every parameter gradient it is shown with its norm, and fires on one of them (a
    rule that speaks of finite gradients, so the engine must ask it)."""

    kinds = frozenset({"grad"})
    needs = (L2,)

    def __init__(self, fire_on: str = "2.weight.grad", **selection):
        super().__init__(**selection)
        self.fire_on = fire_on

    def check(self, t, state):
        state.setdefault("seen", []).append((t.step, t.name, t.get(L2)))
        if t.name == self.fire_on:
            return Finding(t.get(L2), 0.0, f"{t.name} was seen")
        return None

    def check_many(self, tensors, state):
        state.setdefault("batches", []).append(len(tensors))
        return super().check_many(tensors, state)


@pytest.mark.parametrize("mode", MODES)
def test_a_rule_judges_a_clean_passs_parameter_gradients_as_one_at_a_time_would(watch, mode):
    """The verdicts do not depend on whether the engine asked for them one by one or all at
    once (deferred mode asks once a pass): every gradient is seen once a step with its norm,
    and a finding names the gradient it is about."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=mode, rules=[GradNorms()])
    for step in range(3):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        norm = model[2].weight.grad.norm().item()
        optimizer.step()
        assert [(h.tensor, h.step) for h in session.hits] == [("2.weight.grad", s)
                                                              for s in range(step + 1)]  # fmt: skip
        assert session.hits[-1].value == pytest.approx(norm, rel=1e-5)
    state = session.rules[0].state
    names = sorted(f"{name}.grad" for name, _ in model.named_parameters())
    for step in range(3):
        seen = [(n, v) for s, n, v in state["seen"] if s == step]
        assert sorted(n for n, _ in seen) == names
        assert all(v is not None and v > 0 for _, v in seen)
    if mode == "deferred":
        assert state["batches"] == [len(names)] * 3  # once a pass, for all of them


def test_a_rule_whose_check_many_breaks_its_contract_is_disabled_and_the_training_goes_on(watch):
    class Short(GradNorms):
        def check_many(self, tensors, state):
            return []  # no verdict for any of them

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", sync="deferred",
                    rules=[Short(), NaN()])  # fmt: skip
    with pytest.warns(RuntimeWarning, match="Short raised ValueError: check_many gave 0"):
        model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert not session.rules[0].enabled and session.step == 1
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x)
    assert {h.rule for h in session.hits} == {"NaN"}  # the other rules still work


def test_an_internal_error_stops_watching_but_never_the_training(watch, monkeypatch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record")

    def explode(*args, **kwargs):
        raise RuntimeError("tensordbg bug")

    import sys

    for name, module in list(sys.modules.items()):  # every engine module that reads a tensor
        if name.startswith("tensordbg.engine.") and hasattr(module, "host_stats"):
            monkeypatch.setattr(module, "host_stats", explode)
    with pytest.warns(RuntimeWarning, match="internal error"):
        loss = model(torch.randn(3, 4)).sum()
    loss.backward()
    optimizer.step()
    assert session.broken
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further warning, no exception
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    # The summary a run ends with says it: no hit after step 0 is not a clean run.
    assert session.summary().endswith(
        "\n  tensordbg stopped watching at step 0 (its internal error, RuntimeError: tensordbg "
        "bug): the steps from there on were not checked, so no hit there says nothing."
    )


# --- what is watched ------------------------------------------------------------------------------


def test_a_child_named_like_a_module_method_is_watched(watch):
    """``get_submodule("half")`` finds ``nn.Module.half``, a method, and fails: attach raised
    "`half` is not an nn.Module" on such a model."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.half = nn.Linear(4, 4)  # reached through _modules: self.half is the method
            self.to = nn.Linear(4, 1)

        def forward(self, x):
            return self._modules["to"](self._modules["half"](x))

    model = Net()
    session = watch(model, on_hit="record")
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    assert [(h.tensor, h.module) for h in session.hits if h.origin] == [("input[0]", "")]
    assert {p.owner_type for p in session.weights.params.values()} == {"Linear"}


def test_forward_backward_and_optimizer_tensors_are_all_watched(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kinds = set()

    class Spy(Rule):
        """Records every kind it sees."""

        def check(self, t, state):
            kinds.add((t.kind, t.phase))

    watch(model, optimizer=optimizer, on_hit="record", rules=[Spy()])
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    optimizer.step()
    assert kinds >= {
        ("input", "forward"),
        ("output", "forward"),
        ("grad_output", "backward"),
        ("grad_input", "backward"),
        ("grad", "backward"),
        ("param", "optimizer"),
    }


def test_nested_outputs_lstm_tuples_and_dicts_are_all_watched(watch):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 8, batch_first=True)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            return {"logits": self.head(out) * 2, "state": (h, c)}  # logits: the root's own

    model = Net()
    session = watch(model, on_hit="record")
    x = torch.randn(2, 5, 4)
    x[0, 3, 1] = float("nan")
    model(x)
    names = {h.tensor for h in session.hits}
    assert {"lstm.output[0]", "lstm.output[1][0]", "lstm.output[1][1]", "head.output"} <= names
    assert "output.logits" in names  # a tensor made at the root, reached inside a dict
    [logits] = [h for h in session.hits if h.tensor == "output.logits"]
    assert (logits.module, logits.kind, logits.origin) == ("", "output", False)


def test_integer_and_bool_tensors_are_skipped(watch):
    model = nn.Embedding(10, 4)
    seen = []

    class Spy(Rule):
        """Records names."""

        def check(self, t, state):
            seen.append(t.name)

    watch(model, on_hit="record", rules=[Spy()])
    model(torch.tensor([[1, 2, 3]]))
    assert "input[0]" not in seen and "output" in seen


@pytest.mark.parametrize("sync", MODES)
def test_in_place_relu_keeps_its_input_and_output_apart(watch, sync):
    from tensordbg.statistics import MIN

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    linear_min: list[float] = []  # read before the ReLU overwrites the Linear's output
    model[0].register_forward_hook(lambda m, i, out: linear_min.append(out.min().item()))
    mins: dict[str, list[float]] = {}

    class Spy(Rule):
        """Records the minimum of every output, output gradient and parameter gradient."""

        kinds = frozenset({"output", "grad_output", "grad"})
        needs = (MIN,)

        def check(self, t, state):
            mins.setdefault(t.name, []).append(t.get(MIN))

    rules = [*default_rules(), Spy()]
    session = watch(model, optimizer=optimizer, on_hit="record", rules=rules, sync=sync)
    for _ in range(3):  # in-place ops break full backward hooks; these hooks must not break
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    session.flush()
    assert session.step == 3 and not session.broken
    # Every parameter's gradient was judged in every step, the first Linear's (behind the ReLU
    # that wrote over its output) included.
    grads = {name: len(m) for name, m in mins.items() if name.endswith(".grad")}
    assert grads == {f"{name}.grad": 3 for name, _ in model.named_parameters()}
    # The Linear's statistics are of its output as it returned it, not as the ReLU left it.
    assert mins["0.output"] == linear_min and all(m < 0 for m in linear_min)
    assert len(mins["1.output"]) == 3 and all(m >= 0 for m in mins["1.output"])
    assert len(mins["1.grad_output"]) == 3  # the ReLU's backward is watched too


@pytest.mark.parametrize("sync", MODES)
def test_a_shared_module_is_told_apart_by_call_index(watch, sync):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(4, 4)

        def forward(self, x):
            return self.block(torch.log(self.block(x)))  # the second call gets NaN input

    torch.manual_seed(0)
    model = Twice()
    session = watch(model, on_hit="record", sync=sync)
    model(torch.randn(3, 4))
    session.flush()
    by_tensor = {h.tensor: h for h in session.hits}
    assert "block#1.output" in by_tensor and by_tensor["block#1.output"].call == 1
    assert "block.output" not in by_tensor  # the first call was clean
    assert origins(session)[0].module == ""  # the log between the two calls is the root's code


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("sync", MODES)
def test_evaluation_under_no_grad_is_judged_as_its_forward_returns_and_training_goes_on(
    watch, sync, context
):
    """No backward follows a forward under no_grad or inference_mode: its hits are complete
    when it returns (no mode waits for a backward that never comes), and the training step
    after it is watched backward as usual. (Inference tensors have no version counter: reading
    one stopped the session at the first evaluation, and a later NaN went unseen.)"""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[NaN()], sync=sync)
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    with context():
        model(x)  # an evaluation batch holding a NaN; no flush() after it
    assert not session.broken
    evaluation = [(h.tensor, h.phase, h.origin) for h in session.hits]
    passed_on = [(f"{i}.output", "forward", False) for i in range(5)]
    assert evaluation == [("input[0]", "forward", True), *passed_on]
    model[4].weight.register_hook(lambda g: g * float("nan"))  # a NaN gradient, planted
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    training = [(h.tensor, h.phase) for h in session.hits[len(evaluation) :] if h.origin]
    assert training == [("4.weight.grad", "backward")]


def test_activation_checkpointing_does_not_count_a_recomputed_forward_twice(watch):
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(8, 8)
            self.c = nn.Linear(8, 1)

        def forward(self, x):
            h = checkpoint(lambda t: self.b(torch.relu(self.a(t))), x, use_reentrant=False)
            return self.c(h)

    model = Net()
    seen = []

    class Spy(Rule):
        """Records each forward tensor it sees."""

        def check(self, t, state):
            if t.phase == "forward":
                seen.append(t.name)

    session = watch(model, on_hit="record", rules=[Spy()])
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert seen.count("a.output") == 1 and seen.count("b.output") == 1
    assert not session.broken


def test_without_an_optimizer_a_step_is_a_root_forward(watch):
    model = mlp()
    session = watch(model, on_hit="record")
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")
    model(x)
    assert session.hits[0].step == 3


def test_include_and_exclude_select_modules_by_path(watch):
    model = mlp()
    seen = set()

    class Spy(Rule):
        """Records modules."""

        kinds = frozenset({"output"})

        def check(self, t, state):
            seen.add(t.module)

    watch(model, on_hit="record", rules=[Spy()], include=["", "2", "4"], exclude=["4"])
    model(torch.randn(2, 4))
    assert seen == {"", "2"}


def test_interval_computes_expensive_statistics_every_n_steps_only(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    norms = []

    class Spy(Rule):
        """Records whether the norm was computed."""

        kinds = frozenset({"grad"})
        needs = VanishingGradient.needs

        def check(self, t, state):
            if t.name == "0.weight.grad":
                norms.append(t.get(self.needs[0]) is not None)

    watch(model, optimizer=optimizer, on_hit="record", rules=[Spy()], interval=3)
    for _ in range(6):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    assert norms == [True, False, False, True, False, False]


# --- weights that do not change ------------------------------------------------------------------


def _train(model, optimizer, steps=5):
    for _ in range(steps):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("sync", ["eager", "deferred"])
@pytest.mark.parametrize("given", [True, False])
def test_a_weight_set_to_inf_by_hand_behind_a_tanh_is_found_once_at_its_step(watch, sync, given):
    """A weight set to Inf between steps 8 and 9, where a Tanh after its Linear keeps the
    model's output finite: found at the step it was set, with the optimizer given or not (then
    a step ends at the next root forward, and the parameters that changed are checked), and
    named the origin once, though it stays Inf (11 more checks find it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    session = watch(model, optimizer=optimizer if given else None, on_hit="record", sync=sync)
    for step in range(20):
        x = torch.randn(32, 8)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        session.observe("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 8:
            with torch.no_grad():
                model[0].weight[0, 0] = float("inf")
    origins = [(h.step, h.tensor) for h in session.hits if h.origin]
    assert origins == [(9 if given else 8, "0.weight")]
    again = [h for h in session.hits if h.tensor == "0.weight" and not h.origin]
    assert again and all("the update did not make it" in h.message for h in again)


def test_a_parameter_left_out_of_the_optimizer_is_flagged_after_three_steps(watch):
    model = mlp()
    forgotten = model[2]
    params = [p for name, p in model.named_parameters() if not name.startswith("2.")]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[WeightNotChanging()])
    _train(model, optimizer)
    flagged = {h.tensor: h for h in session.hits}
    assert set(flagged) == {"2.weight.update", "2.bias.update"}
    assert flagged["2.weight.update"].step == 2  # third step (0-based)
    assert forgotten.weight.grad is not None


def test_frozen_parameters_and_parameters_without_gradient_are_never_flagged(watch):
    model = mlp()
    model[0].weight.requires_grad_(False)  # frozen
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[WeightNotChanging()])
    for _ in range(5):  # the last layer's bias never gets a gradient: its output is not used
        out = model[:4](torch.randn(8, 4))
        out.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert session.hits == []


def test_a_learning_rate_of_zero_is_found_exactly_though_the_optimizer_wrote_the_weights(watch):
    model = mlp()
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2:].parameters()}],
        lr=0.1,
    )
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[WeightNotChanging()])
    _train(model, optimizer, steps=6)
    assert {h.tensor for h in session.hits} == {"0.weight.update", "0.bias.update"}


# --- gradients ---------------------------------------------------------------------------------


def test_exploding_gradients_are_flagged_long_before_anything_overflows(watch):
    import examples_path  # noqa: F401  (puts examples/ on sys.path)
    import train_diverging

    session = train_diverging.main(record=True)
    exploding = [h for h in session.hits if h.rule == "ExplodingGradient"]
    first_nonfinite = min(h.step for h in session.hits if h.rule in ("NaN", "Overflow"))
    # The learning rate jumped at step 40: the growth is above the bar at 41 and still at 42
    # (ExplodingGradient waits one step: a one-step spike is no explosion).
    assert exploding[0].step == 42
    assert exploding[0].step < first_nonfinite
    assert exploding[0].value < 1e3


def test_a_dead_branch_has_vanishing_gradients(watch):
    model = mlp()
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.fill_(-1.0)  # the second ReLU is dead: nothing reaches the first layer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[VanishingGradient()])
    _train(model, optimizer, steps=2)  # an exactly zero gradient on step 0 waits a step
    assert {h.tensor for h in session.hits} >= {"0.weight.grad", "0.bias.grad"}
    assert all(h.kind == "grad" for h in session.hits)


# --- memory and detach ----------------------------------------------------------------------------


def test_detach_removes_every_hook_and_frees_every_reference(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record")
    x = torch.randn(3, 4)
    out = model(x)
    out.sum().backward()
    optimizer.step()
    tracked = weakref.ref(out)
    session.detach()
    del out
    gc.collect()
    assert tracked() is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert session.records == []
    tensordbg.attach(model, server=False).detach()  # attachable again


def test_the_context_manager_detaches(watch):
    model = mlp()
    with tensordbg.attach(model, server=False, on_hit="record") as session:
        model(torch.randn(2, 4))
    assert session.detached
    assert all(not m._forward_hooks for m in model.modules())


def test_eager_checks_keep_hits_and_recent_tensors_yet_show_what_the_training_holds(watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), *(nn.Linear(8, 8) for _ in range(10)), Log())
    seen: dict[str, tuple[bool, bool]] = {}

    def on_hit(hit):
        if not seen:  # at the origin, inside the hook: where an eager pause would be
            seen.update({r.stats.name: (r.tensor is not None, r.held() is not None)
                         for r in session.records})  # fmt: skip

    session = watch(model, on_hit=on_hit, sync="eager")
    model(torch.randn(16, 4)).nan_to_num().sum().backward()
    names = list(seen)
    assert names[-1] == "12.output" and seen["12.output"] == (True, True)  # the hit
    strong = [name for name in names if seen[name][0]]
    assert strong == names[-EAGER_WINDOW:]  # the hit and the tensors just before it
    assert seen["1.output"] == (False, True)  # older, passed: not kept, but autograd saved it
    assert not any(r.tensor is not None for r in session.records)  # all let go at phase end


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_nothing_is_kept_across_steps_and_the_retention_budget_is_kept(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", retain_bytes=200, sync="batched")
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert all(r.tensor is None for r in session.records)  # released at the end of the phase
    assert session.phases.retained == 0
    kept = []
    session.subscribe(lambda event, payload: kept.append(session.record(payload["ref"]).tensor)
                      if event == "hit" else None)  # fmt: skip
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    assert kept[0] is not None  # the batch (48 bytes), first of the phase: within the budget
    assert kept[1] is None  # the next hit, 0.output (192 bytes), is past it


def test_attaching_twice_or_after_compile_says_what_to_do(watch):
    model = mlp()
    watch(model)
    with pytest.raises(RuntimeError, match="already attached"):
        tensordbg.attach(model, server=False)
    compiled = torch.compile(mlp())
    with pytest.raises(TypeError, match=r"attach tensordbg before torch\.compile"):
        tensordbg.attach(compiled, server=False)


def test_fullgraph_compile_of_a_watched_model_says_why_it_cannot(watch):
    """torch.compile(model, fullgraph=True) after attach failed at the first call with dynamo's
    "Skip calling torch.compiler.disable()'d function ... Capture.on_enter (reason: None)": a
    script that runs bare crashed on tensordbg's internals with no word of what to do."""
    model = mlp()
    watch(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"cannot compile a model tensordbg watches") as raised:
        compiled(torch.randn(3, 4))
    assert "Compile without fullgraph=True" in str(raised.value)


def test_a_watched_model_compiled_after_attach_is_watched_and_warns_of_nothing_of_ours(watch):
    """The hooks skip dynamo's disable wrapper where nothing is compiled (marks.py); a model
    compiled after attach still runs them at its graph breaks, through that wrapper, and the
    first version of the skip made dynamo warn that it cannot trace one of our calls."""
    torch.manual_seed(0)
    model = mlp()
    session = watch(model, on_hit="record")
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.full((3, 4), float("nan"))).sum().backward()
    assert not [w for w in caught if "tensordbg" in str(w.message) or "Dynamo" in str(w.message)]
    assert any(hit.origin and hit.kind == "input" for hit in session.hits), session.hits


def test_warnings_are_not_raised_for_a_healthy_run(watch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record"), steps=3)


# --- deferred checks ------------------------------------------------------------------------------


def test_deferred_checks_leave_a_clean_phase_unscreened_and_screen_a_bad_one_in_full(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", sync="deferred")
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert "0.output" not in session.latest  # clean outputs and gradients: nothing else read
    assert "0.weight.grad" in session.latest  # gradients are always read
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x)
    assert "0.output" in session.latest  # the bad forward was screened module by module
    assert origins(session)[0].kind == "input"


def test_a_nan_masked_before_it_reaches_outputs_loss_or_gradients_is_seen_by_eager_checks_only(
    watch,
):
    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x)  # NaN where x < 0 ...

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.log = Log()

        def forward(self, x):
            h = self.log(self.inner(x))
            return torch.where(torch.isnan(h), torch.zeros_like(h), h)  # ... masked at once

    seen = {}
    for sync in ("eager", "deferred"):
        torch.manual_seed(0)
        model = Masked()
        session = watch(model, on_hit="record", sync=sync, rules=[NaN()])
        model(torch.randn(8, 4)).sum().backward()
        session.flush()
        seen[sync] = {(h.tensor, h.origin) for h in session.hits}
        session.detach()
    assert seen["eager"] == {("log.output", True)}
    assert seen["deferred"] == set()  # the documented price of deferred checks


def test_a_detach_from_another_thread_mid_step_stops_everything_there(watch):
    model = mlp()
    session = watch(model, on_hit="pause")

    join = when_paused(session, session.controller.detach)  # what the UI's q does
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()  # hooks placed on this step's graph must stay silent
    join()
    assert session.detached
    assert [h.tensor for h in session.hits] == ["input[0]"]
    assert all(not m._forward_hooks for m in model.modules())


class _InPlaceBlock(nn.Module):
    """A block with an in-place activation, a module called twice and a tensor keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.shared = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict:
        h = self.shared(self.act(self.fc(x)))
        h = self.shared(h * scale)
        return {"out": h, "aux": (h.sum(),)}


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_InPlaceBlock() for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full((4,), 0.5)
        for block in self.blocks:
            x = block(x, scale=scale)["out"]
        return self.head(x)


def _what_the_forward_recorded(session) -> list[tuple]:
    session.materialize_forward()  # a clean deferred forward makes its records when asked
    return [
        (r.stats.name, r.version, r.hidden, r.grad_hooked,
         r.producer.path if r.producer else None, [c.path for c in r.consumers],
         [c.path for c in r.passed_up])
        for r in session.phases.records
    ]  # fmt: skip


@pytest.mark.parametrize("retain_bytes", [256 * 2**20, 64])
def test_noted_module_calls_are_replayed_into_the_records_the_hooks_would_have_made(
    watch, monkeypatch, retain_bytes
):
    """Deferred mode only notes a forward's module calls in its hooks and turns them into calls
    and records when the root returns (or when the noted tensors pass the budget: 64 bytes
    replays at nearly every hook). The records must be those the hooks make one by one:
    versions of in-place ops, calls of a shared module, inputs made between modules."""
    recorded = []
    for noted in (True, False):
        torch.manual_seed(0)
        model = _Nested()
        session = watch(model, sync="deferred", retain_bytes=retain_bytes, rules=[NaN()])
        if not noted:
            monkeypatch.setattr(session, "logs_forward", frozenset)
        assert bool(session.logs_forward()) is noted
        x = torch.randn(3, 4)
        out = model(x)
        recorded.append((_what_the_forward_recorded(session), out.detach()))
        out.sum().backward()
        session.detach()
    (logged, out_logged), (direct, out_direct) = recorded
    assert logged == direct
    assert torch.equal(out_logged, out_direct)
    names = [name for name, *_ in logged]
    assert "blocks.0.fc.output" in names and "blocks.0.act.output" in names  # one per version
    assert "blocks.1.shared#1.output" in names


class _DetachedBetween(nn.Module):
    """Its own code changes a module's output between two calls without a new version."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.a, self.b, self.seen = nn.Linear(4, 4), nn.Linear(4, 2), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.seen.append(("a", h._version, h.grad_fn))
        h.detach_()  # the same tensor, the same version: it needs no gradient any more
        self.seen.append(("b", h._version, h.grad_fn))
        return self.b(h)


def test_a_tensor_noted_again_is_noted_as_it_is_then(watch):
    """A call's input that the call before returned is taken from what its hook noted (2 reads
    instead of 8): only while it is the same tensor as it was. ``detach_()`` keeps the version
    and drops the gradient's edge: the second note must say it needs none."""
    seen: list = []
    model = _DetachedBetween(seen)
    session = watch(model, sync="deferred", rules=[NaN()])
    noted: list = []
    note = session.capture._note
    session.capture._note = lambda leaves: noted.append(note(leaves)) or noted[-1]
    model(torch.randn(3, 4))
    edges = [(s[0][3] if s else None) for s in noted]  # a's input, a's output, b's input, ...
    assert seen[0][2] is not None and seen[1][2] is None and seen[0][1] == seen[1][1]
    assert edges[1][0] is seen[0][2]  # a's output: made by a's Linear
    assert edges[2] is False  # b's input: the same tensor, detached since


def test_float16_activations_are_handled_in_their_hooks_where_their_range_rules_speak(watch):
    """The Overflow rule reads a float16 activation's range: a deferred forward is not only
    noted then, so the hit comes in the hook of the module that came near the float16 maximum,
    before the next module runs (noted, it would come when the root returned)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Identity()).half()
    ran: list[str] = []
    model[2].register_forward_pre_hook(lambda module, args: ran.append("2"))
    at_hit: list[list[str]] = []
    session = watch(model, sync="deferred", on_hit=lambda hit: at_hit.append(list(ran)))
    with torch.no_grad():
        model[1].weight.fill_(1.0)
        model[1].bias.fill_(60000.0)
    model(torch.ones(2, 4, dtype=torch.float16))
    assert any(h.module == "1" and h.rule == "Overflow" for h in session.hits)
    assert at_hit and at_hit[0] == []  # module 2 had not run yet


def test_an_update_is_recorded_when_it_is_news_and_weight_not_changing_sees_every_streak(watch):
    """WeightNotChanging asks of an update only whether it changed the parameter: a parameter
    that keeps changing is recorded once, and again at each step it did not change and at the
    first step it changes again; the rule still fires once per streak, at the right step. (The
    first step at learning rate 0, step 4, is measured: a group at a learning rate of 0 is
    foreseen to leave its parameters be, so they are copied before it. Steps 4, 5 and 6 are
    unchanged: the rule's third step is step 6. Before, step 4 went unmeasured and the rule
    fired a step late, at step 7.)"""
    session, made, _ = _update_records(watch, [0.0 if 4 <= s < 10 else 0.1 for s in range(12)])
    both = ["bias", "weight"]
    assert made == [both, [], [], [], *[both] * 6, both, []]
    assert sorted((h.step, h.tensor) for h in session.hits) == [
        (6, "bias.update"), (6, "weight.update")
    ]  # fmt: skip


def test_an_update_nothing_measured_is_news_when_the_parameter_is_next_seen_changing(watch):
    """Step 0 moves the parameters within the tolerance: no copy was taken, the norm did not
    move, so nothing is measured and no record is made; they become suspects, copied before
    step 1. Step 1 changes them: that is news (a record saying so), and they are suspects no
    more; step 2 changes them as before: no record."""
    _, made, suspects = _update_records(watch, [1e-12, 0.1, 0.1])
    assert made == [[], ["bias", "weight"], []]
    assert suspects == [{"weight", "bias"}, set(), set()]


def test_with_batched_checks_a_parameter_that_changes_is_not_copied_every_other_step(watch):
    """Batched checks (the default on CUDA) know a parameter's digest only after the phase's
    transfer: a step whose digest moved is no suspect, and the next step copies nothing."""
    _, _, suspects = _update_records(watch, [0.1] * 4, sync="batched")
    assert suspects[1:] == [set(), set(), set()]


def _update_records(watch, learning_rates: list[float], sync: str = "auto"):
    """A Linear trained with SGD, a step per learning rate, watched by WeightNotChanging: the
    session, and at each step which parameters got an update record and which are suspects."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # decayed=0: a learning rate set to 0 stops the parameter here, which the rule would
    # otherwise take for a schedule's tail (these tests are of the records, not of that).
    session = watch(model, optimizer=optimizer, on_hit="record",
                    rules=[WeightNotChanging(decayed=0.0)], sync=sync)  # fmt: skip
    made, suspects = [], []
    for lr in learning_rates:
        for group in optimizer.param_groups:
            group["lr"] = lr
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        made.append(sorted(r.param for r in session.phases.records if r.stats.kind == "update"))
        suspects.append(set(session.weights.suspects))
    return session, made, suspects


@pytest.mark.parametrize("sync", ["eager", "deferred"])
@pytest.mark.parametrize("exact", [False, True])
def test_a_table_that_changes_where_its_norm_cannot_tell_is_compared_from_a_sample(
    watch, exact, sync
):
    """Adam moves every row of an embedding by about its learning rate, in directions that
    leave the table's norm where it was within MindInsight's tolerance (rtol 1e-5). Eager
    checks digest a parameter by its norm, which cannot tell that it changed, so it is a
    suspect every other step; once a full copy showed that a sample of its elements tells, a
    sample is taken before the step instead of a copy of the table. Deferred checks digest it
    by a sample of its elements, which tells at every step that it moved, as the norm does
    with the default, exact test: nothing is copied or sampled. When it stops changing
    (learning rate 0 from step 8, foreseen before the step), the table is copied whole before
    each step (a sample proves only a change), and WeightNotChanging fires on the third
    unchanged step, step 10, in every case (before: step 11, or 12 when a sample could not
    tell step 9)."""
    torch.manual_seed(0)
    model = nn.Embedding(1000, 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    # decayed=0: the learning rate set to 0 is what stops it (not a schedule's tail).
    tolerance = {} if exact else {"rtol": 1e-5, "atol": 1e-8}
    rule = WeightNotChanging(decayed=0.0, **tolerance)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[rule], sync=sync)
    taken: list[tuple[set[str], set[str]]] = []
    before_step = session.weights.before_step

    def spy(*args, **kwargs):
        before_step(*args, **kwargs)
        taken.append((set(session.weights.snapshots), set(session.weights.samples)))

    session.weights.before_step = spy
    for step in range(14):
        for group in optimizer.param_groups:
            group["lr"] = 1e-4 if step < 8 else 0.0
        model(torch.randint(0, 1000, (32,))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    copies = [step for step, (copied, _) in enumerate(taken) if copied]
    samples = [step for step, (_, sampled) in enumerate(taken) if sampled]
    if exact or sync == "deferred":
        assert (copies, samples) == ([8, 9, 10, 11, 12, 13], [])
        assert [(h.step, h.tensor) for h in session.hits] == [(10, "weight.update")]
        return
    assert copies == [1, 8, 9, 10, 11, 12, 13]  # step 1: the first comparison; then from 8
    assert samples == [3, 5, 7]
    assert [(h.step, h.tensor) for h in session.hits] == [(10, "weight.update")]


def test_a_sample_of_a_parameter_proves_a_change_and_nothing_else():
    """A parameter whose norm did not move past the tolerance is compared with its copy from
    before the step: a sample first, every element only when no sampled element moved."""
    from tensordbg.engine.params import sample_moved

    torch.manual_seed(0)
    before = torch.randn(1000)
    after = before.clone()
    after[500] += 1.0  # not among the sampled elements (every 15th): no proof either way
    assert not sample_moved(after, before, 1e-5, 1e-8)
    after[15] += 1.0
    assert sample_moved(after, before, 1e-5, 1e-8)
    within = before + before.abs() * 1e-6  # every element within rtol * |before|
    assert not sample_moved(within, before, 1e-5, 1e-8)
    nan = before.clone()
    nan[0] = float("nan")
    assert not sample_moved(nan, before, 1e-5, 1e-8)  # a NaN proves nothing


@pytest.mark.parametrize("vouched", [False, True])
def test_deferred_keeps_the_bad_activation_gradient_and_says_why_a_clean_one_is_not_kept(
    watch, vouched
):
    """Deferred mode keeps an activation gradient only when it is not finite (holding them all
    until the pass ends made every step fault in fresh memory). One read in its hook can be
    inspected at the hit; one a parameter's gradient vouched for (and so never read) says why
    it was not kept, and so does a clean one."""
    from tensordbg.sources.contract import SourceError
    from tensordbg.sources.live import LiveSource

    torch.manual_seed(0)
    # sqrt's backward makes NaN in the gradient of its input: the first Linear's output, which
    # that Linear's bias vouches for; behind a ReLU (which drops a NaN), nothing does.
    first = [nn.Linear(4, 4)] if vouched else [nn.Linear(4, 4), nn.ReLU()]
    model = nn.Sequential(*first, SqrtOfSquare(), nn.Linear(4, 2))
    sqrt = str(len(first))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    seen = []

    def at_hit(hit):
        if not hit.origin:
            return
        source = LiveSource(session)
        clean = next(r for r in session.phases.records if r.stats.name == f"{sqrt}.grad_output")
        assert clean.stats.values and not clean.conditions
        with pytest.raises(SourceError, match="keep an activation gradient only when it is not"):
            source.stats(clean.stats.ref, "")
        if vouched:
            with pytest.raises(SourceError, match=r"judge this gradient from 0\.bias's gradient"):
                source.stats(hit.ref, "")
        else:
            seen.append(source.stats(hit.ref, "")["line"])

    session = watch(model, on_hit=at_hit, rules=[NaN()], sync="deferred")
    model(torch.randn(3, 4)).sum().backward()
    [origin] = origins(session)
    assert (origin.module, origin.tensor) == (sqrt, f"{sqrt}.grad_input[0]")
    if not vouched:
        [line] = seen
        assert "nan" in line.lower()


@pytest.mark.parametrize("finished", [False, True])
def test_a_ui_is_told_whether_the_training_finished_or_goes_on_unwatched(watch, finished):
    """detach() from the UI's q lets the training go on unwatched; the end of the script (the
    runner, the demo, interpreter exit) is ``finished``: a UI said DETACHED for both."""
    model = mlp()
    session = watch(model)
    heard = []
    session.bus.subscribe(lambda event, payload: heard.append(payload["state"]), events={"state"})
    model(torch.randn(2, 4))
    session.detach(finished=finished)
    assert heard[-1] == ("finished" if finished else "detached")


@pytest.mark.parametrize("sync", ["eager", "batched", "deferred"])
def test_a_recheck_at_a_pause_makes_no_hit_twice_and_keeps_passed_on_hits_so(sync):
    """A recheck while paused at a deferred phase's origin judged the hits the phase had still
    to make after the pause (its downstream tensors): each came twice, the recheck's copy
    without its "passed on" sentence (the demo's Rules tab counted 17 NaN hits for 2)."""
    rechecked: list[list] = []

    def on_hit(hit) -> None:
        if not rechecked:
            rechecked.append(session.recheck())

    def attach(model, optimizer):
        nonlocal session
        session = tensordbg.attach(model, optimizer=optimizer, on_hit=on_hit, server=False,
                                   sync=sync)  # fmt: skip
        return session

    session = None
    run = run_gpt(attach, steps=6, bad_step=4)
    run.session.detach()
    hits = run.session.hits
    assert rechecked == [[]]  # nothing was missed: the rules did not change
    twice = [(h.step, h.tensor, h.rule) for h in hits]
    assert len(twice) == len(set(twice)), sorted(t for t in twice if twice.count(t) > 1)[:4]
    downstream = [h for h in hits if not h.origin and h.kind == "output"]
    assert downstream and all("passed on" in h.message for h in downstream)
    weights = [h for h in hits if h.kind == "param"]  # the update wrote the gradient's NaN in
    assert weights and all("from the gradient, which held it already" in h.message
                           for h in weights if h.step == 4)  # fmt: skip
    assert all("before this update already, since step 4" in h.message  # NaN since then
               for h in weights if h.step > 4)  # fmt: skip


def test_an_optimizer_that_stops_stepping_is_said_once_with_how_steps_are_counted(watch, capsys):
    """Two optimizers; from loop step 2 the first no longer steps. The steps are then counted
    as each of the second's begins (its forward and backward in the step before), which
    nothing said: a hit was one step behind the script's own counter without a word."""
    model = mlp()
    first = torch.optim.SGD(model[:2].parameters(), lr=0.01)
    second = torch.optim.SGD(model[2:].parameters(), lr=0.01)
    session = watch(model, optimizer=[first, second], on_hit="record")
    for step in range(5):
        model(torch.randn(3, 4)).sum().backward()
        if step < 2:
            first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    said = [line for line in capsys.readouterr().err.splitlines() if "stepped again" in line]
    assert said == [
        "tensordbg: step 2: optimizer 2 of 2 (SGD) stepped again before optimizer 1 of 2 (SGD) "
        "did: from now on a step ends with each step of optimizer 1 of 2 (SGD), and while that "
        "one does not step, as each step of optimizer 2 of 2 (SGD) begins (its forward and "
        "backward count in the step before)."
    ]
    assert session.step == 4


def test_the_same_finding_at_every_step_has_one_origin_its_first_step(watch):
    """A learning rate of 1e6 makes the gradients explode at every step: the summary counted
    217 origins in 39 steps for one cause. A rule firing on a tensor at every step since an
    earlier one is at its origin there, once; a step without it ends the streak."""
    from tensordbg.rules import TensorRange

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    session = watch(model, optimizer=optimizer, on_hit="record",
                    rules=[TensorRange(match="input[[]0]", max_gt=5.0)])  # fmt: skip
    for step in range(5):
        x = torch.randn(3, 4)
        x[0, 0] = 1.0 if step == 2 else 9.0  # above the range but at step 2
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    hits = [(h.step, h.origin) for h in session.hits]
    assert hits == [(0, True), (1, False), (3, True), (4, False)]
    assert session.hits[1].message.endswith("So at every step since step 0, where it began.")


@pytest.mark.parametrize("clips", [True, False])
def test_a_gradient_hit_says_when_the_script_clipped_the_gradient_before_the_update(watch, clips):
    """ExplodingGradient judges the gradients the backward made and advises clipping; a script
    that clips them before the update was told so as if tensordbg had not seen it."""
    from tensordbg.rules import ExplodingGradient

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    session = watch(model, optimizer=optimizer, on_hit="record",
                    rules=[ExplodingGradient(max_norm=1e-6)])  # fmt: skip
    model(torch.randn(3, 4)).sum().backward()
    if clips:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-9)
    optimizer.step()
    said = [h for h in session.hits if "The script then changed it before the update" in h.message]
    assert bool(said) == clips
    assert all(h.message.endswith("(as clip_grad_norm_ does).") for h in said)


def test_parameters_the_optimizer_steps_that_are_not_watched_are_said_once(watch, capsys):
    """A layer appended to the model after attach, its parameters added to the optimizer,
    and a loss weight that is no parameter of the model: none is watched, and nothing said so;
    an Inf set into the new layer was named at its parent with "this module's inputs and
    parameters were clean"."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    scale = nn.Parameter(torch.ones(()))  # a learnable loss weight, not the model's
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record")
    for step in range(4):
        if step == 2:
            model.append(nn.Linear(8, 2))
            opt.add_param_group({"params": list(model[2].parameters())})
        if step == 3:
            with torch.no_grad():
                model[2].weight[0, 0] = float("inf")
        (model(torch.randn(3, 4)).sum() * scale).backward()
        opt.step()
        opt.zero_grad()
    hit = next(h for h in session.hits if h.origin)
    assert (hit.step, hit.tensor) == (3, "output")
    assert (
        "Its inputs and the parameters tensordbg watches were clean, but parameters added "
        "after attach, which it does not watch, hold NaN or Inf: 2.weight."
    ) in hit.message
    said = [line for line in capsys.readouterr().err.splitlines() if "does not watch" in line]
    assert said == [
        "tensordbg: the optimizer steps 1 parameter tensordbg does not watch: 1 that is not the "
        "model's. Their values, gradients, updates and modules are not checked (tensordbg "
        "watches what the model held when it attached).",
        "tensordbg: the optimizer steps 2 parameters tensordbg does not watch: 2.bias, 2.weight, "
        "added to the model after attach. Their values, gradients, updates and modules are not "
        "checked (tensordbg watches what the model held when it attached).",
    ], said


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_the_steps_gradient_norm_is_that_of_the_gradients_the_step_gets(watch, sync):
    """With four micro-batches of gradient accumulation, the Run tab's gradient norm summed the
    squares of every pass's partly accumulated gradients: 7.34 where clip_grad_norm_ gave 4.76."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    for _ in range(2):
        for _ in range(4):
            (model(torch.randn(4, 8)).pow(2).mean() / 4).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        opt.step()
        opt.zero_grad()
        assert session.metrics.last()["grad_norm"] == pytest.approx(norm, rel=1e-5)
