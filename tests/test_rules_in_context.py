"""Gradient rules judge a tensor in its context: its nonzero rows, the model's other gradients,
the other parameters of its module. Each test is a short sequence of steps, as the engine hands
them to a rule, with the verdict a person expects."""

from __future__ import annotations

import math

import numpy as np

from tensordbg.rules import ExplodingGradient, VanishingGradient, WeightNotChanging
from tensordbg.rules.base import Finding, Rule, judge_array
from tensordbg.statistics import L2, stats_from_numpy

rng = np.random.default_rng(0)


def grad(
    rule: Rule, array, state: dict, param: str, step: int = 0, module_type: str = "Linear"
) -> Finding | None:
    """Judge the gradient of parameter ``param`` (``"encoder.weight"``) at ``step``."""
    module = param.rpartition(".")[0]
    return judge_array(rule, np.asarray(array, dtype=np.float64), state, name=f"{param}.grad",
                       module=module, module_type=module_type, kind="grad", phase="backward",
                       step=step, trainable=True)  # fmt: skip


def model_of(rule: Rule, state: dict, size: float, step: int = 0, count: int = 10) -> None:
    """The gradients of ``count`` other layers, each of root-mean-square ``size``."""
    for i in range(count):
        assert grad(rule, np.full(64, size), state, f"layers.{i}.weight", step) is None


# --- sparse gradients ------------------------------------------------------------------------


def table(rows_used: int, value: float) -> np.ndarray:
    """The gradient of a 20,000-word embedding table of width 8 in a step that used a few rows."""
    g = np.zeros((20_000, 8))
    g[rng.choice(20_000, rows_used, replace=False)] = value * rng.choice([-1, 1], (rows_used, 8))
    return g


def test_an_embedding_is_judged_over_the_rows_that_got_a_gradient():
    rule, state = VanishingGradient(persist=1), {}  # one step judged (persistence: test_rules)
    healthy = table(rows_used=50, value=1e-5)  # mean |grad| over the whole table: 2.5e-8
    assert np.abs(healthy).mean() < rule.threshold
    assert grad(rule, healthy, state, "encoder.weight") is None
    model_of(rule, state, size=1e-5, step=1)  # the rest of the model learns on
    found = grad(rule, table(rows_used=50, value=1e-12), state, "encoder.weight", step=1)
    assert found is not None and math.isclose(found.value, 1e-12)
    assert "encoder.weight.grad has mean |grad| 1e-12 over its 400 nonzero values" in found.message


def test_a_table_without_any_gradient_receives_nothing():
    found = grad(VanishingGradient(), np.zeros((20_000, 8)), {}, "encoder.weight", step=1)
    assert found is not None and found.value == 0.0
    assert "receives no gradient at all" in found.message


def test_a_zero_norm_is_enough_to_tell_a_gradient_receives_nothing():
    """Without the tensor (batched checks on a GPU, past the retention budget) no statistic
    can be added: a norm of zero already says every element is zero."""
    t = stats_from_numpy(np.zeros(64), (L2,), name="fc.weight.grad", module="fc", kind="grad",
                         trainable=True, step=1)  # fmt: skip
    found = VanishingGradient().check(t, {})
    assert isinstance(found, Finding) and found.value == 0.0


# --- against the model's other gradients -------------------------------------------------------


def test_a_gradient_small_like_the_rest_of_its_model_is_not_vanishing():
    rule, state = VanishingGradient(persist=1), {}
    model_of(rule, state, size=1e-6)  # a loss that is small everywhere
    assert grad(rule, np.full(64, 1e-8), state, "attn.q.weight") is None  # 1e-2 of the model's
    found = grad(rule, np.full(64, 1e-12), state, "attn.k.weight")  # 1e-6 of it
    assert found is not None
    said = "1e-06x the model's typical gradient (the median root-mean-square of its others, "
    assert f"{said}1e-06; threshold 1e-05x)" in found.message


def test_relative_inf_judges_on_the_threshold_alone_as_sagemaker_does():
    rule, state = VanishingGradient(relative=math.inf, persist=1), {}
    model_of(rule, state, size=1e-6)
    assert grad(rule, np.full(64, 1e-8), state, "attn.q.weight") is not None


def test_the_first_gradient_of_a_training_is_judged_on_the_threshold_alone():
    found = grad(VanishingGradient(persist=1), np.full(64, 1e-8), {}, "fc.weight")
    assert found is not None and "typical" not in found.message


# --- a bias that its module cancels ------------------------------------------------------------

KEY = "encoder.layer.0.attention.self.key"


def test_a_bias_whose_weight_learns_is_cancelled_downstream_not_vanishing():
    rule, state = VanishingGradient(), {}
    for step in range(3):
        model_of(rule, state, size=1e-3, step=step)
        assert grad(rule, rng.standard_normal(64) * 1e-3, state, f"{KEY}.weight", step) is None
        assert grad(rule, rng.standard_normal(8) * 1e-13, state, f"{KEY}.bias", step) is None
        assert grad(rule, np.zeros(8), state, f"{KEY}.bias", step) is None


def test_a_bias_whose_weight_gets_nothing_either_is_reported_with_it():
    rule, state = VanishingGradient(), {}
    model_of(rule, state, size=1e-3, step=1)
    assert grad(rule, np.zeros(64), state, "fc.weight", step=1) is not None
    assert grad(rule, np.zeros(8), state, "fc.bias", step=1) is not None


def test_a_bias_judged_before_its_weight_waits_for_it_unless_it_is_exactly_zero():
    rule, state = VanishingGradient(persist=1), {}
    model_of(rule, state, size=1e-3, step=1)
    # Step 1: a tiny bias comes first (a Linear's bias gradient does); its weight gets nothing.
    assert grad(rule, np.full(8, 1e-13), state, "fc.bias", step=1) is None
    assert grad(rule, np.zeros(64), state, "fc.weight", step=1) is not None
    # Step 2: with its weight known to get nothing, the bias is reported.
    model_of(rule, state, size=1e-3, step=2)
    assert grad(rule, np.full(8, 1e-13), state, "fc.bias", step=2) is not None
    # An exactly zero bias does not wait: nothing reaches it.
    assert grad(rule, np.zeros(8), state, "head.bias", step=2) is not None


def test_advice_on_attention_key_biases_is_given_for_attention_modules_only():
    attention = grad(VanishingGradient(), np.zeros(8), {}, f"{KEY}.bias", step=1)
    assert attention is not None and "attention key bias" in attention.advised
    assert f"exclude='{KEY}.bias.grad'" in attention.advised
    conv = grad(VanishingGradient(), np.zeros(8), {}, "layer1.0.conv1.bias", step=1,
                module_type="Conv2d")  # fmt: skip
    assert conv is not None
    assert "key" not in conv.advised and "attention" not in conv.advised


# --- growth against the model ----------------------------------------------------------------


def test_a_gradient_catching_up_with_its_model_is_not_exploding():
    """Attention's query projection starts with a tiny gradient that grows a thousandfold once
    the model learns where to look: as long as it stays below the model's typical gradient,
    that is no explosion. Judged alone, the same sequence would be one."""
    rule, state = ExplodingGradient(), {}
    alone, alone_state = ExplodingGradient(), {}
    found_alone = []
    for step in range(30):
        model_of(rule, state, size=1e-2, step=step)
        gradient = np.full(64, 1e-6 * 1.3**step)  # up to 2e-3, below the model's 1e-2
        assert grad(rule, gradient, state, "attn.q.weight", step) is None
        found_alone.append(grad(alone, gradient, alone_state, "attn.q.weight", step))
    assert any(f is not None for f in found_alone)


def test_rounding_noise_that_jumps_is_not_exploding():
    rule, state = ExplodingGradient(), {}
    for step in range(30):
        model_of(rule, state, size=1e-2, step=step)
        noise = rng.standard_normal(8) * 1e-13 * (30.0 if step % 7 == 6 else 1.0)
        assert grad(rule, noise, state, f"{KEY}.bias", step) is None


# --- not changing, with nothing to learn from -------------------------------------------------


def steps_unchanged(rule: Rule, gradient: np.ndarray, steps: int = 5) -> list[Finding | None]:
    """Steps in which ``fc.bias`` gets ``gradient`` and the optimizer leaves it where it is."""
    state: dict = {}
    w = rng.standard_normal(8)
    found = []
    for step in range(steps):
        model_of(rule, state, size=1e-3, step=step)
        grad(rule, gradient, state, "fc.bias", step)
        found.append(judge_array(rule, w.copy(), state, prev=w, name="fc.bias.update",
                                 module="fc", kind="update", phase="optimizer", step=step,
                                 trainable=True))  # fmt: skip
    return found


def test_a_parameter_with_a_structurally_zero_gradient_is_not_reported_as_not_changing():
    assert steps_unchanged(WeightNotChanging(), np.full(8, 1e-13)) == [None] * 5
    assert steps_unchanged(WeightNotChanging(), np.zeros(8)) == [None] * 5


def test_a_parameter_with_a_healthy_gradient_that_does_not_move_is_reported():
    found = steps_unchanged(WeightNotChanging(), np.full(8, 1e-3))
    assert [f is not None for f in found] == [False, False, True, False, False]
    assert "though its gradient is not negligible" in found[2].message
