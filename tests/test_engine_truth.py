"""The engine tells the truth and survives its users: origins in common set-ups (attention,
GANs, a parent's own code, sparse gradients), scripts that save, copy and fork, and requests or
signals that must not hurt the training."""

from __future__ import annotations

import copy
import io
import math
import multiprocessing
import os
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import zygote
from conftest import DEADLINE, DEFERRED_ON_DEVICE, wait_until
from models import mlp
from paused import PausedTraining
from torch import nn

import tensordbg
from tensordbg.engine.control import NotPaused
from tensordbg.rules import NaN, Overflow
from tensordbg.sources.contract import SourceError
from tensordbg.sources.live import LiveSource
from tensordbg.sources.slicing import (
    MAX_TEXT,
    SliceError,
    apply_index,
    parse_index,
    result_shape,
)
from tensordbg.statistics.registry import FINITE

MODES = ("eager", "batched", "deferred", DEFERRED_ON_DEVICE)


class NaNBackward(nn.Module):
    """The identity in forward; its backward makes NaN (sqrt's derivative at 0 is 1/0, times 0),
    as ``sqrt(x * x)`` at 0 does: a finite forward, a bad backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x * 0)


def origins(session, phase=None):
    return [(h.tensor, h.kind) for h in session.hits
            if h.origin and (phase is None or h.phase == phase)]  # fmt: skip


# --- origins that are true ------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.bad = NaNBackward()
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        h = self.inp(x)
        h, _ = self.attn(h, h, h)
        return self.head(self.bad(h))


@pytest.mark.parametrize("sync", MODES)
def test_a_parameter_used_through_a_functional_call_is_no_origin_of_what_flowed_into_it(
    watch, sync
):
    """MultiheadAttention uses out_proj.weight without calling out_proj: its gradient is NaN
    because the gradient of the attention's output already was, so it is passed on."""
    model = Attention()
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    model(torch.randn(2, 5, 8)).sum().backward()
    session.flush()
    names = {h.tensor for h in session.hits}
    assert "attn.out_proj.weight.grad" in names  # the NaN reached it...
    backward = origins(session, "backward")
    assert backward and all(t.startswith("bad.") for t, _ in backward), backward  # ...from here


@pytest.mark.parametrize("sync", MODES)
def test_clipping_spreads_a_backward_nan_to_every_gradient_and_names_no_more_origins(watch, sync):
    """clip_grad_norm_ scales every gradient by the total norm, NaN once one gradient is: the
    update then writes NaN into every parameter. Each was an origin, "the gradient was clean"
    (13 origins for one backward NaN, found trying real scripts); they are passed on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), NaNBackward(), nn.Linear(8, 8),
                          nn.Tanh(), nn.Linear(8, 1))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    model(torch.randn(3, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    session.flush()
    assert any(h.tensor == "5.weight" and h.phase == "optimizer" for h in session.hits)
    assert [t for t, _ in origins(session)] and all(
        t.startswith("2.") for t, _ in origins(session)
    ), origins(session)


@pytest.mark.parametrize("dump", [False, True])
def test_a_run_that_dumps_counts_a_gradients_nan_as_one_that_does_not(watch, tmp_path, dump):
    """A forward NaN flows back: head's output gradient holds 4 NaN. With dump_dir set the hit
    said "NaN or Inf ... not counted: its values were not kept", and the dump held no count
    (the dump lists the forward, which skipped the outputs' screen that reads a bad
    forward's backward whole; found trying the UI)."""

    class Scale(nn.Module):
        def forward(self, x):
            x = torch.relu(x).clone()
            x[3] = 0.0
            return x / x.sum(dim=-1, keepdim=True)  # row 3: 0/0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Scale(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"dump_dir": str(tmp_path / "dump")} if dump else {}
    session = watch(model, optimizer=opt, on_hit="record", sync="deferred", **extra)
    loss = nn.functional.cross_entropy(model(torch.randn(6, 8)), torch.randint(0, 4, (6,)))
    session.observe("loss", loss)
    loss.backward()
    opt.step()
    session.flush()
    hit = next(h for h in session.hits if h.tensor == "2.grad_output")
    assert hit.message.startswith("2.grad_output holds 4 NaN among 24 values."), hit.message


class CausalLM(nn.Module):
    """nn.TransformerEncoder with its causal mask: -inf above the diagonal, made by the model's
    code and handed to the encoder, which softmax turns into exact zeros."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 50)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.enc(self.emb(x), mask=mask, is_causal=True))


@pytest.mark.parametrize("sync", MODES)
def test_an_additive_minus_inf_attention_mask_is_no_overflow_in_any_mode(watch, sync):
    """The usual causal mask raised an Overflow hit every step in batched checks, the CUDA
    default ("enc.input.mask holds 120 infinite values ... overflowed"), where the other
    modes said nothing: Infs the call's outputs do not show were absorbed, not hidden."""
    model = CausalLM()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    data = torch.randint(0, 50, (4, 9))
    for _ in range(3):
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 50), data[:, 1:].reshape(-1))
        session.observe("loss", loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    session.flush()
    assert session.hits == []


class HidesNaN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, bias):
        return self.fc(x) + torch.nan_to_num(bias, nan=0.0)


class HandsOnNaN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.inner, self.head = nn.Linear(4, 8), HidesNaN(), nn.Linear(8, 2)

    def forward(self, x):
        bias = torch.log(x[:, :1] * torch.ones(1, 8))  # NaN where x < 0
        return self.head(self.inner(self.inp(x), bias))


@pytest.mark.parametrize("sync", ["eager", "batched"])
def test_a_nan_the_models_code_hands_to_a_module_that_hides_it_is_seen_where_made(watch, sync):
    """Eager checks screened a value made between modules only once its call's output showed
    a problem, so a NaN the call hides (nan_to_num) went unseen, where batched checks named
    it; the README says eager sees a NaN the model masks. Deferred checks do not: they look
    at the outputs, the loss and the gradients (README, "What is watched")."""
    model = HandsOnNaN()
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    model(torch.randn(16, 4)).sum().backward()
    session.flush()
    assert origins(session, "forward") == [("inner.input[1]", "output")]


class Gan(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.D = nn.Sequential(nn.Linear(6, 8), NaNBackward(), nn.Linear(8, 1))


@pytest.mark.parametrize("sync", MODES)
def test_a_gan_step_with_several_root_forwards_names_the_discriminator(watch, sync):
    """G(z), D(fake), D(real), one backward: D's backward made the NaN; the generator's
    gradients only received it."""
    gan = Gan()
    opt = torch.optim.SGD(gan.parameters(), lr=0.01)
    session = watch(gan, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    fake = gan.G(torch.randn(3, 4))
    loss = gan.D(fake).mean() + gan.D(torch.randn(3, 6)).mean()
    loss.backward()
    opt.step()
    assert any(h.tensor.startswith("G.") for h in session.hits)  # the NaN reached G...
    backward = origins(session, "backward")
    assert backward and all(t.startswith("D.1") for t, _ in backward), backward  # ...from D.1


class Poisoned(nn.Module):
    """A generator's layer whose output turns NaN once armed."""

    def __init__(self):
        super().__init__()
        self.lin, self.armed = nn.Linear(4, 6), False

    def forward(self, x):
        y = self.lin(x)
        return y * float("nan") if self.armed else y


@pytest.mark.parametrize("sync", MODES)
def test_a_discriminator_given_the_detached_fake_is_no_origin_of_the_generators_nan(watch, sync):
    """The usual GAN step: D(fake.detach()) for D's loss, D(fake) for G's. fake.detach() is
    another tensor of the same memory: the NaN the generator made at step 2 has one origin, the
    generator's layer, at that step and no later one (its weights then carry it)."""
    torch.manual_seed(0)
    generator = nn.Sequential(Poisoned(), nn.Tanh())
    gan = nn.ModuleDict({"G": generator, "D": nn.Sequential(nn.Linear(6, 8), nn.Tanh(),
                                                            nn.Linear(8, 1))})  # fmt: skip
    opt_d = torch.optim.SGD(gan["D"].parameters(), lr=0.01)
    opt_g = torch.optim.SGD(gan["G"].parameters(), lr=0.01)
    session = watch(gan, optimizer=[opt_d, opt_g], on_hit="record", rules=[NaN()], sync=sync)
    for step in range(4):
        gan["G"][0].armed = step == 2
        fake = gan["G"](torch.randn(8, 4))
        loss_d = gan["D"](fake.detach()).mean() - gan["D"](torch.randn(8, 6)).mean()
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        (-gan["D"](fake).mean()).backward()
        opt_g.step()
        opt_g.zero_grad()
    session.flush()
    assert session.step == 4
    assert [(h.tensor, h.step) for h in session.hits if h.origin] == [("G.0.output", 2)]
    # D is called three times a step: its calls are numbered across the step's root forwards
    # (D(fake.detach()) and D(fake) hit, D(real) between them did not).
    outputs = {(h.tensor, h.call) for h in session.hits
               if h.step == 2 and h.tensor.startswith("D.2") and h.kind == "output"}  # fmt: skip
    assert outputs == {("D.2.output", 0), ("D.2#2.output", 2)}


class SafeSqrt(nn.Module):
    """The ``torch.where`` trap: a finite forward, a NaN gradient where ``x < 0``."""

    def forward(self, x):
        return torch.where(x > 0, x.sqrt(), torch.zeros_like(x))


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_update_from_a_backward_only_nan_has_one_origin_in_every_mode(watch, sync):
    """Step 0's backward makes a NaN in SafeSqrt; the update writes it into 0.weight. From step
    1 the forward carries it, masked to zeros by the ``where`` before any output: deferred
    checks (no forward screened) named SafeSqrt's backward a new origin at every later step,
    where eager checks said the parameters passed it on; and every mode named the zero
    gradients of the layer after it a vanishing gradient "of a learning rate far too large"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), SafeSqrt(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    x, y = torch.randn(64, 6), torch.rand(64, 1)
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        session.observe("loss", loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    session.flush()
    assert [(h.step, h.tensor) for h in session.hits if h.origin] == [(0, "1.grad_input[0]")]
    vanished = [h for h in session.hits if h.rule == "VanishingGradient"]
    assert vanished and all("Parameters hold NaN or Inf since step 0" in h.message
                            and "learning rate far too large" not in h.message
                            for h in vanished)  # fmt: skip


@pytest.mark.parametrize("sync", MODES)
def test_an_inf_masked_in_the_forward_is_named_where_each_mode_can_see_it(watch, sync):
    """``nan_to_num`` cleans the Inf ``inner`` made; the backward turns it into a NaN
    (``0 * Inf``). Eager and batched checks read the forward and name ``inner.output``;
    deferred ones read none of a clean forward: they name the backward where it showed, and
    say that the forward was not read (they said only that the backward made it)."""

    class Inner(nn.Module):
        def forward(self, x):
            return x / (x - x)  # Inf, and NaN where x is 0

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.inner, self.head = nn.Linear(4, 4), Inner(), nn.Linear(4, 1)

        def forward(self, x):
            y = torch.nan_to_num(self.inner(self.stem(x)), nan=0.0, posinf=0.0, neginf=0.0)
            return self.head(y)

    torch.manual_seed(0)
    model = Outer()
    session = watch(model, on_hit="record", rules=[NaN(), Overflow()], sync=sync)
    model(torch.rand(3, 4) + 1).sum().backward()
    session.flush()
    first = next(h for h in session.hits if h.origin)
    said = "Deferred checks read no forward value of this step"
    if sync in ("eager", "batched"):
        assert (first.tensor, first.phase) == ("inner.output", "forward")
        assert said not in first.message
    else:
        assert (first.tensor, first.phase) == ("inner.grad_input[0]", "backward")
        assert said in first.message


@pytest.mark.parametrize("sync", MODES)
def test_a_training_forward_after_a_bad_evaluation_names_its_own_source(watch, sync):
    """An evaluation under no_grad meets a NaN batch; the training forward after it in the same
    step gets its NaN from a weight set by hand. Its passed-on hits said "first produced at
    input[0]", the evaluation's batch, which does not feed it: they name the weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    with torch.no_grad():
        bad = torch.randn(3, 4)
        bad[0, 0] = float("nan")
        model(bad)  # the evaluation's NaN: its batch
        model[1].weight[0, 0] = float("nan")  # then a weight, by hand
    loss = model(torch.randn(3, 4)).sum()
    session.observe("loss", loss)
    loss.backward()
    opt.step()
    said = {h.tensor: h.message for h in session.hits if h.step == 0 and h.phase == "forward"}
    assert "(first produced at input[0])" in said["2.output"]  # the evaluation's own
    assert "(from 1.weight, which held NaN or Inf before this forward)" in said["2#1.output"]
    assert "(from 1.weight, which held NaN or Inf before this forward)" in said["loss"]


@pytest.mark.parametrize("sync", MODES)
def test_submodules_run_by_hand_under_no_grad_pass_a_reshaped_nan_on(watch, sync):
    """``model.bf(model.conv(x).flatten(1))`` under ``no_grad`` (an evaluation of part of the
    model): two root calls, no graph between them. ``conv``'s NaN weight makes its output NaN;
    the flattened view ``bf`` gets is the same values, passed on, not a second origin that
    "came in with this module's inputs" (and a second pause)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bf = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(16, 8)

        def forward(self, x):
            return self.bf(self.conv(x).flatten(1))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # steps are the optimizer's
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    with torch.no_grad():
        model.conv.weight[0, 0, 0, 0] = float("nan")
        model.bf(model.conv(torch.randn(4, 3, 2, 2)).flatten(1))
        model.bf(model.conv(torch.randn(4, 3, 2, 2)).flatten(1)[:, :8].repeat(1, 2))  # a copy
    session.flush()
    assert [(h.tensor, h.call) for h in session.hits if h.origin] == [
        ("conv.weight", 0), ("bf#1.input[0]", 1)]  # fmt: skip


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_the_discriminator_makes_in_the_generators_update_has_one_origin(watch, sync):
    """D(fake.detach()) and D(real) are clean; D(fake), for G's loss, makes a NaN in its own
    code. Its gradient reaches G's output (the record D(fake.detach()) also read, which no
    gradient reaches through the detached alias): one origin, D's, and the gradient is named
    after the call it came back through."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
    critic = nn.Sequential(Poisoned(), nn.Tanh(), nn.Linear(6, 1))
    critic[0].lin = nn.Linear(6, 6)
    gan = nn.ModuleDict({"G": generator, "D": critic})
    opt_d = torch.optim.SGD(critic.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    session = watch(gan, optimizer=[opt_d, opt_g], on_hit="record", rules=[NaN()], sync=sync)
    fake = generator(torch.randn(8, 4))
    (critic(fake.detach()).mean() - critic(torch.randn(8, 6)).mean()).backward()
    opt_d.step()
    opt_d.zero_grad()
    critic[0].armed = True
    (-critic(fake).mean()).backward()
    critic[0].armed = False
    opt_g.step()
    opt_g.zero_grad()
    session.flush()
    assert [(h.tensor, h.step) for h in session.hits if h.origin] == [("D.0#2.output", 0)]
    assert not [h for h in session.hits if h.tensor.startswith("D.0.grad") or "D#" in h.tensor]


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)


class ParentCode(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(4, 4), Wrapper(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.b(torch.log(self.a(x) - 100)))  # the root's own code makes NaN


def test_every_mode_names_the_parents_own_code_not_the_child_it_handed_the_value_to(watch):
    found = {}
    for sync in MODES:
        model = ParentCode()
        session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
        with torch.no_grad():
            model(torch.randn(3, 4))
        session.flush()
        found[sync] = origins(session)
        session.detach()
    assert all(found[sync] == found["eager"] for sync in MODES), found
    assert all(not t.startswith(("b.", "head.")) for t, _ in found["eager"]), found


class Residual(nn.Module):
    def __init__(self, bad=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bad = NaNBackward() if bad else nn.Identity()
        self.into = bad == "in"  # on the block's input, not its output

    def forward(self, x):
        if self.into:
            return x + self.lin(self.bad(x))
        return x + self.bad(self.lin(x))


class FanOut(nn.Module):
    """One input taken by three modules, as an attention's q, k and v take it; v's output goes
    through ``bad`` before the sum. The input's gradient is the sum of the three's."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.bad = NaNBackward()

    def forward(self, x):
        return self.q(x) + self.k(x) + self.bad(self.v(x))


BACKWARD_ORIGINS = {
    # The input's gradient, NaN through v, was named q's own making: q is taken first of the
    # three, and the gradient of q's output was clean (the attention of a trial, q k v).
    "into one of three that share an input": (
        lambda: nn.Sequential(nn.Linear(4, 8), FanOut(), nn.Linear(8, 2)),
        "1.bad.grad_input[0]",
    ),
    # Deferred checks judged the gradient of NaNBackward's output from the bias below it (its
    # gradient reaches that one whole, through the addition), so named it, finite as it was,
    # the origin: the bias's gradient also held what NaNBackward's own backward made.
    "after an activation": (
        lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), NaNBackward(), nn.Linear(8, 2)),
        "2.grad_input[0]",
    ),
    "nested": (
        lambda: nn.Sequential(
            nn.Linear(4, 8), nn.Sequential(nn.Tanh(), NaNBackward()), nn.Linear(8, 2)
        ),
        "1.1.grad_input[0]",
    ),
    # A residual stream: the NaN made above it, in a block, and after it.
    "above a residual": (
        lambda: nn.Sequential(nn.Linear(4, 8), Residual(), NaNBackward(), nn.Linear(8, 2)),
        "2.grad_input[0]",
    ),
    "in a residual block": (
        lambda: nn.Sequential(nn.Linear(4, 8), Residual(bad=True), Residual(), nn.Linear(8, 2)),
        "1.bad.grad_input[0]",
    ),
    "below a residual": (
        lambda: nn.Sequential(nn.Linear(4, 8), NaNBackward(), Residual(), nn.Linear(8, 2)),
        "1.grad_input[0]",
    ),
    "into a residual block": (
        lambda: nn.Sequential(nn.Linear(4, 8), Residual(bad="in"), nn.Linear(8, 2)),
        "1.bad.grad_input[0]",
    ),
}


@pytest.mark.parametrize("room", ["kept", "no room"])
@pytest.mark.parametrize("shape", BACKWARD_ORIGINS)
def test_every_mode_names_where_a_backward_nan_was_made_and_the_same_hits(watch, shape, room):
    """A NaN made by a backward alone, where deferred checks judge gradients from the
    parameters' below them: each mode names the operation that made it, and hits the same
    tensors. A gradient a mode did not read has no verdict; one it did has eager's. With no
    room to keep the gradients carried on to a voucher (``retain_bytes=0``), deferred checks
    judge them from the graph instead, and still agree."""
    make, expected = BACKWARD_ORIGINS[shape]
    found, verdicts, said = {}, {}, []
    budget = {} if room == "kept" else {"retain_bytes": 0}
    for sync in MODES:
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync, **budget)
        model(torch.randn(3, 4)).sum().backward()
        session.flush()
        records = session.snapshot().records
        verdicts[sync] = {r.stats.name: r.stats.values.get(FINITE) for r in records
                          if r.stats.kind in ("grad_output", "grad_input")}  # fmt: skip
        opt.step()
        session.flush()
        found[sync] = (origins(session), [h.tensor for h in session.hits])
        said += [h.message for h in session.hits if h.origin]
        session.detach()
    # Said as what it is, in every mode: deferred checks, which judge it from a parameter's
    # gradient and keep no values, once advised "a larger retain_bytes", which changed nothing.
    assert all("0/0, log or sqrt" in m and "retain_bytes" not in m for m in said), said
    assert found["eager"][0] == [(expected, "grad_input")], found["eager"]
    assert all(found[sync] == found["eager"] for sync in MODES), found
    eager = verdicts["eager"]
    assert None not in eager.values() and 0.0 in eager.values() and 1.0 in eager.values(), eager
    for sync in MODES:
        assert verdicts[sync].keys() == eager.keys(), (sync, verdicts)
        assert all(v in (None, eager[name]) for name, v in verdicts[sync].items()), (sync, verdicts)
    if shape == "into a residual block":  # read when kept; else it reaches a clean bias's
        assert verdicts["deferred"]["1.grad_output"] == 1.0, verdicts


class LoRA(nn.Module):
    """A frozen Linear with a low-rank adapter beside it: ``x`` goes to ``base`` and into the
    adapter's own ``x @ A.T``, whose backward makes NaN (sqrt's derivative at 0, times 0)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 8).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(2, 8))
        self.B = nn.Parameter(torch.randn(8, 2))

    def forward(self, x):
        xa = x @ self.A.T
        return self.base(x) + (xa + torch.sqrt(xa * 0)) @ self.B.T


def test_every_mode_names_an_adapter_not_the_frozen_layer_it_hands_its_input_to(watch):
    """A NaN made in a LoRA adapter's backward was named ``base.grad_input[0]`` with "the
    gradient of its output was clean" (found trying the product as a new user): the gradient
    of ``x`` sums the adapter's backward and base's, and only the adapter's made it."""
    found = {}
    for sync in MODES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), LoRA(), nn.Linear(8, 2))
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
        session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
        model(torch.randn(3, 4)).sum().backward()
        session.flush()
        found[sync] = sorted(origins(session))
        session.detach()
    assert ("1.grad_input[0]", "grad_input") in found["eager"], found["eager"]
    assert not [t for t, _ in found["eager"] if t.startswith("1.base.")], found["eager"]
    assert all(found[sync] == found["eager"] for sync in MODES), found


class Checkpointed(nn.Module):
    """Two blocks run through torch.utils.checkpoint with use_reentrant=True; the second's
    ``bad`` makes a NaN in backward only, between its two Linears."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), NaNBackward() if i else nn.Identity(), nn.Linear(8, 8))
            for i in range(2)
        )
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)


@pytest.mark.parametrize("sync", MODES)
def test_a_backward_nan_in_a_reentrant_checkpoint_has_one_origin_in_its_block(watch, sync):
    """Reentrant checkpointing runs a block's backward as a pass of its own, over a forward
    recomputed in backward that no hook sees: the parameter gradients there were named "made
    by this module's backward: the gradient of its output was clean" (never seen), seven
    origins in two blocks; the default mode judged none of those gradients (the outer pass
    does not reach them). Now each is judged, the first to show the NaN is the one origin, in
    the block, and the hit says what was not seen; the modes agree."""
    model = Checkpointed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync, rules=[NaN()])
    model(torch.randn(3, 4)).sum().backward()
    found = [h for h in session.hits if h.phase == "backward"]
    assert {h.tensor for h in found} >= {"blocks.1.0.weight.grad", "blocks.0.0.weight.grad"}
    assert [(h.module, h.kind) for h in found if h.origin] == [("blocks.1.0", "grad")]
    assert (
        "use_reentrant=False tensordbg names the module"
        in next(h for h in found if h.origin).message
    )
    opt.step()
    assert [h.tensor for h in session.hits if h.origin and h.phase == "optimizer"] == []


def test_without_an_optimizer_each_steps_reentrant_backward_nan_has_its_origin(watch):
    """With no optimizer watched a step is one call of the model, and no optimizer step says
    its gradients are final: the first step's origin kept every later one from being one."""
    model = Checkpointed()
    session = watch(model, on_hit="record", rules=[NaN()])
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        model.zero_grad()
    assert [(h.module, h.step) for h in session.hits if h.origin] == [
        ("blocks.1.0", 0), ("blocks.1.0", 1), ("blocks.1.0", 2)]  # fmt: skip


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("loss_of", ["both calls", "the clean call"])
def test_a_loss_of_two_model_calls_is_no_origin_of_the_first_calls_inf(watch, sync, loss_of):
    """A siamese loss, (model(a) - model(b))**2, with an Inf in the first call's output: the
    loss was called an origin too ("the model's outputs were clean": the second call's were).
    A loss made NaN by its own code from the clean call alone is still its own origin."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # a step is its step: both calls in one
    session = watch(model, optimizer=opt, on_hit="record", sync=sync, rules=[NaN(), Overflow()])
    bad = torch.randn(5, 4)
    bad[0] = float("inf")
    first, second = model(bad), model(torch.randn(5, 4))
    if loss_of == "both calls":
        loss = (first - second).pow(2).mean()
    else:
        loss = torch.log(second - 1e4).mean()  # NaN made by the loss code, of the clean call
    session.observe("loss", loss)
    loss.backward()
    expected = ["input[0]"] + (["loss"] if loss_of == "the clean call" else [])
    assert [h.tensor for h in session.hits if h.origin and h.phase == "forward"] == expected


def test_a_nan_in_a_sparse_gradient_is_found_in_the_gradient_not_blamed_on_the_optimizer(watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Linear(4, 1))
    opt = torch.optim.SparseAdam(list(model[0].parameters()))
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()])
    model[0].weight.register_hook(lambda grad: grad * float("nan"))
    model(torch.randint(0, 50, (6,))).sum().backward()
    opt.step()
    first = next(h for h in session.hits if h.origin)
    assert (first.tensor, first.kind, first.phase) == ("0.weight.grad", "grad", "backward")
    assert not any(h.kind == "param" and h.origin for h in session.hits)


@pytest.mark.parametrize("sync", MODES)
def test_a_layer_unfrozen_after_attach_has_its_gradient_watched(watch, sync):
    """Frozen at attach (fine-tuning a head first), unfrozen and given to the optimizer later:
    its gradient had no hook, so a NaN gradient went unseen, and the NaN weight it made was
    blamed on the optimizer with "the gradient was clean"."""
    torch.manual_seed(0)
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    for step in range(4):
        if step == 1:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters())})
        if step == 2:
            model[0].weight.register_hook(lambda grad: grad * float("nan"))
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    first = next(h for h in session.hits if h.origin)
    assert (first.tensor, first.step, first.phase) == ("0.weight.grad", 2, "backward")
    assert not any(h.kind == "param" and h.origin for h in session.hits)


def test_an_optimizer_made_after_attach_is_watched_in_place_of_the_one_it_replaces(watch, capsys):
    """A second phase of the training with a new optimizer over the same parameters: the one
    given to attach never stepped again, so no step ended (steps 2 to 5 were all "step 2"),
    and the new optimizer's updates went unchecked."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = mlp()  # another model's optimizer steps too: not this session's
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()])
    for step in range(6):
        if step == 2:
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if step == 4:
            model[0].weight.register_hook(lambda grad: grad * float("nan"))
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        other(torch.randn(3, 4)).sum().backward()
        other_opt.step()
    assert session.step == 6
    assert session.optimizers == [opt]
    first = next(h for h in session.hits if h.origin)
    assert (first.tensor, first.step, first.phase) == ("0.weight.grad", 4, "backward")
    err = capsys.readouterr().err
    assert err.count("watched from now on") == 1
    said = "step 2: Adam steps the model's parameters and is watched from now on, in place of SGD"
    assert said in err


def test_an_optimizer_of_part_of_the_model_made_after_attach_is_watched_beside_the_first(watch):
    """A head's own optimizer, made after attach (or not passed to it): both step each step,
    one step of the count, and the head's updates are checked too."""
    torch.manual_seed(0)
    model = mlp()
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    session = watch(model, optimizer=body, on_hit="record", rules=[NaN()])
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    for step in range(4):
        model(torch.randn(3, 4)).sum().backward()
        body.step()
        if step == 2:
            head.param_groups[0]["lr"] = math.nan  # its update writes NaN in
        head.step()
        body.zero_grad()
        head.zero_grad()
    assert session.step == 4 and session.optimizers == [body, head]
    first = next(h for h in session.hits if h.origin)
    assert (first.tensor, first.step, first.phase) == ("2.weight", 2, "optimizer")


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_a_parametrized_weight_gets_one_hook_and_one_origin(watch, sync, norm):
    """weight_norm and spectral_norm hand their parameters to the parametrization as arguments:
    each step left one more hook on them (200 after 200 steps, each firing at every backward
    with its own step's record), and a NaN from the loss was named twice, the second time at
    the parametrization's gradient, judged against an old step's record. An EMA copy of such a
    model failed ("cannot pickle '_thread.lock'")."""
    torch.manual_seed(0)
    wrap = getattr(nn.utils.parametrizations, norm)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), wrap(nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    weight = model[2].parametrizations.weight
    original = weight.original if norm == "spectral_norm" else weight.original0
    for step in range(5):
        out = model(torch.randn(8, 4))
        if step == 4:
            out = out * math.nan
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert len(original._backward_hooks) == 1
    assert [(h.tensor, h.step) for h in session.hits if h.origin] == [("2.grad_output", 4)]
    ema = copy.deepcopy(model)  # its class copies the instance's dict: it failed on our hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in ema.modules())
    assert all(not vars(m).keys() & {"__deepcopy__", "__reduce_ex__"} for m in ema.modules())
    session.detach()
    assert not original._backward_hooks  # detach takes it off


def test_a_lazy_module_is_watched_from_its_first_forward(watch):
    """attach before a LazyLinear's first forward raised ("Attempted to use an uninitialized
    parameter"): its parameters get their gradient hooks once they have their shapes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(1))
    session = watch(model, on_hit="record", rules=[NaN()])
    model(torch.randn(8, 4)).sum().backward()  # the parameters take their shapes
    model[0].register_forward_hook(lambda m, i, o: o * math.nan)
    model(torch.randn(8, 4)).sum().backward()
    grads = {h.tensor for h in session.hits if h.kind == "grad"}
    assert {"0.weight.grad", "2.weight.grad"} <= grads


@pytest.mark.parametrize("sync", MODES)
def test_without_a_watched_optimizer_a_weight_a_nan_gradient_made_is_no_origin(watch, sync):
    """Without an optimizer given, the parameters a step changed are checked when it ends:
    those a NaN gradient had made NaN were each named an origin, "the gradient was clean"."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # not given to attach
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    for step in range(3):
        out = model(torch.randn(3, 4))
        if step == 1:
            out = out * math.nan
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    model(torch.randn(3, 4))
    assert any(h.kind == "param" for h in session.hits)  # checked, and NaN
    assert [(h.tensor, h.step) for h in session.hits if h.origin] == [("4.grad_output", 1)]


class Huge(nn.Module):
    """Finite values near float32's largest (up to 3e38): their sum is past its range."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 1e38 + 2e38


@pytest.mark.parametrize("sync", MODES)
def test_finite_values_whose_sum_overflows_are_recorded_finite(watch, sync, tmp_path):
    """The "finite" screen is a sum, which NaN and Inf poison, and so does a sum past the
    dtype's range: such a tensor was recorded as not finite (with no NaN and no Inf counted),
    and `tensordbg diff` said two runs part where it was finite in both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), Huge(), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(8, 4)
    huge = model[1](model[0](x))
    assert torch.isfinite(huge).all() and not torch.isfinite(huge.sum())
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync, dump_dir=tmp_path,
                    dump_every=1)  # fmt: skip
    with torch.no_grad():
        model(x)
    session.detach()
    entry = next(e for e in tensordbg.load(tmp_path).tensors(0) if e.name == "1.output")
    assert entry.stats["finite"] == 1.0 and session.hits == []


# --- attaching must not break the script ----------------------------------------------------


@pytest.mark.parametrize("profiling", [False, True])
def test_saving_and_copying_a_watched_model_work_and_the_copies_carry_no_hooks(watch, profiling):
    """Also in the steps of a profile, whose own hooks on the model broke both (a checkpoint
    every step failed with "cannot pickle 'weakref.ReferenceType'")."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()])
    handle = session.profile(steps=3) if profiling else None
    for _ in range(3 if profiling else 1):  # a profile starts at a step's end, warms up a step
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert handle is None or handle.state == "running"
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a whole-model checkpoint
    ema = copy.deepcopy(model)  # an EMA or "best model" copy
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (ema, loaded):
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in other.modules())
        assert torch.equal(other[0].weight, model[0].weight)
        x = torch.randn(3, 4)
        x[0, 0] = float("nan")
        other(x)  # the copy is not watched: nothing reaches the session
    assert session.hits == []
    assert all(m._forward_hooks for m in model.modules() if m is not model)  # still watched
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    session.detach()
    assert "__reduce_ex__" not in vars(model[0])  # detach undid that too


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 3)

    def forward(self, x, pad=None):
        return self.head(self.enc(self.inp(x), src_key_padding_mask=pad))


@pytest.mark.filterwarnings("ignore:.*enable_nested_tensor")
def test_a_transformer_encoder_evaluates_attached_as_it_does_bare(watch):
    """nn.TransformerEncoderLayer evaluates through one fused kernel unless a module inside it
    has a forward hook; its standard path differs in the last bits (the CPU's bfloat16
    autocast: logits moved by 2^-7). Attached, it still takes the fused path."""
    bare, model = Encoder(), Encoder()
    watch(model, on_hit="record", rules=[NaN()])
    x, pad = torch.randn(4, 10, 16), torch.zeros(4, 10, dtype=torch.bool)
    pad[:, 7:] = True
    bare.eval(), model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(bare(x, pad), model(x, pad))
        assert torch.equal(bare(x), model(x))


@pytest.mark.filterwarnings("ignore:.*enable_nested_tensor")
def test_compiling_a_watched_transformer_encoder_warns_of_no_hook_the_script_did_not_install(watch):
    """torch.compile warns of global module hooks at each compiled call: the fused layers'
    (above) are tensordbg's, not the script's. The warning is back once it detaches."""
    model = Encoder()
    session = watch(model, on_hit="record", rules=[NaN()])
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        compiled(torch.randn(2, 5, 16))
        assert not any("global hooks" in str(w.message) for w in caught)
        session.detach()
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
        try:
            compiled(torch.randn(2, 5, 16))  # the script's own global hook: warned of
        finally:
            handle.remove()
    assert any("global hooks" in str(w.message) for w in caught)


@pytest.mark.filterwarnings("ignore:.*enable_nested_tensor")
@pytest.mark.parametrize("sync", MODES)
def test_inside_a_transformer_encoder_layer_the_module_that_made_a_nan_is_named(watch, sync):
    """Its modules are watched through torch's global hooks (above): in training the layer's
    submodules are each a call, and a NaN weight is the origin, in every mode; in evaluation
    the fused layer is one call, whose kernel used that weight: its output is said to be
    passed on from it (the weight of a submodule its kernel used, not a call of its own)."""
    model = Encoder()
    session = watch(model, on_hit="record", sync=sync, rules=[NaN()])
    with torch.no_grad():
        model.enc.layers[1].linear2.weight[0, 0] = float("nan")
    x, pad = torch.randn(4, 10, 16), torch.zeros(4, 10, dtype=torch.bool)
    pad[:, 7:] = True
    model(x, pad).sum().backward()
    assert origins(session, "forward") == [("enc.layers.1.linear2.weight", "param")]
    model.eval()
    with torch.no_grad():
        model(x, pad)
    evaluated = [h for h in session.hits if h.step == 1]
    assert [(h.tensor, h.origin) for h in evaluated] == [
        ("enc.layers.1.output", False), ("head.output", False)]  # fmt: skip
    assert "own parameters enc.layers.1.linear2.weight" in evaluated[0].message


@pytest.mark.filterwarnings("ignore:.*deprecated")
def test_scripting_a_watched_model_works_and_the_scripted_one_carries_no_hooks(watch):
    """torch.jit.script compiles a module's forward hooks with it: scripting an attached model
    (a TorchScript export at the end of a training) failed on tensordbg's hooks with "try
    blocks aren't supported"."""
    import torch.jit._recursive as recursive

    torch_hook_stubs = recursive.get_hook_stubs
    model = mlp()
    session = watch(model, on_hit="record", rules=[NaN()])
    scripted = torch.jit.script(model)
    x = torch.randn(3, 4)
    assert torch.equal(scripted(x), model(x))
    _forward_with_a_nan(scripted)  # the scripted module is not watched
    assert session.hits == []
    _forward_with_a_nan(model)  # the model still is
    assert [h.tensor for h in session.hits if h.origin] == ["input[0]"]
    session.detach()
    assert recursive.get_hook_stubs is torch_hook_stubs  # detach undid that too


def _forward_with_a_nan(model: nn.Module) -> None:
    x = torch.randn(3, 4)
    model(x), model(x)  # a worker's calls of the model: no step ends in it
    x[0, 0] = float("nan")
    model(x)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("on_hit", ["pause", "record"])
def test_a_forked_worker_that_hits_never_pauses_and_prints_its_origin(watch, capfd, on_hit):
    """A forked process's record dies with it (a DataLoader worker ends without a summary):
    its hit at the origin is printed where it happened."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit=on_hit, rules=[NaN()])
    worker = multiprocessing.get_context("fork").Process(target=_forward_with_a_nan, args=(model,))
    worker.start()
    worker.join(DEADLINE)
    if worker.is_alive():  # paused for ever: the bug
        worker.kill()
        worker.join()
        pytest.fail("the forked worker paused on its hit")
    assert worker.exitcode == 0
    err = capfd.readouterr().err
    assert f"is a fork of the training ({os.getpid()}): hits here never pause it" in err
    # Named as in one call (not "#2.input[0]", the worker's third call), with no step: the
    # training's as it forked, which a worker that only runs the model never ends.
    said = f"tensordbg: process {worker.pid} (a fork of the training), forward: [NaN] input[0] "
    assert said + "holds 1 NaN" in err
    assert session.hits == []  # the training's own session saw nothing


def test_detaching_while_paused_in_the_optimizer_phase_is_clean(watch, capsys):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e38)  # the update overflows the weights
    session = watch(model, optimizer=opt, on_hit="pause", rules=[NaN(), Overflow()])
    seen = {}

    def detach_when_paused():
        try:
            wait_until(lambda: session.controller.state == "paused")
            seen["phase"] = session.phase
        finally:
            session.controller.detach()  # what the UI's q does

    helper = threading.Thread(target=detach_when_paused)
    helper.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            (model(torch.randn(3, 4)) * 1e30).sum().backward()
            opt.step()
            opt.zero_grad()
    helper.join()
    assert seen == {"phase": "optimizer"}
    assert session.detached and not session.broken
    assert not [w for w in caught if "internal error" in str(w.message)]
    # The terminal's last word was "training paused": it says now that it goes on unwatched.
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1] == "tensordbg: detached (step 0, optimizer): the training goes on unwatched"


def test_weights_updated_by_hand_are_said_once_to_be_unwatched(watch, capsys):
    model = mlp()
    watch(model, on_hit="record")
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    err = capsys.readouterr().err
    assert err.count("no optimizer is watched") == 1
    assert "pass optimizer= to attach()" in err


# --- requests and signals that cannot hurt the training -------------------------------------


class AsksMidForward(nn.Module):
    """The identity; once given a session, it has another thread ask that training for a
    change while this forward runs (as the UI's server does: a profile, a rule edited). The
    change waits for the training's next hook: in the middle of the forward."""

    def __init__(self):
        super().__init__()
        self.session, self.applied_in = None, []

    def forward(self, x):
        if self.session is not None:
            session, self.session = self.session, None
            change = lambda: self.applied_in.append(session.phase)  # noqa: E731
            asker = threading.Thread(target=session.control.submit, args=(change,))
            asker.start()
            asker.join(DEADLINE)
        return x


@pytest.mark.parametrize("sync", MODES)
def test_a_change_asked_for_in_the_middle_of_a_forward_keeps_the_step_watched(watch, sync):
    """A request that lands while the forward runs, two modules deep: the change runs on the
    training thread at the next hook, and the rest of that forward is still known as it was
    (deferred checks once named nothing: the forward's remaining log was read as if it began
    at the root, the engine stopped watching with an internal error, and a profile asked for
    from the UI at the demo's first step never started). The backward's NaN of that step is
    named where it was made, and the next step is watched."""
    asks = AsksMidForward()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8),
        nn.Sequential(nn.Sequential(asks, nn.Tanh()), NaNBackward()),
        nn.Linear(8, 2),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
        asks.session = session
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        session.flush()
    assert asks.applied_in == ["forward"]
    assert not session.broken and not [w for w in caught if "internal error" in str(w.message)]
    assert session.step == 2
    backward = origins(session, "backward")
    assert backward and all(t.startswith("1.1") for t, _ in backward), backward
    assert {h.step for h in session.hits if h.origin} == {0}  # step 1's NaN: a repeat
    assert {h.step for h in session.hits} == {0, 1}


@pytest.fixture
def paused_source():
    with PausedTraining() as training:
        training.wait_paused()
        yield training, LiveSource(training.session)


def test_a_short_slice_text_cannot_make_the_training_build_a_huge_result():
    """60 zeros in a list ask for 30 times the tensor: refused from the index alone, before
    anything is computed."""
    text = "[[" + ", ".join(["0"] * 60) + "]]"
    assert len(text) <= MAX_TEXT  # a short text a person (or a hostile client) can send
    x = torch.zeros(2, 500_000)
    with pytest.raises(SliceError, match="would make 30,000,000 values"):
        apply_index(x, parse_index(text), max_elements=x.numel())
    assert result_shape((1000, 1000), parse_index("[[0, 1], None, 3:7]")) == (1, 4, 2)
    assert apply_index(x, parse_index("[[0, 1], 5]"), max_elements=x.numel()).shape == (2,)


def test_a_slice_typed_wrong_is_said_at_the_column_of_the_mistake():
    """An unclosed bracket was said "near column 1" (Python names the parser's own wrapper)."""
    with pytest.raises(SliceError, match=r"near column 8: '\[' was never closed"):
        parse_index("99, foo[::-1")
    with pytest.raises(SliceError, match="near column 3: invalid syntax"):
        parse_index("0,,1")
    # The "[" that starts a new slice in the UI, then Enter: the whole tensor, as the input's
    # hint says of an empty slice (it said "'[' was never closed").
    assert parse_index("[") == () and parse_index(" [ ") == ()


def test_a_slice_request_is_sized_before_it_is_made(paused_source):
    _, source = paused_source
    ref = source.info()["paused_at"]["ref"]  # a 16x32 tensor
    with pytest.raises(SourceError, match="out of range"):
        source.stats(ref, "[[0, 99]]")
    assert source.stats(ref, "[[0, 1], 3]")["shape"] == [2]  # a small list index still works


def test_histogram_bounds_that_make_no_sense_get_a_sentence(paused_source):
    _, source = paused_source
    ref = source.info()["paused_at"]["ref"]
    with pytest.raises(SourceError, match="lo=2 is above hi=1"):
        source.histogram(ref, lo=2.0, hi=1.0)
    with pytest.raises(SourceError, match="not a finite number"):
        source.histogram(ref, lo=float("-inf"), hi=1.0)
    with pytest.raises(SourceError, match="too far apart"):
        source.histogram(ref, lo=-1e308, hi=1e308)


def test_ctrl_c_during_a_ui_request_reaches_the_training_and_the_ui_gets_an_answer(watch):
    model = mlp()
    session = watch(model, on_hit="pause", rules=[NaN()])
    answer = {}

    def interrupted_request():
        try:
            wait_until(lambda: session.controller.state == "paused")

            def work():
                raise KeyboardInterrupt  # Ctrl-C arriving while the request runs

            session.controller.run_on_training_thread(work, timeout=DEADLINE)
        except BaseException as e:
            answer["error"] = e
        finally:
            if session.controller.state == "paused":  # the bug: still paused; let it go
                session.controller.detach()

    helper = threading.Thread(target=interrupted_request)
    helper.start()
    with pytest.raises(KeyboardInterrupt):
        _forward_with_a_nan(model)
    helper.join(DEADLINE)
    assert not helper.is_alive()
    assert isinstance(answer.get("error"), NotPaused)  # told, not killed by the interrupt
    assert session.controller.state == "running"


def test_without_a_ui_server_a_pause_becomes_a_recorded_hit(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # a runtime directory others can enter: refused
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(shared))
    model = mlp()
    with pytest.warns(RuntimeWarning, match="recorded instead of pausing"):
        session = tensordbg.attach(model, on_hit="pause", rules=[NaN()])
    try:
        runner = threading.Thread(target=_forward_with_a_nan, args=(model,))
        runner.start()
        runner.join(DEADLINE)
        blocked = runner.is_alive()
        if blocked:
            session.controller.detach()
            runner.join()
        assert not blocked, "the training paused with no UI to resume it"
        assert session.hits and session.on_hit == "record"
    finally:
        session.detach()


# --- skipping a bad update ------------------------------------------------------------------


def _adam_run(on_hit, plant_at, steps=4, optimizers=1):
    """A run whose step ``plant_at`` makes every gradient NaN; ``optimizers=2``: the last layer
    has an optimizer of its own (SGD with momentum), stepped after the AdamW of the others."""
    torch.manual_seed(0)
    model = mlp()
    params = list(model.parameters())
    split = -2 if optimizers == 2 else len(params)
    opts = [torch.optim.AdamW(params[:split], lr=1e-2, weight_decay=0.1)]
    if optimizers == 2:
        opts.append(torch.optim.SGD(params[split:], lr=0.1, momentum=0.9))
    session = tensordbg.attach(model, optimizer=opts, on_hit=on_hit, rules=[NaN()], server=False)

    def state() -> dict:
        return {"params": copy.deepcopy(model.state_dict()),
                "opt": [copy.deepcopy(o.state_dict()) for o in opts]}  # fmt: skip

    before = {}
    for step in range(steps):
        loss = model(torch.randn(3, 4)).sum()
        if step == plant_at:
            before = state()
            loss = loss * float("nan")  # every gradient of this step is NaN
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if step == plant_at:
            after = state()
    return session, model, before, after


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(
            torch.uint8) if b.dim() else b)  # fmt: skip
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _skip_when_paused(session) -> tuple[threading.Thread, dict]:
    """A person's k then c, from another thread, once the training pauses: the thread, and
    the reply to k (under "skip") once it is joined."""
    replies = {}

    def press():
        try:
            wait_until(lambda: session.controller.state == "paused")
            replies["skip"] = LiveSource(session).control("skip")
        finally:
            session.controller.resume()

    thread = threading.Thread(target=press)
    thread.start()
    return thread, replies


def test_on_hit_skip_drops_a_bad_update_and_leaves_parameters_and_optimizer_state_bitwise(capsys):
    session, model, before, after = _adam_run("skip", plant_at=2)
    try:
        assert session.skipped_updates == [2]
        assert _bitwise_equal(before["params"], after["params"])
        assert _bitwise_equal(before["opt"], after["opt"])
        assert all(torch.isfinite(p).all() for p in model.parameters())  # the run goes on clean
        assert "updates tensordbg skipped: [2]" in session.summary()
    finally:
        session.detach()


def test_a_nan_in_an_evaluation_under_no_grad_skips_no_update(watch):
    """An evaluation between two steps (under no_grad) met a bad batch: its hit is recorded,
    and the next step's healthy update lands (it was dropped: the evaluation's forward counts
    in the step after it). A bad training batch is still skipped."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="skip", rules=[NaN()])
    bad = torch.randn(3, 4)
    bad[0, 0] = float("nan")
    for step in range(5):
        before = copy.deepcopy(model.state_dict())
        model(bad if step == 3 else torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        assert _bitwise_equal(before, model.state_dict()) == (step == 3), step
        with torch.no_grad():  # the evaluation, after every step
            model(bad)
    assert session.skipped_updates == [3]
    assert {h.step for h in session.hits if h.origin and h.phase == "forward"} == {1, 2, 3, 4, 5}


def _press_k_when_paused(session, said: dict) -> threading.Thread:
    """A person at a UI opened at the next pause: what it offers (``said["offered"]``), then
    ``k`` (its refusal in ``said["error"]``), then ``c``."""

    def press():
        try:
            wait_until(lambda: session.controller.state == "paused")
            said["offered"] = LiveSource(session).info()["skippable"]  # a UI opened now
            try:
                LiveSource(session).control("skip")
            except SourceError as e:
                said["error"] = str(e)
        finally:
            session.controller.resume()

    helper = threading.Thread(target=press)
    helper.start()
    return helper


@pytest.mark.parametrize("sync", ["auto", "eager"])
def test_k_on_a_hit_in_an_evaluation_is_refused_and_the_next_update_lands(watch, sync):
    """Paused on a validation batch's NaN (a forward under no_grad between two steps), k
    (``skip_step``) dropped the next step's clean update, where on_hit="skip" drops none
    (found trying the UI as a new user): the losses left the bare run's. No update comes of an
    evaluation: k is refused, saying so, the UI is not offered it, and the training's numbers
    stay the bare run's."""

    def train(attach: bool) -> list[float]:
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        said: dict = {}
        if attach:
            session = watch(model, optimizer=opt, on_hit="pause", rules=[NaN()], sync=sync)

            helper = _press_k_when_paused(session, said)
        losses = []
        for step in range(4):
            loss = model(torch.randn(3, 4)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 1:
                bad = torch.randn(3, 4)
                bad[0, 0] = float("nan")
                with torch.no_grad():  # the evaluation: its NaN pauses
                    model(bad)
        if attach:
            helper.join(DEADLINE)
            assert "no update comes of it, so there is none to skip" in said["error"]
            assert said["offered"] is False
            assert session.skipped_updates == []
        return losses

    assert train(attach=True) == train(attach=False)


def test_a_skipped_step_that_left_batchnorm_statistics_nan_says_so_and_so_do_later_hits(
    watch, capsys
):
    """The skip drops the update, but the bad batch's forward already wrote NaN into the
    BatchNorm's running statistics: said at the skip, and a later evaluation's hit in that
    BatchNorm names them instead of "its inputs and parameters were clean"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="skip", rules=[NaN()])
    bad = torch.randn(6, 4)
    bad[0, 0] = float("nan")
    for step in range(3):
        model(bad if step == 1 else torch.randn(6, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert session.skipped_updates == [1]
    err = capsys.readouterr().err
    assert "step 1: its update was skipped, but its forward left NaN or Inf in the buffers " \
           "1.running_mean, 1.running_var" in err  # fmt: skip
    model.eval()
    with torch.no_grad():
        model(torch.randn(6, 4))  # clean inputs, clean parameters
    hit = next(h for h in session.hits if h.origin and h.step == 3)
    assert hit.module == "1"
    assert "its buffers 1.running_mean, 1.running_var hold NaN or Inf" in hit.message
    assert "inputs and parameters were clean." not in hit.message


def test_a_skip_drops_the_update_of_every_optimizer_of_the_step(capsys):
    """Two optimizers stepped one after the other are one step: the second's update of the NaN
    gradients is dropped too (it used to land: the step ended with the first optimizer)."""
    session, model, before, after = _adam_run("skip", plant_at=2, optimizers=2)
    try:
        assert session.skipped_updates == [2]
        assert _bitwise_equal(before, after)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert session.step == 4  # four iterations, four steps
    finally:
        session.detach()


def test_an_optimizer_that_steps_more_often_than_the_others_counts_the_steps(watch):
    """A WGAN's critic steps several times per generator step: the steps are the first
    optimizer's, as the count went before the optimizers were seen to step apart."""
    critic, generator = nn.Linear(4, 1), nn.Linear(4, 4)
    model = nn.ModuleDict({"critic": critic, "generator": generator})
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    session = watch(model, optimizer=[opt_c, opt_g], rules=[NaN()])
    for _ in range(3):
        for _ in range(5):
            critic(generator(torch.randn(8, 4)).detach()).mean().backward()
            opt_c.step()
            opt_c.zero_grad()
        critic(generator(torch.randn(8, 4))).mean().backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_c.zero_grad()
    assert session.step == 15 and not session.hits


def test_a_skip_in_a_wgan_drops_the_generators_update_and_no_critic_update():
    """The critic steps five times per generator step (first in the list: steps are its). A NaN
    in the generator's forward skips the generator's update; the skip ends with those
    gradients, and the critic's next update, which follows in the same step, lands."""
    torch.manual_seed(0)
    generator = nn.Sequential(Poisoned(), nn.Tanh())
    critic = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-3)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    gan = nn.ModuleDict({"G": generator, "D": critic})
    session = tensordbg.attach(gan, optimizer=[opt_c, opt_g], on_hit="skip", rules=[NaN()],
                               server=False, summary_at_exit=False)  # fmt: skip
    try:
        for iteration in range(3):
            for _ in range(5):
                fake = generator(torch.randn(8, 4)).detach()
                (critic(fake).mean() - critic(torch.randn(8, 6)).mean()).backward()
                opt_c.step()
                opt_c.zero_grad()
            generator[0].armed = iteration == 1
            before = copy.deepcopy(generator.state_dict())
            (-critic(generator(torch.randn(8, 4))).mean()).backward()
            generator[0].armed = False
            opt_g.step()
            opt_g.zero_grad()
            opt_c.zero_grad()
            if iteration == 1:
                assert _bitwise_equal(before, generator.state_dict())  # its update was dropped
        steps = lambda opt: {int(s["step"]) for s in opt.state.values()}  # noqa: E731
        assert steps(opt_c) == {15}  # every critic update landed
        assert steps(opt_g) == {2}  # the generator's of iteration 1 did not
        assert session.skipped_updates == [10]
        assert all(torch.isfinite(p).all() for p in gan.parameters())
    finally:
        session.detach()


def test_a_skip_after_the_first_optimizer_stepped_says_which_updates_it_drops(watch):
    """Paused on a hit between the two optimizers' steps: the first one's update is made and
    stays; the skip drops the second's, and says so."""
    first, second = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"first": first, "second": second})
    opt1 = torch.optim.SGD(first.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.1)
    session = watch(model, optimizer=[opt1, opt2], on_hit="pause", rules=[NaN()])

    first(torch.randn(3, 4)).sum().backward()
    opt1.step()
    before = copy.deepcopy(second.state_dict())
    helper, replies = _skip_when_paused(session)
    (second(torch.randn(3, 4)).sum() * float("nan")).backward()  # pauses on the NaN gradient
    opt2.step()
    helper.join(DEADLINE)
    assert replies["skip"]["skipped"] == (
        "Step 0: SGD #1 stepped already, its update made; SGD #2 will drop its gradients, its "
        "weights and state staying as they are."
    )
    assert _bitwise_equal(before, second.state_dict())
    assert session.skipped_updates == [0]


def test_k_at_a_generators_nan_before_either_update_drops_both_of_the_gan_step(watch):
    """A GAN step, D's optimizer first: G(z) hits, the person skips; D's update comes, then
    D(fake) (a root forward) and G's backward and update: both updates are dropped."""
    torch.manual_seed(0)
    generator = nn.Sequential(Poisoned(), nn.Tanh())
    critic = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt_d = torch.optim.SGD(critic.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.1)
    gan = nn.ModuleDict({"G": generator, "D": critic})
    session = watch(gan, optimizer=[opt_d, opt_g], on_hit="pause", rules=[NaN()])

    before = copy.deepcopy(gan.state_dict())
    helper, replies = _skip_when_paused(session)
    generator[0].armed = True
    fake = generator(torch.randn(8, 4))  # pauses on the NaN
    generator[0].armed = False
    helper.join(DEADLINE)
    (critic(fake.detach()).mean() - critic(torch.randn(8, 6)).mean()).backward()
    opt_d.step()
    opt_d.zero_grad()
    (-critic(fake).mean()).backward()
    opt_g.step()
    opt_g.zero_grad()
    assert "The update of step 0 will be skipped" in replies["skip"]["skipped"]
    assert _bitwise_equal(before, gan.state_dict())
    assert session.skipped_updates == [0] and session.step == 1


def test_without_a_skip_the_same_bad_update_lands():
    session, _, before, after = _adam_run("record", plant_at=2)
    try:
        assert session.skipped_updates == []
        assert not _bitwise_equal(before["params"], after["params"])
    finally:
        session.detach()


def test_a_person_skips_the_update_from_a_pause(watch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session = watch(model, optimizer=opt, on_hit="pause", rules=[NaN()])
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # momentum buffers exist now
    opt.zero_grad()
    params = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(opt.state_dict())

    helper, replies = _skip_when_paused(session)
    (model(torch.randn(3, 4)).sum() * float("nan")).backward()  # pauses on the NaN gradient
    opt.step()
    helper.join(DEADLINE)
    assert replies["skip"]["state"] == "paused"
    assert session.skipped_updates == [1]
    assert _bitwise_equal(params, model.state_dict())
    assert _bitwise_equal(state, opt.state_dict())


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_after_a_skip_the_same_fault_in_the_next_step_pauses_again(watch, sync):
    """k, then c: the fault came again in the next step, a repeat of the step before, which
    does not pause, so its update landed and wrote NaN into the weights k had kept clean. A
    repeat after a skipped update pauses: the update the skip kept out would land now."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="pause", rules=[NaN()], sync=sync)
    helper, paused = _person(session, ["skip", "continue"])  # k then c; then c
    for step in range(4):
        loss = model(torch.randn(3, 4)).sum() * (float("nan") if step >= 1 else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 2:  # before step 2's update; the person let it land (c)
            assert [step for step, _ in paused] == [1, 2]
    helper.join(DEADLINE)
    assert [step for step, _ in paused] == [1, 2] and session.skipped_updates == [1]


def _person(session, presses: list[str]) -> tuple[threading.Thread, list[tuple[int, str]]]:
    """A person at the UI, on a thread of their own: at each of ``len(presses)`` pauses, note
    where the training is, press ``k`` for "skip", then ``c``."""
    paused: list[tuple[int, str]] = []

    def at_the_ui() -> None:
        for press in presses:
            wait_until(lambda: session.controller.state == "paused")
            paused.append((session.step, session.phase))
            if press == "skip":
                LiveSource(session).control("skip")
            session.controller.resume()
            wait_until(lambda: session.controller.state != "paused")

    helper = threading.Thread(target=at_the_ui)
    helper.start()
    return helper, paused


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_after_a_skip_a_weight_that_stays_nan_pauses_the_next_step_before_its_update(watch, sync):
    """k, then c, on a weight set to NaN by hand (found in tmux): the next step's NaN was
    passed on from that weight, no origin, so nothing paused, and its update wrote NaN into
    every weight k had kept clean. The weight is that step's origin again, and says that a
    skip cannot clean it."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="pause", rules=[NaN()], sync=sync)
    helper, paused = _person(session, ["skip", "skip"])  # k then c, twice
    _train_with_a_weight_set_to_nan_at_step_1(model, opt)
    helper.join(DEADLINE)
    assert paused == [(1, "forward"), (2, "forward")] and session.skipped_updates == [1, 2]
    again = [h for h in session.hits if h.step == 2 and h.origin]
    assert [(h.tensor, h.kind) for h in again] == [("0.weight", "param")], again
    assert "since step 1" in again[0].message and "cannot clean" in again[0].message
    assert all(bool(p.isfinite().all()) for n, p in model.named_parameters() if n != "0.weight")


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_an_overflow_made_of_a_huge_finite_weight_names_that_weight(watch, sync):
    """An exploding learning rate in one parameter group sent a LayerNorm's weight to 3e38:
    the next forward's Inf was "produced here: this module's inputs and parameters were
    clean", with no word of the weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
    session = watch(model, on_hit="record", sync=sync)
    with torch.no_grad():
        model[1].weight.fill_(3e38)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    session.flush()
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "1.output", origin
    assert "1.weight (up to 3e+38) are so large" in origin.message, origin.message
    clean = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))  # an Inf of finite weights alone
    session = watch(clean, on_hit="record", sync=sync)
    clean(torch.full((4, 8), 3e38)).sum().backward()
    session.flush()
    assert not any("so large" in h.message for h in session.hits), session.hits


def _train_with_a_nan_batch(model: nn.Module, opt, steps: int, at: int,
                            batch: tuple[int, int]) -> None:  # fmt: skip
    """Train ``steps`` steps of random batches, the one of step ``at`` with a NaN."""
    for step in range(steps):
        x = torch.randn(*batch)
        if step == at:
            x[0, 0] = float("nan")
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def _train_with_a_weight_set_to_nan_at_step_1(model: nn.Module, opt, steps: int = 3) -> None:
    """Steps of ``mlp()``'s training; before step 1, one element of its first weight is set
    to NaN by hand, and stays so."""
    for step in range(steps):
        if step == 1:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_weight_already_nan_before_an_update_is_not_said_to_be_written_by_it(watch):
    """Step after step, a weight that had been NaN since a step before was said to be written
    by the update from its gradient, "skip such an update to keep the weights clean": untrue
    once it was bad before the update, and no skip cleans it."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()])
    _train_with_a_weight_set_to_nan_at_step_1(model, opt)
    said = {(h.step, h.tensor): h.message for h in session.hits
            if h.kind == "param" and h.phase == "optimizer"}  # fmt: skip
    # The update of step 1 wrote NaN into 4.bias, clean before it: that one it did write.
    assert "The update wrote it in from the gradient" in said[1, "4.bias"]
    # A skip now cannot help (k is refused after the update): it is the gradient's hit's.
    assert "It has landed" in said[1, "4.bias"] and "at the gradient's hit" in said[1, "4.bias"]
    for key in [(1, "0.weight"), (2, "0.weight"), (2, "4.bias")]:
        assert "before this update already, since step 1" in said[key], said[key]
        assert "cannot clean" in said[key] and "keep the weights clean" not in said[key]


def test_a_skip_asked_for_and_then_detached_from_still_drops_the_update(watch):
    """k, then q (detach and quit) in the UI: the update was applied, and nothing said the
    skip was dropped (found trying it in tmux). The skip holds after detaching."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session = watch(model, optimizer=opt, on_hit="pause", rules=[NaN()])
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    replies = {}

    def press():
        wait_until(lambda: session.controller.state == "paused")
        replies["skip"] = LiveSource(session).control("skip")
        session.detach()  # q

    helper = threading.Thread(target=press)
    helper.start()
    (model(torch.randn(3, 4)).sum() * float("nan")).backward()  # pauses on the NaN gradient
    helper.join(DEADLINE)
    assert session.detached and replies["skip"]["state"] == "paused"
    opt.step()
    assert _bitwise_equal(params, model.state_dict())
    assert _bitwise_equal(state, opt.state_dict())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # once only: the next update lands
    assert not _bitwise_equal(params, model.state_dict())


@pytest.mark.parametrize("sync", ["auto", "eager"])
def test_k_on_a_hit_found_after_the_update_is_refused_and_not_offered(watch, sync):
    """Paused on a parameter's hit, found after the optimizer's step: k said "the update of
    step 1 will be skipped" and the summary listed it as skipped, while the weights had
    changed (found trying the UI as a new user). The update is made: k is refused, saying so,
    the state the UI reads offers no k, and nothing is counted as skipped."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e30)  # the update overflows the weights
    session = watch(model, optimizer=opt, on_hit="pause", rules=[NaN(), Overflow()], sync=sync)
    states: list[dict] = []
    session.bus.subscribe(lambda event, payload: states.append(payload), ["state"])
    said = {}

    helper = _press_k_when_paused(session, said)
    (model(torch.randn(3, 4)).sum() * 1e30).backward()  # large, finite gradients
    before = copy.deepcopy(model.state_dict())
    opt.step()  # pauses on the Inf weight it wrote
    helper.join(DEADLINE)
    assert "update is made already (this hit was found after it)" in said["error"]
    assert [s.get("skippable") for s in states if s["state"] == "paused"] == [False]
    assert said["offered"] is False
    assert session.skipped_updates == [] and not _bitwise_equal(before, model.state_dict())


def test_a_steps_speed_leaves_out_the_time_it_was_paused(watch):
    """A person looked at a hit for half a second: the step's steps/s is the training's, not
    the person's (a step of this model takes milliseconds)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="pause", rules=[NaN()])

    def look_then_continue():
        wait_until(lambda: session.controller.state == "paused")
        time.sleep(0.5)
        session.controller.resume()

    helper = threading.Thread(target=look_then_continue)
    helper.start()
    (model(torch.randn(3, 4)).sum() * float("nan")).backward()  # pauses on the NaN gradient
    opt.step()
    helper.join(DEADLINE)
    step, _, _, rate = session.metrics.history[-1]
    assert step == 0 and rate > 5.0  # 2 steps/s or fewer with the pause counted


def test_skipping_forever_is_bounded(watch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="skip", rules=[NaN()], max_skipped_steps=3)
    with pytest.raises(tensordbg.WatchpointHit, match="skipped 3 updates in a row") as raised:
        for _ in range(10):
            (model(torch.randn(3, 4)).sum() * float("nan")).backward()
            opt.step()
            opt.zero_grad()
    assert session.skipped_updates == [0, 1, 2]
    assert raised.value.hit.origin


@pytest.mark.parametrize("sync", ["eager", "deferred"])
@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.AdamW])
def test_skipping_a_weight_set_to_inf_raises_with_that_weight_past_the_bound(watch, sync, make):
    """A weight set to Inf stays Inf while its updates are skipped: the later steps' hits are
    passed on, and the one raised past max_skipped_steps was one of them ("2.bias.grad ...
    passed on from upstream, not produced here"). It is the origin they came from, and it says
    since when, not that it was set after the last update (AdamW's state is finite: the
    sentence for a weight set between steps had taken its place, found trying it in tmux)."""
    model = mlp()
    opt = make(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="skip", max_skipped_steps=3, sync=sync)
    with pytest.raises(tensordbg.WatchpointHit, match="skipped 3 updates in a row") as raised:
        for step in range(10):
            if step == 2:
                with torch.no_grad():
                    model[0].weight[1, 1] = math.inf
            model(torch.randn(3, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert session.skipped_updates == [2, 3, 4]
    hit = raised.value.hit
    assert (hit.origin, hit.tensor) == (True, "0.weight"), str(hit)
    assert hit.step == 2 or "since step 2" in hit.message, str(hit)
    later = [h for h in session.hits if h.origin and h.step > 2]
    assert later and all("since step 2" in h.message for h in later), [h.message for h in later]


class MakesNaN(nn.Module):
    def forward(self, x):
        return x * float("nan")


class Branches(nn.Module):
    """Eight branches on the same clean input, each making its own NaN: eight origins."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(MakesNaN() for _ in range(8))

    def forward(self, x):
        return [branch(x) for branch in self.branches]


def test_the_summary_counts_what_it_does_not_list(watch):
    model = Branches()
    session = watch(model, on_hit="record", rules=[NaN()])
    model(torch.randn(2, 4))
    summary = session.summary()
    assert summary.startswith("tensordbg: 8 hits, 8 at their origin.")
    assert "... and 3 more at their origin (3 NaN)" in summary
    one = watch(MakesNaN(), on_hit="record", rules=[NaN()])
    one.model(torch.randn(2, 4))
    assert one.summary().startswith("tensordbg: 1 hit, at its origin."), one.summary()


def test_the_hook_that_shows_an_uncaught_hit_goes_at_detach_unless_an_error_is_on_its_way_up(
    watch, monkeypatch
):
    """attach(on_hit="raise"), and "skip" (which raises once it gave up skipping: its traceback
    ran through forty frames of PyTorch's and tensordbg's), put an excepthook before the
    interpreter's; a detach takes it
    away, but not one made while an error propagates (a framework's teardown): the hook must
    still be there when the hit reaches the top."""
    import sys

    from tensordbg.tracebacks import shows_hits

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    session = watch(mlp(), on_hit="skip")  # it raises too, past max_skipped_steps in a row
    assert shows_hits()
    session.detach()
    session = watch(mlp(), on_hit="raise")
    assert shows_hits()
    session.detach()
    assert sys.excepthook is sys.__excepthook__
    session = watch(mlp(), on_hit="raise")
    try:
        raise RuntimeError("a training step failed")
    except RuntimeError:
        session.detach()  # a trainer's teardown, inside its except block
    assert shows_hits()


def test_a_forked_child_prints_twenty_hits_then_says_more_are_not_printed(watch, capsys):
    """The banner promises FORKED_SAID (20) hits: 20 are printed, then one line says the rest
    are not, once."""
    from types import SimpleNamespace

    from tensordbg.engine.pausing import FORKED_SAID

    session = watch(nn.Linear(2, 2), on_hit="record")
    session.pid = -1  # as in a forked child: the attaching process is another one
    for step in range(FORKED_SAID + 5):
        session.say_forked_hit(SimpleNamespace(origin=True, step=step, phase="forward", rule="NaN",
                                               message="x holds NaN.", tensor="x"))  # fmt: skip
    lines = capsys.readouterr().err.splitlines()
    assert len([line for line in lines if "[NaN]" in line]) == FORKED_SAID
    assert [line for line in lines if "more hits" in line] == [lines[-1]]
    assert f"{FORKED_SAID} at most" in lines[0]


@pytest.mark.parametrize("sync", MODES)
def test_an_optimizer_whose_step_calls_its_parents_counts_one_step(watch, sync):
    """torch runs the step hooks of each class's step: a subclass of SGD that clamps the
    weights after ``super().step()`` ran them twice a step, and each iteration counted as two
    steps (a NaN at the third was said to be at step 4)."""

    class ClampedSGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            loss = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    p.clamp_(-10, 10)
            return loss

    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD's own step is hooked now too
    torch.manual_seed(0)
    model = mlp()
    opt = ClampedSGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    _train_with_a_nan_batch(model, opt, steps=4, at=2, batch=(3, 4))
    assert session.step == 4
    first = next(h for h in session.hits if h.origin)
    assert (first.step, first.phase) == (2, "forward")


class _Matched(nn.Module):
    """``inner``'s input is made by the root's own code (a ReLU between modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(torch.relu(self.enc(x)) * 4))


@pytest.mark.parametrize("sync", MODES)
def test_a_rule_whose_match_leaves_the_makers_output_out_still_has_an_origin(watch, sync):
    """TensorRange(match="inner.*") fired 61 times, each "passed on from upstream", and never
    paused (the README's own example has this shape): the value came from the root's own code,
    whose output the rule does not judge. The input the rule judges is the origin, made by
    that code; later steps repeat it, the first pauses."""
    from tensordbg.rules import TensorRange

    torch.manual_seed(0)
    model = _Matched()
    rule = TensorRange(match="inner.*", max_gt=0.5)
    session = watch(model, on_hit="record", rules=[rule], sync=sync)
    with torch.no_grad():
        model(torch.randn(64, 8))
    session.flush()
    [origin] = [h for h in session.hits if h.origin]
    assert (origin.tensor, origin.module, origin.step) == ("inner.input[0]", "", 0)
    assert "produced by the model's own forward code between its submodules" in origin.message


class _NaNAt(nn.Module):
    """Makes a NaN in its output at its ``at``-th call (its own code, no parameter)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * float("nan") if self.calls == self.at + 1 else x


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_weight_of_an_unwatched_layer_explains_every_later_output(watch, sync):
    """include= left every layer unwatched: after the NaN of step 3 reached the weights, each
    later step's output was a new origin "made by the model's own code" (10 origins, one a
    step). The unwatched layers' weights are the watched root's own, to the call tree."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _NaNAt(3), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync,
                    include="nothing.*")  # fmt: skip
    for _ in range(7):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [(h.tensor, h.step, h.phase) for h in session.hits if h.origin] == [
        ("output", 3, "forward")
    ]


class Tanh(nn.Module):
    """A wrapper: tanh of its Linear's output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Squashed(nn.Module):
    """tanh hides what ``mid`` makes of an Inf: the output and the loss stay finite."""

    def __init__(self, wrapped: bool):
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.mid = Tanh() if wrapped else nn.Linear(8, 8)
        self.wrapped = wrapped

    def forward(self, x):
        h = self.mid(torch.relu(self.enc(x)))
        return self.head(h if self.wrapped else torch.tanh(h))


@pytest.mark.parametrize("wrapped", [False, True], ids=["tanh-in-the-root", "tanh-in-mid"])
@pytest.mark.parametrize("sync", MODES)
def test_a_weight_set_to_inf_that_the_outputs_hide_is_the_origin_in_every_mode(
    watch, sync, wrapped
):
    """Deferred checks screen no activation of a forward whose output and loss are finite: the
    NaN gradient the Inf weight made in ``mid`` was named "produced by this module's backward:
    the gradient of its output was clean", and on_hit="raise" raised on it. The parameters are
    read whole before a gradient that is not finite is judged. With the tanh inside ``mid``,
    eager checks named mid.input[0] (the root's relu of enc's Inf) a second origin, made by
    mid's own code, which only handed its input on."""
    model = Squashed(wrapped)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                model.enc.weight[1, 2] = math.inf
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        assert step != 1 or torch.isfinite(loss)  # hidden from the guards (step 2: NaN)
        session.observe("loss", loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    session.flush()
    assert {(h.step, h.tensor) for h in session.hits if h.origin} == {(1, "enc.weight")}, [
        (h.step, h.phase, h.rule, h.tensor, h.message) for h in session.hits if h.origin
    ]


class SqrtBlock(nn.Module):
    """x + sqrt(l(x)) when ``bad``: a NaN its forward makes (sqrt of negatives)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.bad = False

    def forward(self, x):
        h = self.l(x)
        return x + (h.sqrt() if self.bad else h)


class CheckpointedSqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.b, self.head = nn.Linear(8, 8), SqrtBlock(), nn.Linear(8, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.b, self.inp(x), use_reentrant=True))


@pytest.mark.parametrize("sync", MODES)
def test_a_forward_nan_in_a_reentrant_checkpoint_is_the_one_origin(watch, sync):
    """The NaN a checkpointed block's forward made was named there; then its parameters'
    gradients, which no hook sees made, were named a second origin ("the backward of b or of
    a module in it made it") though they only carried the block's own forward NaN back."""
    torch.manual_seed(0)
    model = CheckpointedSqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    for step in range(3):
        model.b.bad = step == 1
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        session.observe("loss", loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    session.flush()
    assert [(h.step, h.phase, h.tensor) for h in session.hits if h.origin] == [
        (1, "forward", "b.output")
    ], [(h.step, h.phase, h.tensor, h.message) for h in session.hits if h.origin]


class CheckpointedChain(Checkpointed):
    """Three blocks run through reentrant checkpointing, the last's forward makes a NaN
    (sqrt of negatives) when ``bad``: the blocks before it and ``inp`` get NaN gradients."""

    def __init__(self):
        nn.Module.__init__(self)
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.blocks = nn.ModuleList(SqrtBlock() for _ in range(3))


@pytest.mark.parametrize("sync", MODES)
def test_a_forward_nan_after_reentrant_blocks_is_not_a_backward_origin_in_them(watch, sync):
    """The NaN a later block's forward made flows back into the gradients of every block
    before it, which no hook sees: each earlier block's parameter gradients were named a second
    origin ("the backward of blocks.1 or of a module in it made it"). The gradient of a block's
    outputs came out of a call whose forward had the NaN: they pass it on."""
    torch.manual_seed(0)
    model = CheckpointedChain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    for step in range(3):
        model.blocks[2].bad = step == 1
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        session.observe("loss", loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    session.flush()
    assert any(h.tensor == "blocks.0.l.weight.grad" for h in session.hits)  # it did reach them
    assert [(h.step, h.phase, h.tensor) for h in session.hits if h.origin] == [
        (1, "forward", "blocks.2.output")
    ], [(h.step, h.phase, h.tensor, h.message) for h in session.hits if h.origin]


def test_a_rule_whose_pattern_names_nothing_of_the_model_is_said_at_attach(watch, capsys):
    """--rule "TensorRange(match='*.attn.*', max_gt=1e4)" on a model with no attention ran,
    judged nothing and said nothing. A pattern that names a module, a tensor or a parameter,
    or names no path at all (an observed tensor, "loss"), is said nothing of."""
    from tensordbg.rules import TensorRange

    rules = [NaN(), TensorRange(match="*.attn.*", max_gt=1e4),
             TensorRange(match="0.output", max_gt=1.0), NaN(match="loss")]  # fmt: skip
    watch(mlp(), rules=rules, on_hit="record")
    said = [line for line in capsys.readouterr().err.splitlines() if "names no module" in line]
    assert len(said) == 1 and said[0].startswith(
        "tensordbg: TensorRange(match=['*.attn.*']) names no module, tensor or parameter of "
        "Sequential (its names look like '"
    ), said


class CarriesState(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = (
            nn.Linear(4, 8),
            nn.GRU(8, 8, batch_first=True),
            nn.Linear(8, 1),
        )

    def forward(self, x, h):
        out, h = self.rnn(self.emb(x), h)
        return self.head(out), h


@pytest.mark.parametrize("sync", MODES)
def test_a_hidden_state_carried_from_a_bad_step_is_passed_on_not_a_new_origin(watch, sync):
    """A NaN in step 1's batch came back in every later step with the GRU's hidden state
    (``h = h.detach()``), and each step named it an origin that "came in with the batch". It
    is step 1's output handed back in; a NaN in a new tensor of the same shape still is an
    origin of its own."""
    torch.manual_seed(0)
    model = CarriesState()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync, rules=[NaN()])
    h = torch.zeros(1, 2, 8)
    for step in range(4):
        x = torch.randn(2, 3, 4)
        x[0, 0, 0] = float("nan") if step == 1 else x[0, 0, 0]
        if step == 3:
            h = torch.full((1, 2, 8), float("nan"))  # not handed back: made anew
        y, h = model(x, h)
        h = h.detach()
        opt.zero_grad()
        y.pow(2).mean().backward()
        opt.step()
    session.flush()
    inputs = {(h.step, h.tensor): h for h in session.hits if h.tensor.startswith("input")}
    assert [key for key, hit in sorted(inputs.items()) if hit.origin] == [
        (1, "input[0]"), (3, "input[1]")], [(k, h.message) for k, h in inputs.items()]  # fmt: skip
    assert "It is rnn.output[1] of step 1, handed back in" in inputs[2, "input[1]"].message
    assert "came in with the batch" in inputs[1, "input[0]"].message
    # A later argument, not the batch: a value the script hands in (this one made anew).
    assert "a state it carries from step to step" in inputs[3, "input[1]"].message


class CheckpointsItsBody(nn.Module):
    """A layer whose forward runs its body through a reentrant checkpoint, as Hugging Face's
    layers do: its own hooks run outside the checkpoint, its submodules' inside."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.fault = None

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._body, x, use_reentrant=True)

    def _body(self, x):
        h = self.fc1(self.ln(x))
        if self.fault == "forward":
            h = h + torch.log(h.new_tensor(-1.0))  # the layer's own code makes a NaN
        elif self.fault == "backward":
            h = NaNBackward()(h)
        return x + self.fc2(torch.relu(h))


class LayersCheckpointingTheirBodies(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.layers = nn.ModuleList(CheckpointsItsBody() for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_a_layer_that_checkpoints_its_body_has_one_origin_named_alike_in_every_mode(
    watch, sync, fault
):
    """Hugging Face's gradient checkpointing with use_reentrant=True: a NaN layers.1's own code
    made in forward was named there, and its fc1's parameter gradients a second origin, said to
    come from "layers.1.fc1 or just after it" (the block run again is layers.1). A NaN its
    backward made was named at fc1's bias in eager and batched checks, at its weight in
    deferred ones, which sorted the parameters of a recomputed block by their listing."""
    model = LayersCheckpointingTheirBodies()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):
            model.layers[1].fault = fault if step == 1 else None
            loss = nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
            session.observe("loss", loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        session.flush()
    # The re-run that names the operation warned as if the user's checkpoint had no input
    # that requires grad.
    assert [str(w.message) for w in said] == []
    found = {(h.step, h.phase, h.tensor) for h in session.hits if h.origin}
    if fault == "forward":
        assert found == {(1, "forward", "layers.1.output")}, found
    else:
        assert found == {(1, "backward", "layers.1.fc1.bias.grad")}, found
        hit = next(h for h in session.hits if h.origin)
        assert "runs layers.1 again in backward" in hit.message, hit.message


def test_learning_a_recomputed_blocks_gradient_order_hooks_each_parameter_once(watch):
    """Deferred checks hook a reentrant block's parameters once, to learn the order their
    gradients accumulate in; a parameter no pass reaches (``unused``) was hooked anew at every
    step, and the session's handles grew with the run."""
    model = LayersCheckpointingTheirBodies()
    model.layers[0].unused = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    session = watch(model, optimizer=opt, on_hit="record", sync="deferred")
    held = []
    for _ in range(6):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        held.append(len(session.handles._undo))
    assert held[1:] == held[:1] * 5, held


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_among_many_values_says_where_the_first_one_is(watch, sync):
    """ "input[0] holds 1 NaN among 24576 values ... It came in with the batch": neither the hit
    nor the Tensor tab said which sample, and the person scrolled through the batch for it."""
    model = mlp()
    session = watch(model, on_hit="record", sync=sync, rules=[NaN()])
    x = torch.randn(6, 4)
    x[3, 2] = float("nan")
    model(x).sum().backward()
    session.flush()
    hit = next(h for h in session.hits if h.origin)
    assert hit.tensor == "input[0]" and "holds 1 NaN among 24 values. The first is at [3, 2]." in (
        hit.message
    ), hit.message
    # All of them bad: where the first is says nothing.
    model(torch.full((6, 4), float("nan"))).sum().backward()
    session.flush()
    hit = next(h for h in session.hits if h.origin and h.step == 1)
    assert "holds 24 NaN among 24 values." in hit.message and "The first" not in hit.message


def test_a_scripts_once_only_warning_is_not_said_again_after_attach_or_detach(tmp_path):
    """Attaching to a model with a fused module (a TransformerEncoder) added a warnings filter
    through filterwarnings(), which makes every module forget the warnings it said once: under
    `tensordbg run`, torch's once-only "mismatched src_key_padding_mask" warning of a script's
    first forward was said again at its next (found trying the product as a new user)."""
    script = tmp_path / "warns.py"
    script.write_text(
        textwrap.dedent("""
        import warnings, torch, tensordbg
        from torch import nn

        def said_once():
            warnings.warn("said once here", UserWarning)

        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        torch.optim.SGD(model.parameters(), lr=0.1)  # (imports what a training imports)
        said_once()
        session = tensordbg.attach(model, server=False, summary_at_exit=False)
        said_once()
        session.detach()
        said_once()
    """)
    )
    done = zygote.run([sys.executable, str(script)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("UserWarning: said once here") == 1, done.stderr


@pytest.mark.parametrize("sync", MODES)
def test_weights_an_earlier_update_made_nan_are_not_said_to_be_where_it_was_first_produced(
    watch, sync
):
    """A NaN batch at step 1, its update landing (on_hit="record"): at step 2 every layer's
    weights hold NaN. The hits of that forward said "first produced at 0.weight" for the
    layers after it, whose own weights the update had made NaN (found trying the product as a
    new user): 0.weight was where this forward met it first, and produced nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    _train_with_a_nan_batch(model, opt, steps=3, at=1, batch=(6, 4))
    said = {h.tensor: h.message for h in session.hits if h.step == 2 and h.phase == "forward"}
    assert "first produced at" not in " ".join(said.values())
    assert said["1.output"].endswith(
        "passed on from upstream (from 0.weight, which held NaN or Inf before this forward), "
        "not produced here."
    )
    assert said["2.output"].endswith(
        "own parameters 2.weight, which held NaN or Inf before this forward, not produced here."
    )


def test_parameters_the_optimizer_holds_frozen_are_said_once(watch, capsys):
    """A layer left frozen by mistake (requires_grad=False, still in the optimizer) never
    learns, and nothing said so in 56 steps of a new user's run: its gradient and update are
    not checked, so tensordbg says it once, at the optimizer's first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record")
    for _ in range(3):
        model(torch.randn(6, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    err = capsys.readouterr().err
    assert err.count("do not require grad") == 1
    assert "the optimizer holds 2 parameters that do not require grad (0.bias, 0.weight)" in err
    assert not session.hits


class _MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        scores = self.q(x) @ x.transpose(-1, -2) + mask  # an additive mask: 0 or -inf
        return torch.softmax(scores, -1) @ x


class _MaskingModel(nn.Module):
    """Attention given an additive mask, either the model's own input or built by its code."""

    def __init__(self, builds_mask: bool):
        super().__init__()
        self.attn, self.out, self.builds_mask = _MaskedAttention(), nn.Linear(8, 1), builds_mask

    def forward(self, x, keep):
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) if self.builds_mask \
            else keep  # fmt: skip
        return self.out(self.attn(x, mask))


@pytest.mark.parametrize(
    "builds_mask", [True, False], ids=["mask-built-by-the-model", "mask-input"]
)
@pytest.mark.parametrize("sync", MODES)
def test_a_softmax_over_a_row_a_mask_left_all_minus_inf_is_named_at_the_attention(
    watch, sync, builds_mask
):
    """A row the mask leaves all -inf makes softmax NaN inside the attention module. The mask's
    -inf is by design, yet it made the NaN "come in with the mask" (or with the model code
    that built it) and the attention module got no hit (found trying the product as a new
    user on a GPT-2-style fine-tune)."""
    torch.manual_seed(0)
    model = _MaskingModel(builds_mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    keep = torch.ones(2, 4, 4, dtype=torch.bool).tril()
    x = torch.randn(2, 4, 8)
    clean = keep if builds_mask else torch.zeros(2, 4, 4).masked_fill(~keep, float("-inf"))
    model(x, clean).sum().backward()  # a causal mask: healthy
    opt.step()
    opt.zero_grad()
    assert not session.hits
    keep[1, 0, :] = False  # a row with nothing to attend to
    bad = keep if builds_mask else torch.zeros(2, 4, 4).masked_fill(~keep, float("-inf"))
    model(x, bad).sum().backward()
    opt.step()
    origins = [h for h in session.hits if h.origin]
    assert [(h.tensor, h.module, h.step, h.phase) for h in origins] == [
        ("attn.output", "attn", 1, "forward")
    ]
    assert "torch.softmax" in origins[0].message or "softmax" in origins[0].message
    assert not [h for h in session.hits if h.kind == "input"]


@pytest.mark.parametrize("observed", [False, True], ids=["loss-not-observed", "loss-observed"])
def test_a_nan_loss_no_one_observed_is_not_said_to_be_finite(watch, observed):
    """A hand-written mean over the real tokens of a batch that has none: 0/0. Without
    observe(), deferred checks name the backward where the NaN showed and said "its outputs and
    loss were finite" of a loss they never read (found trying the product as a new user);
    with the loss observed, it is named at its line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    session = watch(model, on_hit="record", rules=[NaN()], sync="deferred")
    out = model(torch.randn(6, 4)).squeeze(-1)
    real = torch.zeros(6)  # every token is padding
    loss = (out * real).sum() / real.sum()
    if observed:
        session.observe("loss", loss)
    loss.backward()
    session.flush()
    first = next(h for h in session.hits if h.origin)
    if observed:
        assert (first.tensor, first.phase) == ("loss", "forward")
    else:
        assert first.phase == "backward"
        assert "loss were finite" not in first.message
        assert "no loss was observed" in first.message
        assert "session.observe('loss', loss)" in first.message
