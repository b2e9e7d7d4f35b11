"""The built-in watchpoint rules, each shown finding a planted fault and staying quiet on a healthy
tensor. Rules judge statistics, so every test builds them from numpy arrays the way the engine
does: ask the rule which statistics it needs, compute those, then call ``check``."""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import tensordbg.rules.catalog as rules_catalog
import tensordbg.statistics.registry as stats_module
from tensordbg.rules import (
    BUILTIN,
    DEFAULT,
    AllZero,
    DeadActivation,
    ExplodingGradient,
    Finding,
    LossNotDecreasing,
    NaN,
    Overflow,
    PoorInitialization,
    RankDivergence,
    Rule,
    SaturatedActivation,
    TensorRange,
    VanishingGradient,
    WeightNotChanging,
    WeightUpdateRatio,
    available_rules,
    default_rules,
)
from tensordbg.rules.base import SELECTION_ARGS, judge_array
from tensordbg.rules.catalog import builtin_rules, with_given
from tensordbg.statistics import (
    ABS_MEAN,
    FINITE,
    FLOAT_MAX,
    L2,
    MAX,
    MIN,
    NAN,
    NEGINF,
    POSINF,
    STD,
    TensorStats,
    dead_unit_frac,
    in_range_frac,
    stats_from_numpy,
)

rng = np.random.default_rng(0)


def tensor(rule: Rule, array: Any, **where: Any) -> TensorStats:
    """The TensorStats the engine hands ``rule`` for ``array``: only the statistics it asks for."""
    probe = stats_from_numpy(np.asarray(array), (), **where)
    assert rule.applies(probe), f"{rule} does not apply to {where}"
    return stats_from_numpy(np.asarray(array), rule.stats_for(probe), **where)


def judge(rule: Rule, array: Any, state: dict | None = None, **where: Any) -> Finding | None:
    return judge_array(rule, array, state, **where)


def grad(norm: float) -> np.ndarray:
    """A gradient whose L2 norm is ``norm``."""
    return np.full(4, norm / 2)


GRAD = {"name": "layers.1.fc.weight.grad", "module": "layers.1.fc", "kind": "grad"}
GRAD_OF_UPDATE = {"name": "fc.weight.grad", "module": "fc", "kind": "grad", "phase": "backward"}


# --- NaN and Inf ---------------------------------------------------------------------------------


def test_nan_is_found_with_its_count():
    x = rng.standard_normal((8, 16)).astype(np.float32)
    x[1, 2] = x[3, 4] = x[5, 6] = np.nan
    found = judge(NaN(), x, name="net.2.output", module="net.2", kind="output")
    assert found is not None
    assert (found.value, found.threshold) == (3.0, None)
    assert "net.2.output holds 3 NaN among 128 values" in found.message
    assert NaN.propagates


def test_the_nan_message_names_the_infinities_beside_the_nans():
    """Ten NaN among two million -Inf: the message says both (found trying the UI as a new
    user: the hit said "holds 10 NaN among 2097152 values" and nothing of the rest)."""
    x = np.full((4, 8), -np.inf, dtype=np.float32)
    x[0, :3] = np.nan
    x[1, 0] = np.inf
    found = judge(NaN(), x, name="bad.output", kind="output")
    assert "bad.output holds 3 NaN and 1 +Inf and 28 -Inf among 32 values." in found.message
    x[np.isinf(x)] = 0.0
    assert "holds 3 NaN among 32 values." in judge(NaN(), x, name="o", kind="output").message


def test_nan_counts_one_when_only_the_range_is_known():
    t = TensorStats("x", "", "output", "forward", 0, (4,), "float32", {MIN: math.nan, MAX: 1.0})
    assert NaN().check(t, {}).value == 1.0


def test_uncounted_nan_and_inf_are_said_to_be_uncounted_and_known_counts_are_used():
    def stats(values: dict) -> TensorStats:
        return TensorStats("x", "", "grad", "backward", 0, (4,), "float32", values)

    only_range = stats({MIN: -math.inf, MAX: math.nan})
    assert "holds NaN (not counted) among 4 values" in NaN().check(only_range, {}).message
    assert "holds infinite values (not counted) among 4" in Overflow().check(only_range, {}).message
    found = ExplodingGradient().check(stats({FINITE: 0.0, L2: math.inf}), {})
    assert (found.value, found.threshold) == (1.0, None)
    assert "holds NaN/Inf values (not counted) among 4" in found.message
    counted = stats({FINITE: 0.0, NAN: 1.0, POSINF: 2.0, NEGINF: 0.0})
    assert Overflow().check(counted, {}).value == 2.0
    assert "holds 2 infinite values among 4" in Overflow().check(counted, {}).message
    assert "holds 3 NaN/Inf values among 4" in ExplodingGradient().check(counted, {}).message


def test_nan_is_quiet_on_finite_values_and_infinities():
    assert judge(NaN(), rng.standard_normal(100), name="x", kind="output") is None
    assert judge(NaN(), np.array([1.0, np.inf]), name="x", kind="output") is None


def test_overflow_finds_infinities_with_their_count():
    x = np.array([1.0, np.inf, -np.inf, np.inf], dtype=np.float32)
    found = judge(Overflow(), x, name="net.0.output", kind="output")
    assert found.value == 3.0
    assert "net.0.output holds 3 infinite values (+Inf×2, -Inf×1)" in found.message
    assert Overflow.propagates


def test_overflow_warns_a_float16_tensor_before_it_overflows():
    x = np.array([1.0, -40000.0], dtype=np.float16)
    found = judge(Overflow(), x, name="attn.scores", kind="output")
    assert found.value == 40000.0
    assert found.threshold == 0.5 * FLOAT_MAX["float16"]
    assert "attn.scores reaches 4e+04" in found.message
    assert (
        judge(Overflow(), np.array([1.0, 30000.0], dtype=np.float16), name="a", kind="output")
        is None
    )


def test_overflow_judges_bfloat16_against_its_own_range():
    t = TensorStats("h", "", "output", "forward", 0, (2,), "bfloat16", {MIN: -1.0, MAX: 2e38})
    assert Overflow().check(t, {}).threshold == pytest.approx(0.5 * 3.39e38, rel=1e-3)


def test_overflow_leaves_large_float32_values_alone():
    x = np.array([1e30, -1e30], dtype=np.float32)
    assert judge(Overflow(), x, name="logits", kind="output") is None


# --- all zeros and bounds -------------------------------------------------------------------------


def test_all_zero_gradient_is_found():
    found = judge(AllZero(), np.zeros((4, 4)), **GRAD)
    assert (found.value, found.threshold) == (1.0, 1.0)
    assert found.message.startswith("layers.1.fc.weight.grad is 100.0% zeros")
    assert "no gradient reaches it" in found.message


def test_all_zero_is_quiet_on_a_sparse_tensor_and_ignores_inputs():
    x = np.array([0.0, 0.0, 0.0, 1.0])
    assert judge(AllZero(), x, **GRAD) is None
    assert not AllZero().applies(stats_from_numpy(x, (), name="x", kind="input"))


def test_tensor_range_lists_every_bound_that_fired():
    rule = TensorRange(max_gt=10.0, mean_gt=1.0, min_lt=-100.0)
    found = judge(rule, np.array([0.0, 5.0, 50.0]), name="enc.output", kind="output")
    assert (found.value, found.threshold) == (50.0, 10.0)
    assert (
        "enc.output is outside the bounds set for it: max 50 > 10, mean 18.3 > 1." in found.message
    )


def test_tensor_range_asks_only_for_the_statistics_its_bounds_need():
    t = stats_from_numpy(np.ones(3), (), name="x", kind="output")
    assert TensorRange(max_gt=1.0).stats_for(t) == (MAX,)
    rule = TensorRange(abs_mean_lt=1e-9, abs_mean_gt=1e3, range_lo=0.0, range_percentage_gt=50.0)
    assert rule.stats_for(t) == (ABS_MEAN, in_range_frac(0.0, math.inf))


def test_tensor_range_percentage_within_a_range():
    # MindInsight's dead-ReLU preset: over 99.9 % of the outputs within [-1, 0].
    rule = TensorRange(range_lo=-1.0, range_hi=0.0, range_percentage_gt=99.9)
    found = judge(rule, np.zeros(1000), name="relu.output", kind="output")
    assert (found.value, found.threshold) == (100.0, 99.9)
    assert "100% of values within [-1, 0] > 99.9%" in found.message
    assert judge(rule, rng.standard_normal(1000), name="relu.output", kind="output") is None


def test_tensor_range_without_a_bound_is_refused():
    with pytest.raises(ValueError, match="needs at least one bound"):
        TensorRange()
    with pytest.raises(ValueError, match="need range_percentage_lt or range_percentage_gt"):
        TensorRange(range_lo=0.0, range_hi=1.0)
    rule = TensorRange(max_gt=1.0)
    with pytest.raises(ValueError, match="needs at least one bound"):
        rule.set_params(max_gt=None)
    assert rule.max_gt == 1.0


# --- gradients ------------------------------------------------------------------------------------


def test_exploding_gradient_fires_long_before_overflow():
    rule, state = ExplodingGradient(), {}
    for step in range(60):
        norm = 1.5**step
        found = judge(rule, grad(norm), state, step=step, **GRAD)
        if found is not None:
            break
    assert found is not None
    assert norm < 1e4
    assert found.value > 20.0 and found.threshold == 20.0
    assert "layers.1.fc.weight.grad has norm" in found.message
    assert "gradients are exploding" in found.message


def test_exploding_gradient_is_quiet_on_a_healthy_noisy_sequence():
    rule, state = ExplodingGradient(), {}
    norms = 3.0 * np.exp(-np.arange(300) / 150) * rng.lognormal(0.0, 0.5, 300)
    assert norms.max() / norms.min() > 20  # noisy and drifting, not flat
    assert all(judge(rule, grad(n), state, step=i, **GRAD) is None for i, n in enumerate(norms))


def test_a_one_step_spike_is_not_an_explosion_but_two_steps_or_a_huge_jump_are():
    def first_hit(norms: list[float], rule: ExplodingGradient) -> int | None:
        state: dict = {}
        for step, n in enumerate(norms):
            if judge(rule, grad(n), state, step=step, **GRAD) is not None:
                return step
        return None

    steady = [1.0] * 20
    assert first_hit([*steady, 30.0, 1.0, 1.0, 1.0], ExplodingGradient()) is None  # a hard batch
    assert first_hit([*steady, 30.0, 35.0], ExplodingGradient()) == 21  # still up a step later
    assert first_hit([*steady, 30.0, 28.0], ExplodingGradient()) == 21  # not lower than before
    assert first_hit([*steady, 30.0], ExplodingGradient(persist=1)) == 20
    # However far above: near the end of a run whose loss fell to 1e-3, one example it gets
    # wrong sends every gradient x300-x700 for a step (found trying it as a new user).
    assert first_hit([*steady, 500.0, 1.0, 1.0], ExplodingGradient()) is None
    assert first_hit([*steady, 500.0, 600.0], ExplodingGradient()) == 21


def test_hard_batches_late_in_a_run_stay_below_the_norms_of_its_first_steps() -> None:
    """A ResNet trained 2,000 steps to a loss of 1e-4 (SGD with momentum): two hard batches in
    a row send the head's gradient from 3e-4 to 0.106 and 0.396, 230x its median and above
    all of the last 50 steps; back to 3e-4 the step after (21 hits). Its first steps, at a
    loss of 1, had norms near 1: an explosion passes them, a hard batch does not."""
    norms = [1.0, 0.9, 0.8, 0.6, 0.5] + list(np.geomspace(0.4, 3e-4, 120)) + [3e-4] * 60
    state: dict = {}
    rule = ExplodingGradient()
    assert all(judge(rule, grad(n), state, step=i, **GRAD) is None for i, n in enumerate(norms))
    at = len(norms)
    bump = [0.106, 0.396, 3.3e-4, 3e-4, 0.0935, 0.45]
    assert [judge(rule, grad(n), state, step=at + i, **GRAD) for i, n in enumerate(bump)] == [
        None
    ] * len(bump)
    # The same two steps past every norm it had: an explosion.
    found = [judge(rule, grad(n), state, step=at + 6 + i, **GRAD) for i, n in enumerate([3, 9])]
    assert found[0] is None and found[1] is not None
    assert "above the largest it had (1)" in found[1].message


def test_two_steps_up_that_stay_below_the_windows_largest_norm_are_no_explosion() -> None:
    """A noisy gradient (a LayerNorm weight's, 0.0007 to 0.09 within ten steps) two steps in a
    row above 20x its median, at 0.085 and 0.163, after a 0.0915 five steps earlier: a healthy
    transformer with a GRU at step 414 of 1,500 (a new user's run). The largest norm of the
    window before the streak is the bar too: a gradient that explodes passes everything it had.
    """
    window = [0.0042] * 40 + [0.0915, 0.0023, 0.0012, 0.006, 0.0042, 0.0013, 0.0015, 0.0052]
    state: dict = {}
    rule = ExplodingGradient()
    verdicts = [judge(rule, grad(n), state, step=i, **GRAD) for i, n in enumerate(window)]
    assert verdicts == [None] * len(window)
    at = len(window)
    assert judge(rule, grad(0.085), state, step=at, **GRAD) is None  # below the window's 0.0915
    assert judge(rule, grad(0.163), state, step=at + 1, **GRAD) is None  # the first step up
    assert judge(rule, grad(0.0024), state, step=at + 2, **GRAD) is None
    assert judge(rule, grad(0.2), state, step=at + 3, **GRAD) is None
    found = judge(rule, grad(0.25), state, step=at + 4, **GRAD)  # still up, and higher
    assert found is not None and "for 2 steps in a row" in found.message


def test_exploding_gradient_keeps_one_history_per_tensor():
    rule, state = ExplodingGradient(), {}
    small = {**GRAD, "name": "a.weight.grad"}
    large = {**GRAD, "name": "b.weight.grad"}
    for step in range(30):
        assert judge(rule, grad(1.0), state, step=step, **small) is None
        assert judge(rule, grad(100.0), state, step=step, **large) is None


def test_exploding_gradient_above_max_norm_or_non_finite():
    found = judge(ExplodingGradient(), grad(1e7), **GRAD)  # no warmup needed
    assert (found.value, found.threshold) == (pytest.approx(1e7), 1e6)
    found = judge(ExplodingGradient(), np.array([1.0, np.nan, np.inf]), **GRAD)
    assert found.value == 2.0
    assert "holds 2 NaN/Inf values" in found.message


def test_a_nan_gradient_is_not_called_an_overflow_an_infinite_one_is():
    """A NaN gradient comes from 0/0 or 0 × Inf in backward (the derivative of sqrt at zero),
    and a lower learning rate does not cure it; an infinite gradient overflowed."""
    nan = judge(ExplodingGradient(), np.array([1.0, np.nan, 2.0]), **GRAD)
    assert nan.message == "layers.1.fc.weight.grad holds 1 NaN among 3 values."
    assert "0/0" in nan.advice and "overflow" not in nan.advice
    assert "learning rate" not in nan.advice
    inf = judge(ExplodingGradient(), np.array([1.0, np.inf, -np.inf]), **GRAD)
    assert "holds 2 infinite values among 3" in inf.message
    assert inf.advice.startswith("The gradient overflowed: lower the learning rate")
    both = judge(ExplodingGradient(), np.array([1.0, np.nan, np.inf]), **GRAD)
    assert "0/0" in both.advice and "overflow" in both.advice


def test_exploding_gradient_ignores_growth_from_an_all_zero_history():
    rule, state = ExplodingGradient(), {}
    for step in range(12):
        judge(rule, grad(0.0), state, step=step, **GRAD)
    assert judge(rule, grad(1e-3), state, step=12, **GRAD) is None


def test_vanishing_gradient_of_a_trainable_parameter():
    rule, state = VanishingGradient(), {}
    assert judge(rule, np.full(10, 1e-9), state, trainable=True, step=0, **GRAD) is None
    found = judge(rule, np.full(10, 1e-9), state, trainable=True, step=1, **GRAD)  # 2 in a row
    assert (found.value, found.threshold) == (pytest.approx(1e-9), 1e-7)
    assert "layers.1.fc.weight.grad has mean |grad| 1e-09, below 1e-07" in found.message
    assert judge(VanishingGradient(persist=1), np.full(10, 1e-9), trainable=True, **GRAD)
    # An exactly zero gradient waits a step only on step 0 (a zero at initialisation).
    assert judge(VanishingGradient(), np.zeros(10), trainable=True, step=0, **GRAD) is None
    zero = judge(VanishingGradient(), np.zeros(10), trainable=True, step=1, **GRAD)
    assert zero.value == 0.0 and "receives no gradient at all" in zero.message
    assert "not connected to the loss" in zero.advised  # nothing says it ever had one


def test_a_small_gradient_for_one_step_in_a_healthy_training_is_no_vanishing_gradient():
    """An expert of a mixture that got 2 tokens, all classified right already: its gradient is
    small at its source that step alone (5 hits in 600 healthy steps, by a new user's trial)."""
    rule, state = VanishingGradient(), {}
    expert = {**GRAD, "name": "experts.4.weight.grad", "module": "experts.4", "trainable": True}
    for step in range(8):
        size = 5e-9 if step in (3, 6) else 1e-3  # 5e-6 of the typical gradient
        assert judge(rule, np.full(10, size), state, step=step, **expert) is None
        assert judge(rule, np.full(10, 1e-3), state, step=step, **GRAD) is None


def test_a_gradient_that_stops_after_steps_with_one_is_not_said_to_be_unconnected():
    """A learning rate far too large saturates an LSTM's units at step 2: its weights, whose
    gradients were healthy at steps 0 and 1, were said "not connected to the loss"."""
    rule, state = VanishingGradient(), {}
    head = {**GRAD, "name": "head.bias.grad", "module": "head"}  # the loss still teaches it

    def step_of(value: float, step: int) -> Finding | None:
        assert judge(rule, np.full(10, 0.01), state, trainable=True, step=step, **head) is None
        return judge(rule, np.full(10, value), state, trainable=True, step=step, **GRAD)

    for step in (0, 1):
        assert step_of(0.01, step) is None
    dead = step_of(0.0, 2)
    assert dead.value == 0.0 and "receives no gradient at all" in dead.message
    assert "though it had one before (root-mean-square 0.01)" in dead.message
    assert "died or saturated since" in dead.advised and "not connected" not in dead.advised
    still = step_of(0.0, 3)  # and a step later
    assert "though it had one before (root-mean-square 0.01)" in still.message


def test_without_a_loss_every_gradient_near_zero_at_once_is_a_finished_training():
    """No loss observed (a script's own attach()): a step whose every gradient is at most 1e-7
    of the largest any had is a loss with nothing left to teach. Judged one gradient at a time
    (eager), a weight that gets nothing while its bias, judged after it, still learns is
    reported: until the step has noted as many gradients as the one before, that one must be
    as small too. Judged together (the default), the whole step is known at once."""
    rule, state = VanishingGradient(), {}
    weight, bias = (
        {**GRAD, "name": f"head.{p}.grad", "module": "head", "trainable": True}
        for p in ("weight", "bias")
    )  # fmt: skip
    for step in (0, 1):
        assert judge(rule, np.full(10, 0.01), state, step=step, **weight) is None
        assert judge(rule, np.full(10, 0.01), state, step=step, **bias) is None
    dead = judge(rule, np.zeros(10), state, step=2, **weight)  # its inputs died
    assert dead is not None and "receives no gradient at all" in dead.message
    assert judge(rule, np.full(10, 0.01), state, step=2, **bias) is None
    # Then the loss reaches 0: every gradient is 0 or 1e-12. On the first such step, the
    # gradient judged first cannot tell yet (the step before still learned): it is reported.
    assert judge(rule, np.zeros(10), state, step=3, **bias) is not None
    assert judge(rule, np.full(10, 1e-12), state, step=3, **weight) is None
    for step in (4, 5):  # from the next step on, nothing
        assert judge(rule, np.zeros(10), state, step=step, **bias) is None
        assert judge(rule, np.full(10, 1e-12), state, step=step, **weight) is None


def test_a_gradient_that_vanishes_with_its_loss_at_zero_is_no_news_but_with_a_loss_it_is():
    """Overfitting one batch drives the loss to exactly 0 and every gradient with it: not a
    vanishing gradient (3,910 hits in a new user's run). The observed loss of the same step
    says so; one of 1e-7 of its largest or less too; a loss that still has something to teach
    leaves the verdict as it was."""
    from tensordbg.statistics import MEAN, TensorStats

    def observed(rule: VanishingGradient, state: dict, value: float, step: int) -> None:
        """A loss as observe() gives it to the rules: with its mean (measured for the curve)."""
        loss = TensorStats("loss", "", "observed", "forward", step, (), "float32", {MEAN: value})
        assert rule.check(loss, state) is None

    for value, quiet in ((0.0, True), (2e-8, True), (0.5, False)):
        rule, state = VanishingGradient(), {}
        observed(rule, state, 2.3, step=0)  # the first loss: its largest
        observed(rule, state, value, step=1)
        found = judge(rule, np.zeros(10), state, trainable=True, step=1, **GRAD)
        assert (found is None) is quiet, (value, found)
        # Observed after its backward, the step's loss comes after its gradients: the one of
        # the step before stands for it; two steps with none, and it is judged as before.
        later = judge(rule, np.zeros(10), state, trainable=True, step=2, **GRAD)
        assert (later is None) is quiet
        assert judge(rule, np.zeros(10), state, trainable=True, step=3, **GRAD) is not None


def test_an_auxiliary_loss_at_zero_beside_one_that_teaches_is_no_finished_training():
    """A hinge term observed as margin_loss is exactly 0 while the main loss is 0.7: a dead
    layer's 145 hits all went quiet, as if the training were done (a new user's trial)."""
    from tensordbg.statistics import MEAN, TensorStats

    rule, state = VanishingGradient(), {}
    for step, (main, margin) in enumerate(((2.3, 0.4), (0.7, 0.0))):
        for name, value in (("loss", main), ("margin_loss", margin)):
            loss = TensorStats(name, "", "observed", "forward", step, (), "float32", {MEAN: value})
            assert rule.check(loss, state) is None
    assert judge(rule, np.zeros(10), state, trainable=True, step=1, **GRAD) is not None


def test_a_bias_cancelled_by_construction_is_judged_with_its_modules_weight_of_the_same_pass():
    """The autograd engine makes a Linear's bias gradient before its weight's. A critic's last
    bias, cancelled exactly by mean D(fake) - mean D(real), judged first with no earlier step
    to remember the weight by (a dump of one step), sees the weight of its own pass learning:
    together (check_many), or when that weight's gradient is NaN (judged first, alone)."""
    rule = VanishingGradient()
    where = {"module": "critic.2", "trainable": True, "step": 7}
    bias = tensor(rule, np.zeros(1), name="critic.2.bias.grad", kind="grad", **where)
    weight = tensor(rule, np.full(8, 0.3), name="critic.2.weight.grad", kind="grad", **where)
    assert rule.check_many([bias, weight], {}) == [None, None]
    assert isinstance(rule.check_many([bias], {})[0], Finding)  # alone: no gradient at all
    state: dict = {}
    nan = tensor(rule, np.full(8, np.nan), name="critic.2.weight.grad", kind="grad", **where)
    assert rule.check(nan, state) is None and rule.check(bias, state) is None


@pytest.mark.parametrize(
    "make", [ExplodingGradient, WeightNotChanging], ids=["exploding", "weights"]
)
def test_a_pass_judged_together_gets_the_verdicts_and_memory_of_one_check_after_another(make):
    """The engine hands a clean pass's gradients to a rule together (check_many), which takes a
    short way for most of them: over 40 steps of 9 gradients, with a one-step spike, a norm that
    grows x1.6 a step, a gradient that falls below 1e-7, an exact zero, a NaN and an Inf, it
    reaches exactly what check reaches one gradient after another, and keeps the same memory."""
    rule = make(window=12, warmup=6) if make is ExplodingGradient else make()  # windows roll
    walk = np.random.default_rng(3)
    one, many = {}, {}
    fired = []
    for step in range(40):
        pass_ = []
        for i in range(9):
            norm = float(walk.uniform(0.5, 2.0)) * 10.0 ** (i - 4)
            if i == 0 and step == 20:
                norm *= 1e3  # a spike, gone the next step
            if i == 6 and step >= 25:
                norm *= 1.6 ** (step - 24)  # growing: fires once it persists
            if i == 2 and step >= 30:
                norm = 1e-12  # falls below VanishingGradient's threshold
            values = grad(norm)
            if i == 3 and step % 7 == 6:
                values = np.zeros(4)
            if i == 4 and step == 33:
                values = np.array([1.0, np.nan, 0.0, 2.0])
            if i == 5 and step == 35:
                values = np.array([1.0, np.inf, 0.0, 2.0])
            where = {"module": f"layers.{i}", "trainable": True, "step": step, "kind": "grad"}
            pass_.append(tensor(rule, values, name=f"layers.{i}.weight.grad", **where))
        alone = [rule.check(t, one) for t in pass_]
        together = rule.check_many(pass_, many)
        assert [str(f) for f in together] == [str(f) for f in alone], f"step {step}"
        fired += [t.name for t, f in zip(pass_, alone, strict=True) if f is not None]
    assert many == one
    if make is ExplodingGradient:  # the NaN, the Inf and the growth; not the spike
        assert {f.split(".")[1] for f in fired} == {"4", "5", "6"}


def test_vanishing_gradient_is_quiet_on_healthy_or_frozen_parameters():
    assert judge(VanishingGradient(), np.full(10, 1e-3), trainable=True, **GRAD) is None
    assert judge(VanishingGradient(), np.zeros(10), trainable=False, **GRAD) is None


# --- weights --------------------------------------------------------------------------------------

# Named as the engine names an update record: the parameter's name and ".update".
UPDATE = {"name": "fc.weight.update", "module": "fc", "kind": "update", "phase": "optimizer"}


def updates(rule: Rule, moves: list[bool | None], trainable: bool = True,
            gradients: list[bool] | None = None) -> list[Finding | None]:  # fmt: skip
    """Run ``rule`` over optimizer steps that move the weight (True), leave it (False), or are
    not measured (None); each after a healthy gradient, unless ``gradients`` says the step
    gave it none (False)."""
    state, found, w = {}, [], np.ones(8)
    for step, moved in enumerate(moves):
        if gradients is None or gradients[step]:
            g = tensor(rule, np.full(8, 0.1), step=step, trainable=trainable, **GRAD_OF_UPDATE)
            assert rule.check(g, state) is None
        new = w + 0.1 if moved else w.copy()
        t = tensor(rule, new, prev=w, step=step, trainable=trainable, **UPDATE)
        if moved is None:
            t.values.clear()
        found.append(rule.check(t, state))
        w = new
    return found


def test_weight_not_changing_fires_once_per_streak_and_rearms():
    found = updates(WeightNotChanging(), [False] * 5 + [True] + [False] * 3)
    fired = [i for i, f in enumerate(found) if f is not None]
    assert fired == [2, 8]
    assert (found[2].value, found[2].threshold) == (3.0, 3.0)
    assert "fc.weight has not changed for 3 optimizer steps" in found[2].message


def test_weight_not_changing_under_an_interval_says_which_steps_it_measured():
    """Checked every 5th step, three unchanged updates span 11 steps: not "has not changed for 3
    optimizer steps", of which 8 were not measured."""
    rule, state, w = WeightNotChanging(), {}, np.ones(8)
    found = []
    for step in (5, 10, 15):
        g = tensor(rule, np.full(8, 0.1), step=step, **GRAD_OF_UPDATE)
        assert rule.check(g, state) is None
        found.append(
            rule.check(tensor(rule, w.copy(), prev=w, step=step, trainable=True, **UPDATE), state)
        )
    assert found[:2] == [None, None]
    said = "fc.weight has not changed in the 3 optimizer steps measured from step 5 to 15"
    assert f"{said} (the steps between were not)" in found[2].message


def test_weight_not_changing_skips_unmeasured_steps_and_frozen_parameters():
    found = updates(WeightNotChanging(), [False, False, None, False])
    assert [f is not None for f in found] == [False, False, False, True]
    assert updates(WeightNotChanging(), [False] * 5, trainable=False) == [None] * 5


def test_a_step_that_gave_the_parameter_no_gradient_neither_extends_nor_breaks_a_streak():
    """A branch used one step in two, its gradient zeroed with set_to_none=False: plain SGD
    leaves it where it is on the steps that did not use it. Its gradient from the step before
    said "not negligible", so 3 such steps were "not changing though its gradient is not
    negligible" (found by a new user's trial, in both modes)."""
    rule = WeightNotChanging()
    assert updates(rule, [False, True] * 4, gradients=[False, True] * 4) == [None] * 8
    assert updates(rule, [False] * 6, gradients=[False] * 6) == [None] * 6  # never reached
    found = updates(rule, [False] * 4, gradients=[True, False, True, True])
    assert [f is not None for f in found] == [False, False, False, True]


def test_weight_update_ratio_too_large_and_too_small():
    w = rng.standard_normal(100) * 0.01
    large = judge(WeightUpdateRatio(), w + 1.0, prev=w, trainable=True, **UPDATE)
    assert large.threshold == 10.0 and large.value > 10.0
    assert "fc.weight moved by" in large.message and "lower the learning rate" in large.message
    small = judge(WeightUpdateRatio(), w + 1e-12, prev=w, trainable=True, **UPDATE)
    assert small.threshold == 1e-8 and small.value < 1e-8
    assert "barely learns" in small.message
    healthy = w + 1e-3 * np.abs(w).mean() * rng.standard_normal(100)
    assert judge(WeightUpdateRatio(), healthy, prev=w, trainable=True, **UPDATE) is None


def test_weight_update_ratio_leaves_the_first_update_of_an_all_zero_parameter_unjudged():
    """SageMaker's ratio divides by epsilon for a parameter of zeros: every bias initialised to
    zero "moved by 2e+05x its own mean magnitude" at step 0 (found on a healthy GPT)."""
    zeros = np.zeros(100)
    first = zeros + 1e-4 * rng.standard_normal(100)
    assert judge(WeightUpdateRatio(), first, prev=zeros, trainable=True, **UPDATE) is None
    huge = first + 1.0  # from there on it has a size to be measured against
    assert judge(WeightUpdateRatio(), huge, prev=first, trainable=True, **UPDATE) is not None


def init_stats(model: Any, step: int = 0) -> list[TensorStats]:
    """Step-0 parameter statistics of a torch model, as PoorInitialization receives them."""
    rule, out = PoorInitialization(), []
    for path, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            out.append(
                stats_from_numpy(
                    p.detach().numpy(),
                    rule.needs,
                    name=f"{path}.{pname}",
                    module=path,
                    kind="param",
                    step=step,
                    module_type=type(module).__name__,
                    trainable=True,
                )
            )
    return out


def mlp() -> Any:
    nn = pytest.importorskip("torch.nn")
    return nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def cnn() -> Any:
    nn = pytest.importorskip("torch.nn")
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )


def test_poor_initialization_is_quiet_on_pytorch_default_inits():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    for model in (mlp(), cnn()):
        tensors = init_stats(model)
        assert PoorInitialization().check_phase(tensors, {}) == []
    # Plain variances of the default CNN spread 150x: only the fan-in scaling keeps it quiet.
    variances = [t.get(STD) ** 2 for t in init_stats(cnn()) if len(t.shape) > 1]
    assert max(variances) / min(variances) > 10


def test_poor_initialization_finds_an_all_zero_layer():
    torch = pytest.importorskip("torch")
    model = mlp()
    with torch.no_grad():
        model[2].weight.zero_()
    found = PoorInitialization().check_phase(init_stats(model), {})
    assert [(t.name, f.value) for t, f in found] == [("2.weight", 0.0)]
    assert "2.weight is all zeros at initialisation" in found[0][1].message


def test_poor_initialization_names_a_layer_scaled_x100():
    torch = pytest.importorskip("torch")
    model = cnn()
    with torch.no_grad():
        model[2].weight.mul_(100)
    found = PoorInitialization().check_phase(init_stats(model), {})
    assert len(found) == 1
    t, finding = found[0]
    assert t.name == "2.weight"
    assert finding.threshold == 10.0 and finding.value == pytest.approx(1e4, rel=0.2)
    assert "activations and gradients grow" in finding.message
    assert PoorInitialization().check_phase(init_stats(model, step=1), {}) == []


# --- activations ----------------------------------------------------------------------------------


def test_dead_relu_layer_is_found():
    x = np.maximum(rng.standard_normal((64, 32)), 0)
    x[:, :24] = 0.0  # 24 of 32 units never fire
    found = judge(
        DeadActivation(),
        x,
        name="mlp.act.output",
        module="mlp.act",
        kind="output",
        module_type="ReLU",
    )
    assert (found.value, found.threshold) == (0.75, 0.5)
    assert "mlp.act.output (ReLU) has 75% dead units" in found.message
    assert found.advice.startswith("Dead units pass no gradient")  # apart: given once


def test_dead_units_of_a_conv_map_are_its_channels():
    x = np.maximum(rng.standard_normal((8, 16, 4, 4)), 0)
    x[:, :12] = 0.0
    rule = DeadActivation()
    where = {"name": "conv.relu.output", "kind": "output", "module_type": "ReLU"}
    assert rule.stats_for(stats_from_numpy(x, (), **where)) == (
        dead_unit_frac(0, math.inf, 1, 0.01),
    )
    assert judge(rule, x, **where).value == 0.75


def test_dead_activation_is_quiet_on_a_healthy_relu_and_judges_only_activations():
    x = np.maximum(rng.standard_normal((64, 32)), 0)
    assert judge(DeadActivation(), x, name="act.output", kind="output", module_type="ReLU") is None
    linear = stats_from_numpy(x, (), name="fc.output", kind="output", module_type="Linear")
    assert not DeadActivation().applies(linear)
    custom = stats_from_numpy(x, (), name="blk.act.output", kind="output", module_type="MyAct")
    assert DeadActivation(match="*.act.output").applies(custom)


def test_a_nan_or_infinite_activation_is_not_called_dead_nor_saturated():
    """A NaN is never positive, so a layer of NaN looked 100% dead: the NaN rule says what it
    holds, and the activation rules judge only finite tensors."""
    relu = {"name": "enc.1.output", "kind": "output", "module_type": "ReLU"}
    assert judge(DeadActivation(), np.full((16, 8), np.nan, np.float32), **relu) is None
    dead = np.zeros((16, 8), np.float32)
    dead[0, 0] = np.inf
    assert judge(DeadActivation(), dead, **relu) is None
    assert judge(DeadActivation(), np.zeros((16, 8), np.float32), **relu).value == 1.0
    tanh = {"name": "t.output", "kind": "output", "module_type": "Tanh"}
    assert judge(SaturatedActivation(), np.full((16, 8), np.nan), **tanh) is None


def test_saturated_tanh_layer_is_found():
    pre = rng.standard_normal((64, 10))
    pre[:, :8] = rng.choice([-1, 1], (64, 8)) * rng.uniform(10, 30, (64, 8))
    found = judge(
        SaturatedActivation(),
        np.tanh(pre),
        name="rnn.tanh.output",
        kind="output",
        module_type="Tanh",
    )
    assert (found.value, found.threshold) == (0.8, 0.5)
    assert "rnn.tanh.output (Tanh) has 80% saturated units" in found.message


def test_saturation_bounds_are_sagemakers_carried_through_the_function():
    where = {"name": "gate.output", "kind": "output"}
    assert (
        judge(SaturatedActivation(), np.tanh(np.full((8, 4), 9.4)), module_type="Tanh", **where)
        is None
    )
    assert (
        judge(
            SaturatedActivation(), np.tanh(np.full((8, 4), 9.6)), module_type="Tanh", **where
        ).value
        == 1.0
    )
    sigmoid = 1 / (1 + np.exp(-np.array([[-22.5], [-23.5]]) * np.ones((2, 4))))
    assert judge(SaturatedActivation(), sigmoid[:1], module_type="Sigmoid", **where) is None
    assert judge(SaturatedActivation(), sigmoid[1:], module_type="Sigmoid", **where).value == 1.0


def test_saturated_activation_is_quiet_on_a_healthy_tanh_and_refuses_unknown_types():
    x = np.tanh(rng.standard_normal((64, 10)))
    assert (
        judge(SaturatedActivation(), x, name="t.output", kind="output", module_type="Tanh") is None
    )
    with pytest.raises(ValueError, match="knows the saturation bounds of Tanh, Sigmoid only"):
        SaturatedActivation(module_types=("Hardtanh",))
    rule = SaturatedActivation()
    with pytest.raises(ValueError, match="knows the saturation bounds of Tanh, Sigmoid only"):
        rule.set_params(module_types=["Tanh", "Hardtanh"])
    rule.set_params(module_types=["Sigmoid"])
    assert rule.module_types == ("Sigmoid",)


# --- loss -----------------------------------------------------------------------------------------


def losses(values_per_step: list[list[float]], name: str = "loss") -> list[tuple[int, Finding]]:
    """Observe a loss (several observations per step allowed); return the (step, finding)s."""
    rule, state, found = LossNotDecreasing(), {}, []
    for step, values in enumerate(values_per_step):
        for v in values:
            f = judge(rule, np.float64(v), state, name=name, kind="observed", step=step)
            if f is not None:
                found.append((step, f))
    return found


def test_a_noisy_but_decreasing_loss_is_quiet():
    steps = np.arange(100)
    loss = (3.0 * np.exp(-steps / 100) + 0.1) * rng.normal(1.0, 0.05, 100)
    assert np.count_nonzero(np.diff(loss) > 0) > 20  # step to step, it often goes up
    assert losses([[v] for v in loss]) == []


def test_a_rising_loss_is_found():
    loss = [2.0] * 10 + [2.3] * 11
    (step, found), *_ = losses([[v] for v in loss])
    assert step == 20  # judged once step 19 is complete
    assert found.value == pytest.approx(15.0) and found.threshold == 5.0
    assert found.message.startswith(
        "loss went up 15% over the last 10 steps (mean 2.3 over steps 10-19"
    )


def test_a_flat_loss_is_found():
    (step, found), *_ = losses([[2.0]] * 21)
    assert (step, found.value, found.threshold) == (20, 0.0, 0.1)
    assert "loss did not decrease (it changed +0%)" in found.message
    (_, slow), *_ = losses([[2.0]] * 10 + [[1.999]] * 11)
    assert "loss decreased by only 0.05%" in slow.message


def test_loss_is_averaged_within_a_step_and_non_finite_values_skipped():
    # Two micro-batches per step: windows count steps, not observations.
    rising = [[1.0, 3.0]] * 10 + [[1.5, 3.5], [math.nan, 2.5, 2.5]] * 5 + [[2.5]]
    (step, found), *_ = losses(rising)
    assert step == 20
    assert found.value == pytest.approx(25.0)


def test_loss_rule_watches_losses_by_default():
    rule = LossNotDecreasing()
    assert rule.applies(stats_from_numpy(np.float64(1), (), name="val_loss", kind="observed"))
    assert not rule.applies(stats_from_numpy(np.float64(1), (), name="accuracy", kind="observed"))


# --- the rule interface ---------------------------------------------------------------------------


def test_default_rules():
    assert [type(r) for r in DEFAULT] == [
        NaN,
        Overflow,
        ExplodingGradient,
        VanishingGradient,
        WeightNotChanging,
    ]
    assert all(a is not b for a, b in zip(default_rules(), DEFAULT, strict=True))


def make(cls: type[Rule]) -> Rule:
    return cls(max_gt=1.0) if cls is TensorRange else cls()


@pytest.mark.parametrize("name", BUILTIN)
def test_every_rule_lists_its_thresholds_and_documents_its_defaults(name):
    cls = builtin_rules()[name]
    signature = inspect.signature(cls.__init__).parameters
    thresholds = [
        n for n, p in signature.items() if p.kind == p.KEYWORD_ONLY and n not in SELECTION_ARGS
    ]
    assert list(make(cls).params()) == thresholds
    doc = inspect.getdoc(cls)
    assert "Defaults" in doc and "Example" in doc
    # The UI's one-line description is the docstring's first paragraph, a whole sentence (the
    # first line alone cut WeightNotChanging's mid-sentence).
    described = make(cls).describe()
    assert described == " ".join(doc.split("\n\n")[0].split()) and described.endswith(".")


def test_a_nan_whose_values_were_not_kept_gives_advice_a_terminal_report_can_use():
    """``tensordbg check`` printed "Opening it says why it was not kept", UI words with nothing
    to open in a terminal (found trying the product as a new user)."""
    stats = TensorStats("fc.grad_output", "fc", "grad", "backward", 3, (4,), "float32",
                        {FINITE: 0.0})  # fmt: skip
    finding = NaN().check(stats, {})
    assert finding is not None and "not counted: its values were not kept" in finding.message
    assert "sync='eager' keeps and counts every tensor" in finding.message
    assert "Opening" not in finding.advice
    # The advice is the NaN's, as a counted one's: a check's report gives it once for both
    # ("about 2 of the 319 NaN findings: sync='eager' keeps ..." glued the hint onto it).
    counted = NaN().check(TensorStats("fc.grad_output", "fc", "grad", "backward", 3, (4,),
                                      "float32", {FINITE: 0.0, NAN: 1.0}), {})  # fmt: skip
    assert counted is not None and counted.advice == finding.advice


def test_thresholds_keep_their_type_and_unknown_names_are_refused():
    rule = ExplodingGradient()
    assert rule.params() == {"max_norm": 1e6, "growth": 20.0, "window": 50, "warmup": 10,
                             "persist": 2}  # fmt: skip
    rule.set_params(window="30", max_norm=5)
    assert rule.window == 30 and isinstance(rule.max_norm, float)
    with pytest.raises(ValueError, match="ExplodingGradient has no threshold 'limit'"):
        rule.set_params(limit=3)
    with pytest.raises(ValueError, match=r"ExplodingGradient\.growth takes a float"):
        rule.set_params(growth="fast")
    with pytest.raises(ValueError, match=r"ExplodingGradient\.window takes an int, not 'x'"):
        rule.set_params(window="x")
    with pytest.raises(ValueError, match=r"\.max_norm cannot be empty: it takes a float"):
        rule.set_params(max_norm=None, growth=30)  # an emptied field: the whole edit refused
    assert rule.growth == 20.0
    act = DeadActivation()
    act.set_params(module_types=["ReLU"])
    assert act.module_types == ("ReLU",)


# --- thresholds a rule cannot judge with ----------------------------------------------------------

# One value of each kind a rule refuses, and what it says. Floats where the rule's default is a
# float: the edit dialog sends -5 for a float threshold as -5.0, so both ways say the same.
REFUSED = [
    (ExplodingGradient, {"max_norm": -5.0}, "max_norm must be a positive number, not -5.0"),
    (ExplodingGradient, {"max_norm": math.inf}, "max_norm must be a finite positive number, "
                                                "not inf"),
    (ExplodingGradient, {"growth": 1.0}, "growth must be a number above 1, not 1.0"),
    (ExplodingGradient, {"window": 0}, "window must be a whole number of 1 or more, not 0"),
    (ExplodingGradient, {"window": 2.5}, "window must be a whole number of 1 or more, not 2.5"),
    (ExplodingGradient, {"persist": True}, "persist must be a whole number of 1 or more, not True"),
    (ExplodingGradient, {"warmup": 60}, "warmup must be at most window (50), not 60; the rule "
                                         "keeps the last window norms of a gradient"),
    (VanishingGradient, {"threshold": 0.0}, "threshold must be a positive number, not 0.0"),
    (VanishingGradient, {"relative": math.nan}, "relative must be a positive number, or inf, "
                                                "not nan"),
    (VanishingGradient, {"persist": 0}, "persist must be a whole number of 1 or more, not 0"),
    (WeightNotChanging, {"num_steps": -1}, "num_steps must be a whole number of 1 or more, not -1"),
    (WeightNotChanging, {"atol": -1e-8}, "atol must be a number of 0 or more, not -1e-08"),
    (WeightUpdateRatio, {"large_threshold": True}, "large_threshold must be a positive number, "
                                                   "not True"),
    (WeightUpdateRatio, {"small_threshold": 20.0}, "small_threshold must be below large_threshold "
                                                   "(10.0), not 20.0; otherwise every step fires"),
    (WeightUpdateRatio, {"epsilon": 0.0}, "epsilon must be a positive number, not 0.0"),
    (Overflow, {"near": 2.0}, "near must be a fraction above 0 and at most 1, not 2.0"),
    (AllZero, {"threshold": 0.0}, "threshold must be a fraction above 0 and at most 1, not 0.0"),
    (DeadActivation, {"layer_threshold": 50.0}, "layer_threshold must be a fraction of 0 or more "
                                                "and below 1, not 50.0"),
    (DeadActivation, {"inactivity_threshold": -0.1}, "inactivity_threshold must be a fraction "
                                                     "above 0 and at most 1, not -0.1"),
    (DeadActivation, {"module_types": (1, 2)}, "module_types must be names of module types, e.g. "
                                               "('ReLU', 'GELU'), not (1, 2)"),
    (SaturatedActivation, {"module_types": ()}, "module_types must be 'Tanh', 'Sigmoid' or both, "
                                                "not ()"),
    (SaturatedActivation, {"layer_threshold": 1.0}, "layer_threshold must be a fraction of 0 or "
                                                    "more and below 1, not 1.0"),
    (LossNotDecreasing, {"num_steps": 0}, "num_steps must be a whole number of 1 or more, not 0"),
    (LossNotDecreasing, {"diff_percent": -1.0}, "diff_percent must be a number of 0 or more, "
                                                "not -1.0"),
    (PoorInitialization, {"variance_ratio": 0.5}, "variance_ratio must be a number above 1, "
                                                  "not 0.5"),
    (PoorInitialization, {"max_gt": "1"}, "max_gt must be a number, or None, not '1'"),
    (PoorInitialization, {"max_gt": 0.1, "min_lt": 0.5}, "min_lt must be at most max_gt (0.1), "
                                                         "not 0.5; otherwise every weight fires"),
    (RankDivergence, {"every": 0}, "every must be a whole number of 1 or more, not 0"),
    (RankDivergence, {"rtol": -1e-5}, "rtol must be a number of 0 or more, not -1e-05"),
    (TensorRange, {"max_gt": math.nan}, "max_gt must be a number, or None, not nan"),
    (TensorRange, {"abs_mean_lt": 0.0}, "abs_mean_lt must be a positive number, or None, not 0.0"),
    (TensorRange, {"range_lo": 0.0, "range_percentage_lt": 150.0},
     "range_percentage_lt must be a percentage above 0 and at most 100, or None, not 150.0"),
    (TensorRange, {"mean_lt": 1.0, "mean_gt": 0.0}, "mean_lt must be at most mean_gt (0.0), not "
                                                    "1.0; otherwise every tensor fires"),
    (TensorRange, {"range_lo": 1.0, "range_hi": 0.0, "range_percentage_lt": 5.0},
     "range_lo must be at most range_hi (0.0), not 1.0; otherwise no value lies within the range"),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "values", "said"), REFUSED, ids=[
    f"{c.__name__}({', '.join(f'{k}={v!r}' for k, v in values.items())})"
    for c, values, _ in REFUSED])  # fmt: skip
def test_a_threshold_the_rule_cannot_judge_with_is_refused_when_made_and_when_edited(
    cls, values, said
):
    said = f"{cls.__name__}: {said}"
    with pytest.raises(ValueError) as made:
        cls(**values)
    assert str(made.value) == said
    rule = make(cls)
    before = rule.params()
    with pytest.raises(ValueError) as edited:
        rule.set_params(**values)  # what the UI's edit dialog does
    assert str(edited.value) == said
    assert rule.params() == before


@pytest.mark.parametrize("name", BUILTIN)
def test_every_rule_passes_its_own_checks_and_takes_its_thresholds_back(name):
    rule = make(builtin_rules()[name])
    rule.check_params()
    before = rule.params()
    rule.set_params(**before)  # the edit dialog sends every threshold, changed or not
    assert rule.params() == before


def test_the_edges_of_what_a_threshold_takes_are_taken():
    assert VanishingGradient(relative=math.inf).relative == math.inf  # threshold alone, documented
    assert DeadActivation(module_types="GELU").module_types == ("GELU",)  # not four letters
    assert WeightUpdateRatio(small_threshold=0.0).small_threshold == 0.0  # the small side off
    assert TensorRange(range_lo=0.5, range_hi=0.5, range_percentage_gt=0.0).range_lo == 0.5
    rule = PoorInitialization(max_gt=1.0)
    rule.set_params(max_gt=None)  # an optional bound cleared in the edit dialog
    assert rule.max_gt is None
    rule = ExplodingGradient()
    rule.set_params(window="30", warmup=30)
    assert (rule.window, rule.warmup) == (30, 30)


def test_a_threshold_refused_on_the_command_line_is_one_sentence_and_exit_status_2(cli):
    code, out, err = cli("run", "--rule", "ExplodingGradient(max_norm=-5)", "train.py")
    assert code == 2 and out == ""
    assert err == (
        "tensordbg: --rule 'ExplodingGradient(max_norm=-5)': ExplodingGradient: max_norm must "
        "be a positive number, not -5\n"
    )


@pytest.mark.parametrize("name", BUILTIN)
def test_missing_statistics_give_no_verdict(name):
    rule = make(builtin_rules()[name])
    kind = sorted(rule.kinds)[0]
    module_type = {"DeadActivation": "ReLU", "SaturatedActivation": "Tanh"}.get(name, "Linear")
    t = TensorStats(
        "net.loss.weight",
        "net",
        kind,
        "forward",
        0,
        (4, 4),
        "float32",
        {},
        module_type,
        trainable=True,
    )
    assert rule.applies(t)
    state: dict = {}
    assert rule.check_phase([t, t], state) == []


def test_judging_an_array_computes_its_summary_once(monkeypatch):
    summaries = []
    summarize = stats_module.summarize_numpy
    monkeypatch.setattr(
        stats_module, "summarize_numpy", lambda x: summaries.append(x) or summarize(x)
    )
    found = judge(NaN(), np.array([1.0, np.nan]), name="fc.output", kind="output")
    assert found.value == 1.0
    assert len(summaries) == 1


def test_rules_never_import_torch():
    code = "import sys, tensordbg.rules; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


class LargeActivation(Rule):
    """An activation whose magnitude passes ``limit``."""

    kinds = frozenset({"output"})
    needs = (MIN, MAX)

    def __init__(self, *, limit: float = 1e4, **selection: Any):
        super().__init__(**selection)
        self.limit = limit

    def check(self, t: TensorStats, state: dict) -> Finding | None:
        return (
            Finding(t.abs_max, self.limit, f"{t.name} is large") if t.abs_max > self.limit else None
        )


class FakeEntryPoint:
    def __init__(self, name: str, target: Any):
        self.name, self.target = name, target

    def load(self) -> Any:
        if isinstance(self.target, Exception):
            raise self.target
        return self.target


def test_third_party_rules_come_through_entry_points(monkeypatch):
    plugins = [
        FakeEntryPoint("LargeActivation", LargeActivation),
        FakeEntryPoint("Broken", ImportError("no module named 'missing'")),
        FakeEntryPoint("NotARule", object),
        FakeEntryPoint("NaN", LargeActivation),
    ]
    monkeypatch.setattr(
        rules_catalog, "entry_points", lambda group: plugins if group == "tensordbg.rules" else []
    )
    with pytest.warns(UserWarning) as warned:
        found = available_rules()
    assert found["LargeActivation"] is LargeActivation
    assert found["NaN"] is NaN  # a plugin never replaces a built-in
    assert "Broken" not in found and "NotARule" not in found
    assert list(found)[: len(BUILTIN)] == list(BUILTIN)
    messages = [str(w.message) for w in warned]
    assert any("'Broken' failed to load: no module named 'missing'" in m for m in messages)
    assert any("'NotARule' is not a tensordbg.rules.Rule subclass" in m for m in messages)
    assert judge(found["LargeActivation"](), np.array([2e4]), name="x", kind="output").value == 2e4


def test_a_value_past_its_bound_is_never_shown_equal_to_it():
    """A norm of 1,002,000 against max_norm 1e6 read "norm 1e+06, above 1e+06"; a max of 10.01
    against 10, "max 10 > 10" (found by a new user's trial)."""
    from tensordbg.rules.base import apart

    assert apart(1_002_000.0, 1e6) == ("1.002e+06", "1e+06")
    assert apart(10.01, 10.0) == ("10.01", "10")
    assert apart(3.5, 1.0) == ("3.5", "1")
    found = judge(ExplodingGradient(), np.full(4, 501_000.0), {}, **GRAD)
    assert "has norm 1.002e+06, above 1e+06" in found.message


@pytest.mark.parametrize(
    "make_it",
    [lambda: ExplodingGradient(maxnorm=5), lambda: NaN(mach="x"), lambda: TensorRange(maxgt=1)],
)
def test_a_mistyped_keyword_in_python_names_the_rule_and_what_it_takes(make_it):
    """Not "Rule.__init__() got an unexpected keyword argument": the rule the person made, and
    its keywords, as --rule says it."""
    with pytest.raises(TypeError) as caught:
        make_it()
    message = str(caught.value)
    assert "Rule.__init__" not in message and "; it takes " in message
    assert message.split(" has no ")[0] in {"ExplodingGradient", "NaN", "TensorRange"}
    assert message.endswith("match, exclude, kinds")


def test_a_rule_given_on_the_command_line_replaces_the_named_rule_of_its_class():
    bound = ExplodingGradient(max_norm=10)
    ranges = [TensorRange(match="a.*", max_gt=1), TensorRange(match="b.*", max_gt=1)]
    rules = with_given(default_rules(), [bound, *ranges])
    assert [type(r).__name__ for r in rules] == [type(r).__name__ for r in default_rules()] + [
        "TensorRange",
        "TensorRange",
    ]
    assert [r for r in rules if isinstance(r, ExplodingGradient)] == [bound]
