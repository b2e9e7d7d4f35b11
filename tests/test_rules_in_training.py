"""Every built-in rule, attached to a real training, finds the fault planted for it: in the right
module, at the right step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tensordbg.rules import (
    AllZero,
    DeadActivation,
    ExplodingGradient,
    LossNotDecreasing,
    NaN,
    Overflow,
    PoorInitialization,
    SaturatedActivation,
    TensorRange,
    VanishingGradient,
    WeightNotChanging,
    WeightUpdateRatio,
)


def net(*layers: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*layers)


def steps(model, optimizer, session, n, x=None, loss_scale=1.0):
    for _ in range(n):
        inputs = torch.randn(16, 8) if x is None else x
        loss = model(inputs).pow(2).mean() * loss_scale
        session.observe("loss", loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def hits_of(session, rule: str):
    return [h for h in session.hits if h.rule == rule]


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_nan_and_overflow_in_a_layers_output(watch, sync):
    model = net(nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    steps(model, optimizer, session, 2)
    with torch.no_grad():
        model[1].bias[0] = math.inf  # set between steps: the next forward meets it first
    steps(model, optimizer, session, 1)
    # The forward meets the Inf in layer 1's own bias before anything else: the parameter is
    # the origin (it changed since it was last checked), and the output only passes it on.
    first = hits_of(session, "Overflow")[0]
    assert (first.tensor, first.kind, first.module, first.step, first.origin) == (
        "1.bias",
        "param",
        "1",
        2,
        True,
    )
    output = next(h for h in hits_of(session, "Overflow") if h.tensor == "1.output")
    assert not output.origin and "first produced at 1.bias" in output.message
    assert "inputs and parameters were clean" not in output.message
    # Its inputs were clean: the sentence names its own parameter, not "upstream".
    assert "passed on from this module's own parameters 1.bias" in output.message
    assert any(h.rule == "NaN" and h.phase == "backward" for h in session.hits)  # Inf - Inf
    # The Inf is the one origin; the NaN it turns into is passed on from it. The gradient of the
    # loss is +Inf in output column 0, so 1.weight.grad[0] sums +Inf times activations of both
    # signs: Inf - Inf, in the first gradient the backward computes.
    assert [(h.rule, h.tensor) for h in session.hits if h.origin] == [("Overflow", "1.bias")]
    nan = hits_of(session, "NaN")[0]
    assert (nan.tensor, nan.module, nan.kind, nan.phase, nan.step) == (
        "1.weight.grad",
        "1",
        "grad",
        "backward",
        2,
    )
    # 0.bias.grad sums, over the batch, Infs of one sign per unit: Inf, never NaN.
    assert {h.tensor for h in hits_of(session, "NaN") if h.phase == "backward"} == {
        "1.weight.grad",
        "0.weight.grad",
    }


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN wherever x < 0


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_only_the_nan_at_its_origin_says_what_usually_makes_a_nan(watch, sync):
    """What usually makes a NaN is said where the NaN was made; a hit that only passed it on
    names that place instead of repeating the advice."""
    model = net(nn.Linear(8, 8), Log(), nn.Linear(8, 8), nn.Linear(8, 2))
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    with torch.no_grad():
        model(torch.randn(16, 8))
    session.flush()
    [made] = [h for h in session.hits if h.origin]
    assert made.tensor == "1.output" and "usually comes from 0/0" in made.message
    passed = [h for h in session.hits if not h.origin]
    assert [h.tensor for h in passed] == ["2.output", "3.output"]
    for hit in passed:
        assert "first produced at 1.output" in hit.message
        assert "usually comes from" not in hit.message


def test_overflow_warns_a_float16_tensor_before_it_overflows(watch):
    model = net(nn.Linear(8, 8)).half()
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[0].bias.zero_()
    session = watch(model, on_hit="record", rules=[Overflow()])
    with torch.no_grad():
        model(torch.full((2, 8), 10000.0, dtype=torch.float16))  # 40,000: finite, near 65,504
    session.flush()
    [hit] = hits_of(session, "Overflow")
    assert hit.kind == "output" and hit.value >= 0.5 * 65504 and math.isfinite(hit.value)
    assert (hit.module, hit.step, hit.origin) == ("0", 0, True)
    assert hit.value == 8 * 0.5 * 10000.0  # the output's largest value, exact in float16


def test_exploding_gradient_on_a_rising_learning_rate(watch):
    model = net(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[ExplodingGradient()])
    steps(model, optimizer, session, 15)
    steps(model, optimizer, session, 1, loss_scale=1e4)  # a gradient 10,000x its usual size
    assert hits_of(session, "ExplodingGradient") == []  # one step: a hard batch
    steps(model, optimizer, session, 1, loss_scale=3e4)  # and the next step higher still
    [first, *_] = hits_of(session, "ExplodingGradient")
    assert first.step == 16 and first.kind == "grad" and first.value > 20
    # The backward reaches the last layer first; every gradient grew 10,000x, none before.
    assert (first.module, first.origin) == ("2", True) and first.value > 1e3
    assert {(h.tensor, h.step) for h in hits_of(session, "ExplodingGradient")} == {
        ("2.weight.grad", 16),
        ("2.bias.grad", 16),
        ("0.weight.grad", 16),
        ("0.bias.grad", 16),
    }


def test_vanishing_gradient_behind_a_saturated_layer(watch):
    model = net(nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.fill_(40.0)  # sigmoid(40) == 1.0 in float32: a zero derivative
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[VanishingGradient()])
    steps(model, optimizer, session, 2)  # an exactly zero gradient on step 0 waits a step
    assert {h.tensor for h in hits_of(session, "VanishingGradient")} == {
        "0.weight.grad",
        "0.bias.grad",
    }


class _Tiny(nn.Module):
    def forward(self, x):
        return x * 1e-9


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_a_gradient_vanishing_through_most_of_the_model_is_found_though_the_median_vanishes(
    watch, sync
):
    """A scale of 1e-9 in the middle of a tanh MLP: the first layers' gradients are 1e-12 and
    so is the model's median, so nothing was said, and WeightNotChanging called such a
    gradient "not negligible". The largest gradient is the yardstick once the median
    vanished with them."""
    model = net(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), _Tiny(),
                nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    steps(model, optimizer, session, 4, x=torch.randn(64, 8))
    vanishing = hits_of(session, "VanishingGradient")
    # (5.weight's gradient is its input, 1e-9 times the tanh's, times a healthy gradient.)
    assert {h.tensor for h in vanishing} == {"5.weight.grad"} | {
        f"{i}.{p}.grad" for i in (0, 2) for p in ("weight", "bias")}  # fmt: skip
    assert (
        "the largest gradient of this step or the last (root-mean-square " in vanishing[0].message
    )
    assert not [h for h in session.hits if h.rule != "VanishingGradient"]


def test_weight_not_changing_and_weight_update_ratio(watch):
    model = net(nn.Linear(8, 8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "lr": 10.0},
            {"params": model[1].parameters(), "lr": 0.0},
        ]
    )
    rules = [WeightNotChanging(), WeightUpdateRatio(large_threshold=1.0)]
    session = watch(model, optimizer=optimizer, on_hit="record", rules=rules)
    steps(model, optimizer, session, 4)
    assert {h.tensor for h in hits_of(session, "WeightNotChanging")} == {
        "1.weight.update",
        "1.bias.update",
    }
    ratio = hits_of(session, "WeightUpdateRatio")
    assert {h.module for h in ratio if h.value > 1.0} == {"0"}  # a learning rate of 10
    assert {h.module for h in ratio if h.value < 1e-8} == {"1"}  # a learning rate of 0


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_a_small_learning_rate_is_learning_not_a_weight_that_does_not_change(watch, sync):
    """AdamW at a fine-tuning learning rate of 2e-6 moves a LayerNorm weight near 1 by about
    2e-6 of itself a step: it learns, and WeightNotChanging says nothing. MindInsight's and
    SageMaker's tolerance (rtol 1e-5) calls it unchanged from the third step."""

    def not_changing(rule: WeightNotChanging) -> set[str]:
        model = net(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-6)
        session = watch(model, optimizer=optimizer, on_hit="record", rules=[rule], sync=sync)
        steps(model, optimizer, session, 8)
        return {h.tensor for h in hits_of(session, "WeightNotChanging")}

    assert not_changing(WeightNotChanging()) == set()
    assert "1.weight.update" in not_changing(WeightNotChanging(rtol=1e-5, atol=1e-8))


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_the_tail_of_a_schedule_to_zero_is_not_a_weight_that_does_not_change(watch, sync):
    """At the end of a cosine schedule to 0 (3e-3 down to 5e-7 over 1,500 steps) AdamW moves a
    LayerNorm weight near 1 by less than half a float32 step: not one element moves, by design.
    It was reported in the last 12 steps of a healthy run (a new user's); a learning rate decayed
    below 1 % of its largest is the schedule's doing. ``decayed=0`` judges those steps too."""

    def not_changing(rule: WeightNotChanging) -> set[str]:
        model = net(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        session = watch(model, optimizer=optimizer, on_hit="record", rules=[rule], sync=sync)
        steps(model, optimizer, session, 5)
        optimizer.param_groups[0]["lr"] = 1e-9  # the schedule's tail
        steps(model, optimizer, session, 6)
        return {h.tensor for h in hits_of(session, "WeightNotChanging")}

    assert not_changing(WeightNotChanging()) == set()
    assert "1.weight.update" in not_changing(WeightNotChanging(decayed=0.0))


def test_bfloat16_weights_that_a_small_learning_rate_cannot_move_are_not_changing(watch):
    """bfloat16 holds 8 bits of a weight: an SGD step of 1e-4 of it rounds away in every
    element, so the weights stay as they were although the gradient asks them to move."""
    model = net(nn.Linear(8, 8), nn.Linear(8, 2)).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[WeightNotChanging()])
    steps(model, optimizer, session, 4, x=torch.randn(16, 8, dtype=torch.bfloat16))
    assert {h.tensor for h in hits_of(session, "WeightNotChanging")} >= {"0.weight.update"}
    assert "too small for its dtype" in hits_of(session, "WeightNotChanging")[0].message
    # The dtype is why (the sentence names every cause): in float32 the same steps move them.
    twin = net(nn.Linear(8, 8), nn.Linear(8, 2))
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=1e-5)
    twin_session = watch(twin, optimizer=twin_optimizer, on_hit="record",
                         rules=[WeightNotChanging()])  # fmt: skip
    steps(twin, twin_optimizer, twin_session, 4)
    assert hits_of(twin_session, "WeightNotChanging") == []


def test_dead_and_saturated_activations(watch):
    model = net(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU unit dead
        model[2].bias.fill_(100.0)  # every tanh unit saturated
    rules = [DeadActivation(), SaturatedActivation()]
    session = watch(model, on_hit="record", rules=rules)
    model(torch.randn(32, 8))
    session.flush()
    assert [(h.rule, h.module) for h in session.hits] == [
        ("DeadActivation", "1"),
        ("SaturatedActivation", "3"),
    ]


def test_all_zero_and_poor_initialization_at_attach(watch):
    model = net(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        model[2].weight.zero_()
    session = watch(model, on_hit="record", rules=[AllZero(kinds={"param"}), PoorInitialization()])
    found = {(h.rule, h.tensor, h.step) for h in session.hits}
    assert ("AllZero", "2.weight", 0) in found
    assert ("PoorInitialization", "2.weight", 0) in found


def test_a_bias_initialised_to_zero_is_all_zero_only_if_no_update_moves_it(watch):
    """AllZero reported every zero-initialised LayerNorm bias at attach; one that no update
    moves (it gets no gradient) is still reported, from step 1."""
    model = net(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8, bias=False))
    model.append(nn.LayerNorm(8))
    model[3].bias.requires_grad_(False)  # frozen: never moves
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[AllZero(kinds={"param"})])
    steps(model, optimizer, session, 3)
    assert {h.tensor for h in session.hits} == {"3.bias"}
    assert min(h.step for h in session.hits) == 1


def test_loss_not_decreasing_on_an_observed_loss(watch):
    model = net(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # nothing learns
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[LossNotDecreasing()])
    x = torch.randn(16, 8)
    steps(model, optimizer, session, 25, x=x)
    [hit, *_] = hits_of(session, "LossNotDecreasing")
    assert hit.kind == "observed" and hit.tensor == "loss"
    # Windows of 10 steps: steps 10-19 are judged against 0-9 when step 20's loss comes; the
    # next verdict would come at step 30, past the end.
    assert hits_of(session, "LossNotDecreasing") == [hit]
    assert (hit.module, hit.step, hit.origin) == ("", 20, True)
    assert "over steps 10-19 against" in hit.message and "over steps 0-9" in hit.message


def test_loss_not_decreasing_takes_a_step_s_micro_batches_as_one_loss(watch):
    """Four micro-batches a step, each loss observed (loss, loss#1, loss#2, loss#3): each was
    a curve of its own, and every verdict came four times."""
    model = net(nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[LossNotDecreasing()])
    for step in range(31):
        for micro in range(4):
            loss = model(torch.ones(1, 2)).sum() * 0 + 1.0 + 0.01 * step + 0.001 * micro
            session.observe("loss", loss)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    found = hits_of(session, "LossNotDecreasing")
    assert [(h.step, h.tensor) for h in found] == [(20, "loss"), (30, "loss")]
    # The step's mean of its four: steps 10-19 against 0-9.
    assert "mean 1.147 over steps 10-19 against 1.047 over steps 0-9" in found[0].message


def test_tensor_range_on_a_pattern(watch):
    model = net(nn.Linear(8, 8), nn.Linear(8, 1))
    session = watch(model, on_hit="record", rules=[TensorRange(match="0.output", max_gt=1e3)])
    with torch.no_grad():
        model(torch.full((2, 8), 1e4))
    session.flush()
    assert [(h.rule, h.tensor) for h in session.hits] == [("TensorRange", "0.output")]


def test_a_rule_from_the_entry_point_group_runs_in_a_session(watch, monkeypatch):
    import tensordbg.rules.catalog as catalog
    from tensordbg.rules import Finding, Rule
    from tensordbg.statistics import MAX

    class Over100(Rule):
        """Anything above 100."""

        kinds = frozenset({"output"})
        needs = (MAX,)

        def check(self, t, state):
            peak = t.get(MAX)
            return Finding(peak, 100.0, f"{t.name} peaks at {peak}") if peak > 100 else None

    class EntryPoint:
        name = "Over100"

        def load(self):
            return Over100

    monkeypatch.setattr(catalog, "entry_points", lambda group: [EntryPoint()])
    model = net(nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.fill_(0.1)
    session = watch(model, on_hit="record", rules=[catalog.available_rules()["Over100"](), NaN()])
    with torch.no_grad():
        model(torch.full((1, 8), 1e3))
    session.flush()
    assert [h.rule for h in session.hits] == ["Over100"]


def test_a_residual_branch_zero_initialised_is_not_a_vanishing_gradient(watch):
    """torchvision's zero_init_residual=True: each block's last BatchNorm scale starts at 0, so
    the convolution before it gets an exactly zero gradient on step 0, and learns from step 1."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(4)
            nn.init.zeros_(self.bn.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.bn(self.conv(x)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(), Block(), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 2))  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    session = watch(model, optimizer=optimizer, on_hit="record")
    for _ in range(8):
        x = torch.randn(16, 3, 8, 8)
        loss = nn.functional.cross_entropy(model(x), (x.mean((1, 2, 3)) > 0).long())
        session.observe("loss", loss)
        loss.backward()
        assert model[1].conv.weight.grad.abs().sum() > 0 or session.step == 0
        optimizer.step()
        optimizer.zero_grad()
    assert [h.tensor for h in session.hits] == []


@pytest.mark.parametrize("retain_bytes", [0, 2**20], ids=["not kept", "kept"])
def test_batched_checks_read_what_a_rule_asks_for_in_the_phase_transfer_from_its_next_step(
    watch, monkeypatch, retain_bytes
):
    """A rule that asks for more statistics near its threshold (VanishingGradient: the range,
    then the exact mean |grad| and its zeros) gets them, from the next step on, with the
    tensor's other statistics in the phase's one transfer: no read of the tensor per step (on
    CUDA, one synchronization each), and a verdict even for a tensor the session did not keep."""
    from tensordbg.engine.pipeline import Pipeline

    reads = []
    measure = Pipeline.measure
    monkeypatch.setattr(Pipeline, "measure", lambda self, *a: reads.append(self.step) or
                        measure(self, *a))  # fmt: skip
    torch.manual_seed(0)
    model = net(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=optimizer, on_hit="record", sync="batched",
                    rules=[VanishingGradient(persist=1)], retain_bytes=retain_bytes)  # fmt: skip
    steps(model, optimizer, session, 5, x=torch.randn(16, 8) * 1e-9)  # tiny first-layer grads
    assert set(reads) <= {0}  # what the rule asked for at step 0, read at once if it was kept
    found = {(h.tensor, h.step) for h in hits_of(session, "VanishingGradient")}
    first = 0 if retain_bytes else 2  # two questions in a row: learnt at steps 0 and 1
    assert found == {("0.weight.grad", step) for step in range(first, 5)}


class _Shrink(nn.Module):
    def forward(self, x):
        return x * 1e-9  # everything before it gets a gradient a billion times too small


@pytest.mark.parametrize("sync", ["batched", "deferred-on-device"])
def test_vanishing_gradients_get_the_same_verdicts_and_sentences_as_the_default_mode(watch, sync):
    """VanishingGradient compares a gradient with the model's typical one. However the mode
    brings the statistics (deferred checks ask for the exact mean again near the threshold;
    batched ones have it with the others from the second step on), a pass's gradients are
    judged together: the same hits, with the same typical gradient in their sentences."""
    from conftest import DEFERRED_ON_DEVICE

    def run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _Shrink(), nn.Linear(32, 32),
                              nn.ReLU(), nn.Linear(32, 4))  # fmt: skip
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        session = watch(model, optimizer=optimizer, on_hit="record", sync=mode)
        torch.manual_seed(1)
        for _ in range(6):
            loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [(h.tensor, h.step, h.message) for h in hits_of(session, "VanishingGradient")]

    default = run("deferred")
    assert {"0.weight.grad", "3.weight.grad"} <= {t for t, _, _ in default}  # 3's input shrank
    assert run(DEFERRED_ON_DEVICE if sync == "deferred-on-device" else sync) == default


def test_the_rule_written_in_the_rule_interfaces_docstring_works_as_shown():
    """The example a person copies to write a rule called check_number, which tensordbg.rules
    did not export: the rule was disabled at attach with a NameError."""
    import textwrap

    import tensordbg
    import tensordbg.rules.base as base

    doc = base.__doc__
    code = textwrap.dedent(doc.split("Writing a rule takes a subclass::")[1].split("and, for")[0])
    space: dict = {}
    exec(compile(code, "rules/base.py docstring", "exec"), space)  # the docstring, as copied
    LargeActivation = space["LargeActivation"]
    with pytest.raises(ValueError, match="LargeActivation: limit must be"):
        LargeActivation(limit=-1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    session = tensordbg.attach(model, rules=[LargeActivation(limit=0.5)], on_hit="record",
                               server=False, summary_at_exit=False)  # fmt: skip
    try:
        model(torch.randn(4, 4) * 100)
        assert {h.rule for h in session.hits} == {"LargeActivation"}
    finally:
        session.detach()
