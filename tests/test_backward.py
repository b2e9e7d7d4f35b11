"""The backward phase in deferred mode: a bias's gradient vouches for its module's output
gradient (which is then not read), through the activations after it and for the very same tensor
seen again (a residual stream's), and whatever way the pass goes, a NaN is still found at the
module whose backward made it, as eager mode finds it."""

from __future__ import annotations

import re
import time

import pytest
import torch
from conftest import DEFERRED_ON_DEVICE
from models import SqrtOfSquare
from torch import nn

from tensordbg.engine import backward, param_grads
from tensordbg.engine.vouching import PASSES_NONFINITE_ON, Vouchers
from tensordbg.rules import NaN

MODES = ("eager", "batched", "deferred", DEFERRED_ON_DEVICE)


def nan_in_backward() -> nn.Sequential:
    """sqrt's input is 0: its backward makes NaN, which reaches the first Linear's output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfSquare(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    return model


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def reads(monkeypatch) -> list[torch.Size]:
    """The shapes of the gradients the backward phase reads in its hooks, as they come."""
    read: list[torch.Size] = []
    real = backward.host_stats
    monkeypatch.setattr(backward, "host_stats", lambda t, s: read.append(t.shape) or real(t, s))
    return read


def norm_passes(monkeypatch) -> list[int]:
    """How many gradients each norm pass of the backward phase reads, as they come."""
    passes: list[int] = []
    real = param_grads.norms_of
    monkeypatch.setattr(param_grads, "norms_of", lambda ts: passes.append(len(ts)) or real(ts))
    return passes


def test_a_clean_pass_reads_in_its_hooks_only_the_gradients_nothing_vouches_for(watch, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16))
    read, passes = reads(monkeypatch), norm_passes(monkeypatch)
    session = watch(model, on_hit="record", sync="deferred")
    model(torch.randn(3, 4)).sum().backward()
    # ReLU's output gradient: a ReLU's backward drops a NaN where its input was negative, so
    # the first Linear's bias does not vouch for it: read in its hook. Both Linears' outputs and
    # the LayerNorm's (the model's) are vouched for by their biases: not read, nor hooked. The
    # six parameter gradients are read once, at the end of the pass, in one norm pass.
    assert read == [torch.Size([3, 16])]
    assert passes == [6]
    assert session.hits == []


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("how", ["bias", "frozen bias", "autograd.grad"])
def test_a_backward_nan_is_named_at_its_origin_however_the_bias_gradient_goes(watch, sync, how):
    """The bias gradient is NaN (it vouches for nothing), never comes (``torch.autograd.grad``
    accumulates no parameter gradient), or is not computed (a frozen bias): the first Linear's
    output gradient is then read, and the origin is the same in every mode."""
    model = nan_in_backward()
    if how == "frozen bias":
        model[0].bias.requires_grad_(False)
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    loss = model(torch.randn(3, 4)).sum()
    if how == "autograd.grad":  # the gradient is returned, no .grad accumulates
        [grad] = torch.autograd.grad(loss, [model[0].weight])
        assert grad.isnan().all()
    else:
        loss.backward()
    [origin] = [h for h in session.hits if h.origin]
    assert (origin.module, origin.kind, origin.phase) == ("1", "grad_input", "backward")
    passed_on = {h.tensor for h in session.hits if not h.origin}
    assert origin.tensor == "1.grad_input[0]"  # the first Linear's output gradient
    assert origin.message.startswith("1.grad_input[0] holds")  # its sentence says the same
    expected = {
        "bias": {"0.weight.grad", "0.bias.grad"},
        "frozen bias": {"0.weight.grad"},
        "autograd.grad": set(),  # no .grad is made
    }
    assert passed_on == expected[how]


class PassThrough(nn.Module):
    """Returns its input itself: it runs no backward of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("made_by", ["module", "functional"])
def test_a_module_that_returns_its_input_is_never_a_backward_origin(watch, sync, made_by):
    """A module handing its input on unchanged (an identity, a wrapper) shares that tensor with
    the next module's input: the gradient that arrives is made by the next module's backward,
    and is named there, in every mode, not at the pass-through ("produced by this module's
    backward") whether the tensor came from a module or from code between modules."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.keep, self.sqrt = nn.Linear(4, 4), PassThrough(), SqrtOfSquare()
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) if made_by == "module" else torch.relu(self.a(x))
            return self.head(self.sqrt(self.keep(h)))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.a.weight.zero_()
        model.a.bias.zero_()  # sqrt's input is 0: its backward makes NaN
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    model(torch.randn(3, 4)).sum().backward()
    [origin] = [h for h in session.hits if h.origin]
    assert (origin.module, origin.kind) == ("sqrt", "grad_input")
    assert origin.tensor == "sqrt.grad_input[0]"
    assert not re.search(r"\bkeep\b", origin.message), origin.message  # ("keeps" may be said)


def test_only_modules_whose_backward_sums_into_their_bias_are_trusted():
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # the bias is not summed so
            return super().forward(x) * 2

    class Plain(nn.Linear):  # its forward is Linear's own
        pass

    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.Linear(4, 4, bias=False),
        Scaled(4, 4),
        Plain(4, 4),
        nn.Conv1d(1, 1, 3),
        nn.BatchNorm1d(4),
        nn.Embedding(4, 4),
    )
    assert Vouchers(model, 2**20).bias_of == {
        "0": "0.bias",
        "3": "3.bias",
        "4": "4.bias",
        "5": "5.bias",
    }


def test_a_bias_vouches_through_activations_and_for_a_residual_stream(watch, monkeypatch):
    """GELU's and Dropout's output gradients are vouched for by the Linear's bias before them;
    the residual block's output gradient reaches its inner Linear's output whole (the addition
    hands it on), which that Linear's bias vouches for. None is read in a hook; the first
    Linear's input (the model's input) needs no gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 16), nn.GELU(), nn.Dropout(0.1), Residual(16), nn.Linear(16, 16),
        nn.LayerNorm(16),
    )  # fmt: skip
    read = reads(monkeypatch)
    session = watch(model, on_hit="record", sync="deferred")
    model(torch.randn(3, 4)).sum().backward()
    assert read == []
    assert session.hits == []


@pytest.mark.parametrize("kind", PASSES_NONFINITE_ON, ids=lambda k: k.__name__)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_each_activation_a_bias_vouches_through_keeps_a_nonfinite_gradient(kind, bad):
    """Every element of the input's gradient stays non-finite when every element of the
    output's is: where the derivative is 0 (tanh of 30, GELU of -30), where dropout drops."""
    torch.manual_seed(0)
    module = kind(0.5) if "Dropout" in kind.__name__ else kind()
    dims = {"Dropout2d": 4, "Dropout3d": 5}.get(kind.__name__, 3)
    x = (torch.randn((2, 3, 4, 5, 6)[:dims]) * 30).requires_grad_()
    module.train()
    y = module(x)
    y.backward(torch.full_like(y, bad))
    assert not x.grad.isfinite().any()


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("behind", ["gelu", "residual"])
def test_a_backward_nan_behind_an_activation_or_a_residual_is_named_in_every_mode(
    watch, sync, behind
):
    """sqrt's backward makes NaN in the gradient of a GELU's output (vouched for by the Linear
    before it) or of a residual block's (the same tensor as its inner Linear's output's): the
    bias gradient is NaN, the held gradient is read, and every mode names sqrt."""
    torch.manual_seed(0)
    middle = nn.GELU() if behind == "gelu" else Residual(4)
    model = nn.Sequential(nn.Linear(4, 4), middle, SqrtOfSquare(), nn.Linear(4, 2))
    with torch.no_grad():
        for p in [*model[0].parameters(), *middle.parameters()]:
            p.zero_()  # sqrt's input is 0: its backward makes NaN
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    model(torch.randn(3, 4)).sum().backward()
    [origin] = [h for h in session.hits if h.origin]
    assert (origin.module, origin.tensor) == ("2", "2.grad_input[0]")


class _SqrtBetween(nn.Module):
    """Its own code, between its two Linears, takes sqrt(w * w) at w = 0: a finite forward, a
    NaN (0/0) in backward, made by no module's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.l1(z)
        w = h * (torch.arange(16) % 2)
        return self.l2(torch.relu(torch.sqrt(w * w)))


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("layout", ["root", "child", "gan"])
def test_a_backward_nan_made_by_a_modules_own_code_is_named_at_that_module(watch, sync, layout):
    """Every hit was "passed on from upstream" and none the origin (163 hits and no origin in a
    GAN): the gradient of l1's output is the first NaN, and no module took l1's output (the
    parent's own code did). That code is where it was made: its output gradient was clean."""
    torch.manual_seed(0)
    g = _SqrtBetween()
    d = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    model = g if layout == "root" else nn.ModuleDict({"G": g, "D": d})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # one step: the root forwards'
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[NaN()], sync=sync)
    z = torch.randn(4, 8)
    if layout == "gan":
        d(torch.randn(4, 2))  # the critic on real data: a root forward of its own
        d(g(z)).mean().backward()
    else:
        g(z).pow(2).mean().backward()
    [origin] = [h for h in session.hits if h.origin]
    prefix = "" if layout == "root" else "G."
    where = (f"{prefix}l1.grad_output", prefix.rstrip("."), "backward")
    assert (origin.tensor, origin.module, origin.phase) == where
    own = "the model's" if layout == "root" else "this module's"
    assert f"It was produced in backward by {own} own code between its submodules" in (
        origin.message
    )


def test_a_pause_asked_while_a_clean_pass_is_judged_lists_each_parameter_gradient():
    """A clean pass's parameter gradients are judged without records (param_grads.py: they
    cost ~0.5 ms a step); a pause asked while their rules run (a person pressing pause in the
    UI then) still lists each of them, as the phase's own records, judged and finite."""
    import threading

    import tensordbg
    from tensordbg.rules import Rule, default_rules
    from tensordbg.statistics import FINITE, L2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    held: dict[str, tensordbg.Session] = {}

    class PressesPause(Rule):
        """Stands for the person: asks for a pause while step 3's gradients are judged."""

        kinds = frozenset({"grad"})
        needs = (L2,)

        def check(self, t, state):
            if t.step == 3 and t.name == "2.weight.grad":
                held["session"].controller.request_pause()
            return None

    done = threading.Event()

    def train() -> None:
        session = held["session"] = tensordbg.attach(
            model, optimizer=optimizer, rules=[*default_rules(), PressesPause()], server=False
        )
        try:
            for _ in range(5):
                model(torch.randn(16, 4)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        finally:
            session.detach()
            done.set()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not ("session" in held and held["session"].controller.state == "paused"):
        assert time.monotonic() < deadline and not done.is_set(), "never paused"
        time.sleep(0.01)
    session = held["session"]
    try:
        grads = {r.param: r for r in session.records if r.stats.kind == "grad" and r.param}
        assert session.phase == "backward" and session.step == 3
        assert set(grads) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for record in grads.values():
            assert record.judged and record.stats.values[FINITE] == 1.0 and record.stats.ref >= 0
            assert record.stats.values[L2] == pytest.approx(float(record.held().norm()))
    finally:
        session.controller.resume()
    assert done.wait(30)
