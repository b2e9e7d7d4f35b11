"""Rules on parameters and their optimizer updates: not changing, changing too much or too
little, and a poor initialisation."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from tensordbg.rules.base import Finding, Rule, check_count, check_number, refusal
from tensordbg.rules.loss import loss_spent, note_loss
from tensordbg.rules.scales import THRESHOLD, negligible, note_scale, note_scales
from tensordbg.statistics import (
    L2,
    LR_SHARE,
    MAX,
    MIN,
    PREV_ABS_MEAN,
    STD,
    UPDATE_ABS_MEAN,
    Stat,
    TensorStats,
    update_unchanged,
)


class WeightNotChanging(Rule):
    """A trainable parameter that the optimizer leaves unchanged for ``num_steps`` steps in a row
    although its gradient asks it to move.

    Defaults: the streak length ``num_steps`` = 3 is SageMaker's UnchangedTensor. "Unchanged"
    is by default exact: not one element moved (``rtol`` = ``atol`` = 0). MindInsight's "weight
    not changed" and SageMaker's UnchangedTensor call a parameter unchanged when every element
    is within ``atol`` (1e-8) + ``rtol`` (1e-5) x |previous value|, which fires on healthy
    runs: AdamW moves each element by about its learning rate, so a LayerNorm weight near 1 at
    a fine-tuning learning rate of 2e-6, or at the tail of a schedule that decays to 0 (the
    Hugging Face Trainer's linear default, from 5e-5 over 20 steps, at step 18), changes by
    less than 1e-5 of itself every step while learning. What the rule looks for leaves every
    bit as it was: a learning rate of zero, a parameter missing from the optimizer's groups,
    updates too small for the parameter's dtype to register (bfloat16 weights, whose
    resolution is 2^-8 of their size, trained at a small learning rate without float32
    master weights). ``WeightNotChanging(rtol=1e-5, atol=1e-8)`` is the earlier tools' test.
    The rule fires once per streak and re-arms when the parameter moves again; a step whose
    statistic was not computed neither extends nor breaks a streak, nor does a step that gave
    the parameter no gradient (a branch or an expert it did not use; its gradient zeroed with
    ``set_to_none=False`` or left over from an earlier step is not this step's).

    A step whose gradient was negligible breaks the streak instead: a parameter with nothing to
    learn from has no reason to move. Negligible is VanishingGradient's default verdict on the
    gradient's root-mean-square: below 1e-7 (SageMaker's bound) and below 1e-5 of the model's
    typical gradient. Some parameters get nothing by construction, such as the attention key
    bias, which softmax cancels and which plain SGD, or Adam with its ``eps``, leaves where it
    is; a gradient that vanishes for a reason is VanishingGradient's to report. What is left
    is a healthy gradient that does not reach the weight. An embedding whose rows got no
    gradient in a step is judged as a whole: its other rows moved, so it changed.

    So does a step whose every observed loss is 0 or at most 1e-7 of the largest it had (with
    no loss observed: whose every gradient is at most 1e-7 of the largest any had): the
    training is done, and Adam's steps on gradients of 1e-9 fall below a float32 step (an
    autoencoder at a loss of 3e-15, one batch overfit to 0: new users' runs).

    So does a step where the parameter's own gradient is at most 1e-6 of the largest it had
    (:data:`SETTLED`): plain SGD on a regression that converged to a loss of 3e-13 moves a bias
    by 0.1 x 3e-7, under half a float32 step of its value, while its gradient started near 8
    (a new user's run with no loss observed, where the step's largest gradient against the
    largest any had hovered around 1e-7, so the training-done test held some steps only). A
    weight that cannot learn (a learning rate of zero, a bfloat16 weight whose updates round
    away) keeps a gradient near what it had: it is still reported.

    A step whose learning rate a schedule has decayed below ``decayed`` (1 %) of the largest
    its parameter group had breaks the streak too: at the tail of a cosine or linear schedule
    to 0, AdamW's updates fall below half a float32 step of a weight near 1 and no element
    moves, by design (a transformer trained 1,500 steps with a cosine schedule from 3e-3, in its
    last 12 steps, found trying it as a new user). So does a rate a scheduler holds at zero
    before raising it (a warm-up from 0: its group's ``initial_lr`` is above 0; an LSTM's
    embedding and recurrent weights held 20 steps, a new user's healthy run that hit). A
    learning rate of zero from the start, with no scheduler, has no rate to decay from or rise
    to: it is still reported. ``decayed=0`` judges every step.

    ``num_steps`` is a whole number of 1 or more; ``rtol`` and ``atol`` are numbers of 0 or more
    (below 0 not even a parameter left as it was would count as unchanged); ``decayed`` is a
    number from 0 to 1.

    Example: ``WeightNotChanging(num_steps=10, exclude="*.bias")`` tolerates longer pauses.
    """

    # The gradient of a step comes before its update: the rule notes whether it was negligible.
    kinds = frozenset({"update", "grad", "observed"})

    def __init__(self, *, num_steps: int = 3, rtol: float = 0.0, atol: float = 0.0,
                 decayed: float = 0.01, **selection: Any):  # fmt: skip
        super().__init__(**selection)
        self.num_steps = num_steps
        self.rtol = rtol
        self.atol = atol
        self.decayed = decayed

    def check_params(self) -> None:
        check_count(self, "num_steps")
        check_number(self, "rtol", least=0)
        check_number(self, "atol", least=0)
        check_number(self, "decayed", least=0, most=1)

    def stats_for(self, t: TensorStats) -> tuple[Stat, ...]:
        if t.kind == "observed":
            return ()  # a loss's mean comes with it (observe() measures it), if at all
        if t.kind == "grad":
            return (L2,)
        return (update_unchanged(self.rtol, self.atol),)

    def check_many(
        self, tensors: Sequence[TensorStats], state: dict[str, Any]
    ) -> list[Finding | None]:
        """:meth:`check` of each in turn, a pass's gradients in one loop: a gradient whose
        root-mean-square reaches the threshold is not negligible whatever the others are; one
        below it is checked where it comes (the others' scales as :meth:`check` sees them)."""
        if any(t.kind != "grad" for t in tensors):
            return [self.check(t, state) for t in tensors]
        note_scales(tensors, state)  # the pass's largest first: loss_spent may read it
        if loss_spent(state, tensors[0].step):
            return [self.check(t, state) for t in tensors]
        start = 0
        for i, t in enumerate(tensors):
            l2 = t.values.get(L2)
            if l2 is None or not (math.isfinite(l2) and l2 / math.sqrt(t.numel) >= THRESHOLD):
                self._learning(tensors[start:i], state)
                self.check(t, state)
                start = i + 1
        self._learning(tensors[start:], state)
        return [None] * len(tensors)

    @staticmethod
    def _learning(tensors: Sequence[TensorStats], state: dict[str, Any]) -> None:
        """Note that each of these gradients' parameter is not idle: their root-mean-squares
        (noted) reach VanishingGradient's threshold, unless one has settled (:func:`_settled`)."""
        idle: dict[str, tuple[int, bool]] = state.setdefault("idle", {})
        for t in tensors:
            name = t.name.removesuffix(".grad")
            idle[name] = (t.step, _settled(name, t.values[L2] / math.sqrt(t.numel), state))

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        if t.kind == "observed":
            note_loss(t, state)
            return None
        # Per parameter: the step of its latest measured gradient, and whether that was
        # negligible (or its loss).
        idle: dict[str, tuple[int, bool]] = state.setdefault("idle", {})
        if t.kind == "grad":
            scale = note_scale(t, state)
            if scale is not None:
                name = t.name.removesuffix(".grad")
                idle[name] = (
                    t.step,
                    negligible(scale, state, t.name)
                    or loss_spent(state, t.step)
                    or _settled(name, scale, state),
                )
            return None
        unchanged = t.get(update_unchanged(self.rtol, self.atol))
        had = idle.get(t.name.removesuffix(".update"))
        if not t.trainable or unchanged is None or had is None or had[0] != t.step:
            # Not measured, or no gradient of this step was: a parameter this step did not
            # reach (a branch, an expert without tokens) has no reason to move.
            return None
        # Per tensor: [length of the current streak, whether it has been reported, its first
        # step].
        streak = state.setdefault(t.name, [0, False, t.step])
        share = t.get(LR_SHARE)  # the learning rate against its largest (a schedule's tail)
        if unchanged != 1.0 or had[1] or (share is not None and share < self.decayed):
            streak[:] = [0, False, t.step]
            return None
        if not streak[0]:
            streak[2:] = [t.step]
        streak[0] += 1
        if streak[1] or streak[0] < self.num_steps:
            return None
        streak[1] = True
        within = (
            f"every element within {self.atol:.3g} + {self.rtol:.3g} x |value|"
            if self.rtol or self.atol
            else "not one element moved"
        )
        # Checked every few steps (``interval``), a streak counts the steps measured.
        span = t.step - streak[2] + 1
        steps = (f"for {streak[0]} optimizer steps" if span == streak[0] else
                 f"in the {streak[0]} optimizer steps measured from step {streak[2]} to "
                 f"{t.step} (the steps between were not)")  # fmt: skip
        return Finding(
            float(streak[0]),
            float(self.num_steps),
            f"{_param(t)} has not changed {steps} ({within}, threshold "
            f"{self.num_steps} steps) though its gradient is not negligible; it is not learning: "
            "its learning rate may be zero or too small for its dtype to register, or it may be "
            "missing from the optimizer's parameter groups.",
        )


SETTLED = 1e-6
"""A parameter whose gradient's root-mean-square fell to this share of the largest it had has
learnt what it can: WeightNotChanging does not judge its update."""


def _settled(name: str, scale: float, state: dict[str, Any]) -> bool:
    """Whether the gradient of parameter ``name`` (root-mean-square ``scale``) is at most
    :data:`SETTLED` of the largest it had; notes it as the largest when it is."""
    peaks: dict[str, float] = state.setdefault("peaks", {})
    peak = peaks.get(name, 0.0)
    if scale > peak:
        peaks[name] = scale
        return False
    return scale <= SETTLED * peak


def note_update(t: TensorStats, state: dict[str, Any]) -> None:
    """Note an optimizer step's update record in ``state``: that updates are watched (the
    step of the first one), and the first step whose update moved its parameter (a statistic
    ``update_unchanged`` of 0, with whatever tolerance, or ``update_abs_mean`` above 0) or ran
    at a learning rate above 0 (``lr_share``)."""
    if "moved" in state:
        return
    state.setdefault("updates", t.step)
    for stat, value in t.values.items():
        if (stat.name == "update_unchanged" and value == 0.0) or (
            stat.name in ("update_abs_mean", "lr_share") and value > 0
        ):
            state["moved"] = t.step
            return


def update_moved(state: dict[str, Any], step: int) -> bool:
    """Whether an optimizer step before ``step`` moved a parameter (:func:`note_update`); with
    no update record seen before it (none watched), whether ``step`` follows step 0's update."""
    moved = state.get("moved")
    if moved is not None:
        return moved < step
    seen = state.get("updates")
    return (seen is None or seen >= step) and step > 0


class WeightUpdateRatio(Rule):
    """Optimizer steps that are too large or too small for the size of the parameter.

    Defaults: SageMaker's WeightUpdateRatio, ratio = mean |w - w_prev| / (mean |w_prev| +
    ``epsilon``) with ``large_threshold`` 10, ``small_threshold`` 1e-8 and ``epsilon`` 1e-9
    (MindInsight's "weight change too large/small" uses the same ratio). A healthy ratio is
    often around 1e-3.

    ``large_threshold`` is a positive number, ``small_threshold`` 0 or more (0 turns the small
    side off) and below ``large_threshold``, or every step would fire; ``epsilon`` is positive,
    so that an all-zero parameter divides by it rather than by zero. An update of a parameter
    that was all zeros (a bias before its first step) is not judged: it has no size to move
    against, and SageMaker's ratio fires on every bias initialised to zero at the first step.

    Example: ``WeightUpdateRatio(large_threshold=1.0)`` uses MindInsight's recommended bound.
    """

    kinds = frozenset({"update"})
    needs = (UPDATE_ABS_MEAN, PREV_ABS_MEAN)

    def __init__(
        self,
        *,
        large_threshold: float = 10.0,
        small_threshold: float = 1e-8,
        epsilon: float = 1e-9,
        **selection: Any,
    ):
        super().__init__(**selection)
        self.large_threshold = large_threshold
        self.small_threshold = small_threshold
        self.epsilon = epsilon

    def check_params(self) -> None:
        check_number(self, "large_threshold", above=0)
        check_number(self, "small_threshold", least=0)
        if self.small_threshold >= self.large_threshold:
            must = f"below large_threshold ({self.large_threshold!r})"
            raise refusal(self, "small_threshold", must, "otherwise every step fires")
        check_number(self, "epsilon", above=0)

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        update, before = t.get(UPDATE_ABS_MEAN), t.get(PREV_ABS_MEAN)
        if not t.trainable or update is None or before is None or before == 0:
            return None
        ratio = update / (before + self.epsilon)
        if ratio > self.large_threshold:
            return Finding(
                ratio,
                self.large_threshold,
                f"{_param(t)} moved by {ratio:.3g}x its own mean magnitude in one optimizer step "
                f"(mean |update| {update:.3g}, mean |value| {before:.3g}, threshold "
                f"{self.large_threshold:g}x); steps this large undo what the layer learned: "
                "lower the learning rate or add a warmup.",
            )
        if ratio < self.small_threshold:
            return Finding(
                ratio,
                self.small_threshold,
                f"{_param(t)} moved by only {ratio:.3g} of its own mean magnitude in one optimizer "
                f"step (mean |update| {update:.3g}, mean |value| {before:.3g}, threshold "
                f"{self.small_threshold:.3g}); it barely learns: its learning rate may be too "
                "low, or its gradient vanishes.",
            )
        return None


# Weight-bearing layers whose initialisation is comparable across a network.
WEIGHTED_LAYERS = (
    "Linear",
    "Bilinear",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
)


class PoorInitialization(Rule):
    """Weight matrices that start constant, out of scale with the other layers, or out of bounds.

    Defaults: SageMaker's PoorWeightInitialization and MindInsight's "weight initialization",
    judged once, on step 0, over the weights of Linear, Conv, ConvTranspose and Bilinear layers:

    - a constant weight (all zeros included): its units stay identical forever;
    - the spread across layers: SageMaker's PoorWeightInitialization fires when the ratio of
      largest to smallest layer variance exceeds ``variance_ratio`` = 10. A plain variance
      ratio flags PyTorch's own default initialisation of networks whose layers differ in
      width (in a ResNet, the 7x7 stem over 3 channels starts with 31x the variance of a 3x3
      convolution over 512), because standard initialisations scale the variance by 1 / fan-in.
      So each layer's variance is first multiplied by its fan-in (numel / shape[0], PyTorch's
      own definition): PyTorch's default init gives 1/3 for every layer, LeCun 1, Kaiming 2,
      Xavier between 0 and 2. The layer farthest from the median (in log space) is named.
      Initialisations scaled by fan-out (torchvision's ResNet) can still spread past 10x at a
      3-channel stem: raise ``variance_ratio`` for those;
    - MindInsight's optional bounds ``max_gt`` and ``min_lt`` on the initial values.

    ``variance_ratio`` is a number above 1 (the spread is never below 1); ``max_gt`` and
    ``min_lt`` are finite numbers or None, ``min_lt`` at most ``max_gt``, or every weight fires.

    Example: ``PoorInitialization(variance_ratio=100.0, max_gt=1.0)``.
    """

    kinds = frozenset({"param"})
    needs = (STD, MIN, MAX)

    def __init__(
        self,
        *,
        variance_ratio: float = 10.0,
        max_gt: float | None = None,
        min_lt: float | None = None,
        **selection: Any,
    ):
        super().__init__(**selection)
        self.variance_ratio = variance_ratio
        self.max_gt = max_gt
        self.min_lt = min_lt

    def check_params(self) -> None:
        check_number(self, "variance_ratio", above=1)
        check_number(self, "max_gt", none=True)
        check_number(self, "min_lt", none=True)
        if self.max_gt is not None and self.min_lt is not None and self.min_lt > self.max_gt:
            must = f"at most max_gt ({self.max_gt!r})"
            raise refusal(self, "min_lt", must, "otherwise every weight fires")

    def check_phase(
        self, tensors: Sequence[TensorStats], state: dict[str, Any]
    ) -> list[tuple[TensorStats, Finding]]:
        # Judged once per tensor, should the engine hand over step 0's parameters twice.
        judged: set[str] = state.setdefault("judged", set())
        weights = [t for t in tensors if t.name not in judged and _compared(t)]
        judged.update(t.name for t in weights)
        found = [(t, f) for t in weights if (f := self._alone(t)) is not None]
        # Variance x fan-in of each non-constant weight; constant ones were reported above.
        scaled = [
            (t, std * std * _fan_in(t))
            for t in weights
            if (std := t.get(STD)) is not None and math.isfinite(std) and std > 0
        ]
        if len(scaled) < 2:
            return found
        values = [v for _, v in scaled]
        ratio = max(values) / min(values)
        if not ratio > self.variance_ratio:
            return found
        middle = statistics.median(math.log(v) for v in values)
        t, v = max(scaled, key=lambda item: abs(math.log(item[1]) - middle))
        typical = math.exp(middle)
        effect = "activations and gradients grow" if v > typical else "signals fade"
        found.append(
            (
                t,
                Finding(
                    ratio,
                    self.variance_ratio,
                    f"{t.name} starts with variance x fan-in {v:.3g}, {v / typical:.3g}x the "
                    f"median {typical:.3g} of {len(values)} layers (spread {ratio:.3g}x, "
                    f"threshold {self.variance_ratio:g}x); {effect} through this layer: "
                    "re-initialise it like the others (its module's reset_parameters(), or "
                    "torch.nn.init.kaiming_normal_).",
                ),
            )
        )
        return found

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        """The part of the verdict that needs no other layer: constant weights and bounds."""
        return self._alone(t) if _compared(t) else None

    def _alone(self, t: TensorStats) -> Finding | None:
        """A constant weight, or one out of the bounds set: judged without the other layers."""
        std, lo, hi = t.get(STD), t.get(MIN), t.get(MAX)
        if std == 0 and lo is not None:
            what = "all zeros" if lo == 0 else f"constant at {lo:.3g}"
            return Finding(
                std,
                0.0,
                f"{t.name} is {what} at initialisation; its units compute the same thing and "
                "get the same gradient, so they never become different: initialise it "
                "randomly (its module's reset_parameters(), or torch.nn.init.kaiming_normal_).",
            )
        if self.max_gt is not None and hi is not None and hi > self.max_gt:
            return Finding(
                hi,
                self.max_gt,
                f"{t.name} starts with values up to {hi:.3g}, above {self.max_gt:.3g}; check "
                "its initialisation scale.",
            )
        if self.min_lt is not None and lo is not None and lo < self.min_lt:
            return Finding(
                lo,
                self.min_lt,
                f"{t.name} starts with values down to {lo:.3g}, below {self.min_lt:.3g}; check "
                "its initialisation scale.",
            )
        return None


def _compared(t: TensorStats) -> bool:
    """Whether ``t`` is a step-0 weight matrix of a layer whose initialisation is judged."""
    return (
        t.step == 0
        and t.module_type in WEIGHTED_LAYERS
        and len(t.shape) >= 2
        and t.name.endswith("weight")
    )


def _fan_in(t: TensorStats) -> int:
    # Bilinear's default init scales by in1_features alone (weight is out x in1 x in2).
    if t.module_type == "Bilinear":
        return t.shape[1]
    return t.numel // t.shape[0]


def _param(t: TensorStats) -> str:
    """The parameter an update record is of: ``fc.weight`` for ``fc.weight.update``."""
    return t.name.removesuffix(".update")
