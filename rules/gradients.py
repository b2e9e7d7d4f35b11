"""Rules on parameter gradients: exploding and vanishing."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from tensordbg.rules.base import (
    Finding,
    Refine,
    Rule,
    among,
    apart,
    check_count,
    check_number,
    nonfinite_count,
    refusal,
)
from tensordbg.rules.loss import loss_spent, note_loss
from tensordbg.rules.scales import (
    RELATIVE,
    THRESHOLD,
    note_scale,
    note_scales,
    reference_scale,
    typical_scale,
)
from tensordbg.rules.streaks import calm, once_a_step, passes_of, said_this_step
from tensordbg.rules.weights import note_update, update_moved
from tensordbg.statistics import (
    ABS_MEAN,
    FINITE,
    L2,
    MAX,
    MIN,
    NAN,
    NEGINF,
    POSINF,
    ZERO_FRAC,
    Stat,
    TensorStats,
)


def _param(t: TensorStats) -> str:
    """The parameter's own name: ``bias`` for ``layers.0.fc.bias.grad``."""
    return t.name.removesuffix(".grad").rpartition(".")[2]


def _note_weight(t: TensorStats, state: dict[str, Any], learning: bool) -> bool:
    """Note, per module, whether each of its weights (its parameters other than biases) got
    a healthy gradient the last time it was judged, in ``state["weights"]``. Returns whether
    ``t`` is a bias's gradient instead (nothing noted)."""
    param = _param(t)
    if param.startswith("bias"):
        return True
    state.setdefault("weights", {}).setdefault(t.module, {})[param] = learning
    return False


class ExplodingGradient(Rule):
    """A parameter's gradient that is non-finite, huge, or growing fast against its own history.

    Defaults: MindInsight's "gradient exploding" and SageMaker's ExplodingTensor fire on NaN/Inf
    only, which is when it is already too late. tensordbg also fires when the gradient norm
    passes ``max_norm`` (1e6), or, once ``warmup`` (10) norms of that gradient have been seen,
    when it is ``growth`` (20) times the median of its last ``window`` (50) finite norms: a norm
    growing x1.5 per step from 1 is caught near 300, long before float32 overflows.

    Growth must persist: it fires on the second step in a row (``persist`` = 2) above ``growth``
    x the median of the window and above every norm the gradient had, both before the streak
    (late in a run two hard batches in a row send a ResNet's head 280x its median, never past
    the norms of its first steps, when the loss was high). A
    healthy run has one-step spikes, however large: x20-x40 past step 45 of a small
    transformer, x300-x700 for every gradient at once once the loss is down to 1e-3 (one
    example a batch gets wrong: a new user's transformer with a GRU, 1,500 steps), back the
    next step; and two steps up, but below the largest of the 50 before. A gradient really
    exploding is still up a step later, higher than ever, far from any overflow
    (train_diverging.py: the verdict comes one step after the learning rate jumped, below 1e3;
    NaN and Inf fire when they appear, ``max_norm`` at once).

    Growth counts only for a gradient that has reached the model's typical size, the median
    root-mean-square of the other gradients at their last step before this one: a gradient
    that grows while still below it is catching up, not exploding. The query and key
    projections of a transformer start with tiny gradients (its attention is uniform) that
    grow a thousandfold once it learns where to look (BERT's, within 25 steps); rounding noise
    grows x20 from one step to another (the attention key bias's, which softmax cancels, at
    1e-13). When all gradients blow up at once, each passes the size the model had the step
    before. A gradient judged alone is compared with its own history only.

    ``max_norm`` is a positive number, ``growth`` a number above 1 (the norm against its
    median); ``window``, ``warmup`` and ``persist`` are whole numbers of 1 or more, ``warmup``
    at most ``window``, since the rule keeps ``window`` norms of each gradient.

    Example: ``ExplodingGradient(growth=10.0, match="decoder.*")`` is stricter on the decoder;
    ``ExplodingGradient(persist=1)`` fires on the first step above the bar.
    """

    kinds = frozenset({"grad"})
    needs = (FINITE, L2)

    def __init__(self, *, max_norm: float = 1e6, growth: float = 20.0, window: int = 50,
                 warmup: int = 10, persist: int = 2, **selection: Any):  # fmt: skip
        super().__init__(**selection)
        self.max_norm = max_norm
        self.growth = growth
        self.window = window
        self.warmup = warmup
        self.persist = persist

    def check_params(self) -> None:
        check_number(self, "max_norm", above=0)
        check_number(self, "growth", above=1)
        for name in ("window", "warmup", "persist"):
            check_count(self, name)
        if self.warmup > self.window:
            why = "the rule keeps the last window norms of a gradient"
            raise refusal(self, "warmup", f"at most window ({self.window})", why)

    def check_many(
        self, tensors: Sequence[TensorStats], state: dict[str, Any]
    ) -> list[Finding | Refine | None]:
        """:meth:`check` of each in turn. A finite gradient within ``growth`` x the smallest of
        its window (most of them, most steps) is only noted (its norm, its scale), all in one
        loop; the others are checked as they come, against the same typical gradient."""
        verdicts: list[Finding | Refine | None] = []
        quiet: list[TensorStats] = []
        streaks: dict[str, int] = state.setdefault("above", {})
        peaks: dict[str, float] = state.setdefault("peaks", {})
        growth, window, warmup, max_norm = self.growth, self.window, self.warmup, self.max_norm
        passes = passes_of(state)
        for t in tensors:
            once_a_step(t.name, t.step, state, streaks, peaks, passes)
            values = t.values
            norm = values.get(L2)
            history = state.get(t.name)
            if (
                norm is None
                or not norm <= max_norm  # NaN too
                or values.get(FINITE) != 1.0
                or t.summary is not None
                or history is None
                or len(history) < warmup
                or not ((low := min(history)) > 0 and norm <= growth * low)
            ):
                verdicts.append(self._check(t, state))
                continue
            history.append(norm)
            if len(history) > window:
                del history[:-window]
            calm(t.name, history, streaks, peaks)
            quiet.append(t)
            verdicts.append(None)
        note_scales(quiet, state)
        return verdicts

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        once_a_step(t.name, t.step, state, state.setdefault("above", {}),
                    state.setdefault("peaks", {}))  # fmt: skip
        return self._check(t, state)

    def _check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        if t.nonfinite:
            overflow = "lower the learning rate, clip gradients, or with float16 use a GradScaler."
            if t.has_nan and t.has_inf is False:  # 0/0 or 0 * Inf: rarely a rate too high
                count, nonfinite = nonfinite_count(t, (NAN,), "NaN")
                advice = (
                    "A NaN gradient comes from 0/0 or 0 × Inf in backward: the derivative of "
                    "sqrt or of a norm at zero, a division by a value near zero, log of a "
                    "negative value; look at the backward of what made it."
                )
            elif t.has_inf and t.has_nan is False:
                count, nonfinite = nonfinite_count(t, (POSINF, NEGINF), "infinite values")
                advice = f"The gradient overflowed: {overflow}"
            else:
                count, nonfinite = nonfinite_count(t, (NAN, POSINF, NEGINF), "NaN/Inf values")
                advice = (
                    "A NaN comes from 0/0 or 0 × Inf in backward (or from Infs that met), an "
                    f"Inf from an overflow: {overflow}"
                )
            message = f"{t.name} holds {nonfinite}{among(t)}."
            return Finding(count, None, message, advice)
        norm = t.get(L2)
        if norm is None:
            return None
        if not math.isfinite(norm):
            # Finite elements whose squares overflowed the norm: as explosive as it gets.
            return self._too_large(t, norm)
        history: list[float] = state.setdefault(t.name, [])
        streaks: dict[str, int] = state.setdefault("above", {})
        # The norms before the current streak (the last ones of the history are its own).
        before = history[: len(history) - min(streaks.get(t.name, 0), len(history))]
        seen = len(before)
        median = None
        # Most steps the norm is within growth x the smallest of the window, so within growth
        # x its median too: that median (a sort) is not needed.
        if seen >= self.warmup and not ((low := min(history)) > 0 and norm <= self.growth * low):
            median = statistics.median(before)
        history.append(norm)
        if len(history) > self.window:
            del history[: -self.window]
        scale = note_scale(t, state)
        if norm > self.max_norm:  # (once a step: its later passes show it again)
            return None if said_this_step(t.name, t.step, state) else self._too_large(t, norm)
        # Over a median of zero (a gradient that was exactly zero so far) growth means nothing.
        # The bar is also the largest norm it had before the streak, over the whole run: late
        # in a run, hard batches send a gradient up for a step or two, never past the norms of
        # its first steps, when the loss was high.
        peaks: dict[str, float] = state.setdefault("peaks", {})
        highest = max(peaks.get(t.name, 0.0), max(before, default=0.0))  # a max_norm hit too
        above = median is not None and median > 0 and norm > self.growth * median
        typical = typical_scale(state, t.name, before=t.step) if above else None
        if not above or norm <= highest or (scale is not None and typical is not None
                                            and scale < typical):  # fmt: skip
            calm(t.name, history, streaks, peaks)  # (or catching up with the model's)
            return None
        ratio = norm / median
        streaks[t.name] = streaks.get(t.name, 0) + 1
        if streaks[t.name] < self.persist or said_this_step(t.name, t.step, state):
            return None  # one step above the bar: a spike, however far above (or said)
        return Finding(
            ratio,
            self.growth,
            f"{t.name} has norm {norm:.3g}, {ratio:.3g}x its running median {median:.3g} over "
            f"the {seen} steps before it grew (threshold {self.growth:g}x) and above the "
            f"largest it had ({highest:.3g}), for {streaks[t.name]} steps in a row; gradients "
            "are exploding: lower the learning rate or clip gradients.",
        )

    def _too_large(self, t: TensorStats, norm: float) -> Finding:
        said, bound = apart(norm, self.max_norm)
        return Finding(norm, self.max_norm, f"{t.name} has norm {said}, above {bound}; gradients "
                       "are exploding: lower the learning rate or clip gradients "
                       "(torch.nn.utils.clip_grad_norm_).")  # fmt: skip


class VanishingGradient(Rule):
    """A trainable parameter whose gradient is so small that the parameter barely learns.

    Defaults: SageMaker's VanishingGradient fires when mean |grad| < ``threshold`` = 1e-7
    (MindInsight recommended 1e-9 for the same statistic). On its own that bound raises false
    alarms on healthy models; three more conditions keep them out:

    - Sparse gradients are judged over their nonzero elements, mean |grad| / (1 - fraction of
      zeros): a step of a language model touches a few hundred rows of its embedding table and
      leaves the others at zero, so the mean over the whole table is tiny by design
      (pytorch/examples' word language model fell below 1e-7 on most steps).
    - The gradient must also be below ``relative`` = 1e-5 times the model's typical gradient,
      the median root-mean-square of the other gradients (each one's latest, zeros left out).
      Neither debugger compared gradients with each other; 1e-5 is tensordbg's: under plain SGD
      such a parameter moves 100,000 times slower than the rest. A loss that is
      small everywhere is not a vanishing gradient, nor are the query and key projections of
      a freshly initialised transformer, whose attention is still uniform (1e-4 of the median
      in a BART encoder). The first gradients of a training, with none to compare with, are
      judged on ``threshold`` alone; ``relative=math.inf`` always judges that way.
    - When the typical gradient is itself below ``relative`` times the step's largest, the
      largest is the one compared with: a gradient that vanishes on its way back through most
      of the model (a scale of 1e-9 in the middle of an MLP) takes the median with it.
    - A bias whose gradient vanishes while its module's weight gets a healthy one is cancelled
      downstream by construction, not cut off: softmax ignores a shift shared by all keys (the
      attention key bias, BERT's ``attention.self.key.bias``), BatchNorm subtracts the batch
      mean (the bias of a convolution right before it). It is not reported. A bias judged
      before its module's weight on its first step waits a step for it, unless its gradient is
      exactly zero.

    A vanishing gradient must persist ``persist`` (2) judged steps in a row: a mixture of experts
    gives an expert 1-4 tokens some steps, all classified right already, and its gradient is small
    at its source that step alone (5 hits in 600 healthy steps, found trying it as a new user); a
    gradient that vanishes on its way back does so every step. An exactly zero gradient is not
    judged until an optimizer step has moved a parameter, then reported at once: a zero by
    construction is lifted by the first update that moves something (the last BatchNorm scale of
    torchvision's ``zero_init_residual=True``, a ReZero or LayerScale gate at 0: under a warmup
    from a learning rate of 0, its branch got zeros on step 1 too, 12 false hits on a healthy
    transformer); a dead or detached branch is still dead after it. Update records tell (one saying
    its parameter changed, or an ``lr_share`` above 0; read where WeightNotChanging has them made);
    with none before a step, step 0's update is taken to have moved. An expert called on an empty
    batch (no token chose it: ``expert(x[routed])`` with no row routed) gets gradients of zeros
    that no data made; the engine does not judge a parameter whose module got only empty tensors in
    the step, as it does not judge one no backward pass reached (34 hits in 60 healthy steps of an
    8-expert mixture before, found trying it as a new user). Frozen parameters are never judged.

    ``threshold`` is a positive number, ``relative`` a positive number or ``math.inf``,
    ``persist`` a whole number of 1 or more.

    Nor while an observed loss of the step is 0 or at most 1e-7 of its largest: every gradient
    is next to nothing then, by design (one batch overfit to a loss of 0 raised 3,910 hits).
    With no loss observed, every gradient of the step at most 1e-7 of the largest any had says
    the same (judged one at a time, from the step after the first such step; a model without
    biases whose every unit died looks the same: observe the loss to tell them apart).

    Example: ``VanishingGradient(threshold=1e-9)`` uses MindInsight's stricter bound.
    """

    kinds = frozenset({"grad", "observed", "update"})
    # Screened with bounds from the norm; mean |grad| and the share of zeros are computed only
    # for a gradient whose bounds reach neither the threshold nor relative times the model's
    # typical gradient (see _nonzero_mean).
    needs = (L2,)

    def __init__(
        self,
        *,
        threshold: float = THRESHOLD,
        relative: float = RELATIVE,
        persist: int = 2,
        **selection: Any,
    ):
        super().__init__(**selection)
        self.threshold = threshold
        self.relative = relative
        self.persist = persist

    def check_params(self) -> None:
        check_number(self, "threshold", above=0)
        check_number(self, "relative", above=0, infinite=True)
        check_count(self, "persist")

    def stats_for(self, t: TensorStats) -> tuple[Stat, ...]:
        # A loss's value comes with it (observe() measures its mean), an update's as other rules
        # ask: asked for nothing, each is read where it is there (a dump without, not unjudged).
        return () if t.kind in ("observed", "update") else self.needs

    def check_many(
        self, tensors: Sequence[TensorStats], state: dict[str, Any]
    ) -> list[Finding | Refine | None]:
        """A pass's gradients judged together: every one's scale is noted first, so that the
        typical gradient is the same for each, whichever statistics came with it (batched
        checks have what a Refine asks from the second step on; deferred ones ask again), and
        so is each weight that a bound shows learning, for its module's bias."""
        scales = note_scales(tensors, state)
        noted = []
        for t, scale in zip(tensors, scales, strict=True):
            mean = self._nonzero_mean(t, state) if t.trainable else None
            if t.trainable and mean is None:
                # Learning, a bound shows: a bias of its module judged before it in this pass
                # (the autograd engine makes a bias's gradient first) sees it so.
                _note_weight(t, state, learning=True)
            noted.append((t, scale, mean))
        seen: set[str] = state.setdefault("seen", set())
        streaks: dict[str, int] = state.setdefault("low", {})
        verdicts: list[Finding | Refine | None] = []
        for t, scale, mean in noted:
            if mean is None and scale is not None and t.trainable:
                # What _verdict makes of a gradient a bound shows learning (its weight noted
                # above): most of them, most steps.
                seen.add(t.name)
                if streaks:
                    streaks.pop(t.name, None)
                verdicts.append(None)
            else:
                verdicts.append(self._verdict(t, state, scale, mean))
        return verdicts

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | Refine | None:
        if t.kind == "observed":
            note_loss(t, state)
            return None
        if t.kind == "update":
            note_update(t, state)
            return None
        # Noted before a refinement too: the same value again when check is called back.
        scale = note_scale(t, state)
        mean = self._nonzero_mean(t, state) if t.trainable and scale is not None else None
        return self._verdict(t, state, scale, mean)

    def _verdict(self, t: TensorStats, state: dict[str, Any], scale: float | None,
                 mean: float | Refine | None) -> Finding | Refine | None:  # fmt: skip
        """:meth:`check` given the gradient's scale (noted) and :meth:`_nonzero_mean`."""
        if not t.trainable or scale is None:
            # Not measured this step (between interval steps), or not finite: not vanishing. A
            # weight's NaN or Inf gradient is one it receives: its module's bias is not cut off.
            if t.trainable and t.nonfinite:
                _note_weight(t, state, learning=True)
            return None
        if isinstance(mean, Refine):
            return mean
        seen: set[str] = state.setdefault("seen", set())
        first = t.name not in seen
        seen.add(t.name)
        typical, vanishing, largest = None, False, False
        if mean is not None and mean < self.threshold:
            typical, largest = reference_scale(state, t.name, self.relative)
            vanishing = typical is None or mean < self.relative * typical
        bias = _note_weight(t, state, learning=not vanishing)
        streaks: dict[str, int] = state.setdefault("low", {})
        # Not judged either: a zero by construction (a ReZero gate at 0) no update lifted yet.
        lifted = mean != 0 or update_moved(state, t.step)
        if mean is None or not vanishing or loss_spent(state, t.step) or not lifted:
            streaks.pop(t.name, None)
            return None
        if bias:
            param = _param(t)
            weights: dict[str, dict[str, bool]] = state.get("weights", {})
            known = [ok for name, ok in weights.get(t.module, {}).items() if name != param]
            if any(known):
                return None  # a shift cancelled downstream, while the module's weight learns
            if not known and first and mean > 0:
                return None  # its module's weight comes later in this pass: wait a step for it
        streaks[t.name] = streaks.get(t.name, 0) + 1
        if streaks[t.name] < self.persist and mean > 0:
            # A small gradient one step, from a few examples (an expert that got 2 tokens, all
            # right already); a zero after an update moved something is reported at once.
            return None
        earlier = state.get("had", {}).get(t.name, math.nan)  # a scale it had (NaN: never)
        return Finding(
            mean, self.threshold, *self._message(t, mean, typical, bias, earlier, largest)
        )

    def _nonzero_mean(self, t: TensorStats, state: dict[str, Any]) -> float | Refine | None:
        """mean |grad| over the nonzero elements (0.0 when all are zero), or None when a bound
        already shows that it does not vanish: it reaches the threshold, or ``relative`` times
        the model's typical gradient."""
        mean, zeros = t.get(ABS_MEAN), t.get(ZERO_FRAC)
        if mean is not None and zeros is not None:
            return mean / (1.0 - zeros) if zeros < 1.0 else 0.0
        if mean is not None:
            return None if mean >= self.threshold else Refine((ZERO_FRAC,))
        # Lower bounds on mean |g| from cheaper statistics (over all elements, so over the
        # nonzero ones too), each decisive for most gradients: sum |g| >= ||g||_2 gives mean |g|
        # >= L2 / n (no extra pass); Hölder, sum g^2 <= max |g| * sum |g|, gives mean |g| >=
        # L2^2 / (n * max |g|), within a few times of the truth. Only a gradient near the
        # threshold pays for the exact mean and its zeros.
        l2, n = t.get(L2), t.numel
        if l2 == 0:
            return 0.0  # all zeros: no pass needed (nor the tensor, gone in batched mode)
        if l2 is not None and l2 / n >= self.threshold:
            return None
        if l2 is not None and self._above_typical(l2 / n, t, state):
            # A large table's gradient, most of its rows zero (an embedding's): L2 / n is far
            # below the threshold, but not below the model's typical gradient times relative.
            return None
        peak = t.abs_max
        if peak is None:
            return Refine((MIN, MAX))
        if l2 is not None and peak > 0 and l2 * l2 / (n * peak) >= self.threshold:
            return None
        return Refine((ABS_MEAN, ZERO_FRAC))

    def _above_typical(self, bound: float, t: TensorStats, state: dict[str, Any]) -> bool:
        """Whether ``bound``, a lower bound on the gradient's mean |grad|, already reaches
        ``relative`` times the model's typical gradient (as :meth:`_verdict` computes it): then
        the gradient does not vanish, whatever its mean."""
        if self.relative == math.inf:
            return False
        typical, _ = reference_scale(state, t.name, self.relative)
        return typical is not None and bound >= self.relative * typical

    def _message(self, t: TensorStats, mean: float, typical: float | None, bias: bool,
                 earlier: float = math.nan, largest: bool = False) -> tuple[str, str]:  # fmt: skip
        """What the finding says, and its advice (not said where something else made it)."""
        if mean == 0 and earlier > 0:  # it is connected: it had one
            return (
                f"{t.name} receives no gradient at all (mean |grad| 0, threshold "
                f"{self.threshold:.3g}), though it had one before (root-mean-square "
                f"{earlier:.3g}).",
                "The units it feeds have died or saturated since, as a learning rate far too "
                "large makes them (WeightUpdateRatio measures the updates).",
            )
        if mean == 0:
            advice = ("The parameter is not connected to the loss, or sits behind dead units, "
                      "saturated units or a detached branch.")  # fmt: skip
            if bias and _attention_like(t):
                advice += (
                    " An attention key bias gets none by construction (softmax ignores a "
                    "shift shared by all keys); this one is left alone once its projection's "
                    f"weight is seen learning, or for good with exclude='{t.name}'."
                )
            message = (f"{t.name} receives no gradient at all (mean |grad| 0, threshold "
                       f"{self.threshold:.3g}).")  # fmt: skip
            return message, advice
        zeros = t.get(ZERO_FRAC) or 0.0
        nonzero = f" over its {round(t.numel * (1 - zeros))} nonzero values" if zeros else ""
        relative = ""
        if typical is not None and largest:  # the typical gradient vanished with it
            relative = (
                f" and {mean / typical:.2g}x the largest gradient of this step or the last "
                f"(root-mean-square {typical:.3g}; threshold {self.relative:g}x; the model's "
                "typical gradient is below that too: most of the model's gradients vanish)"
            )
        elif typical is not None:
            relative = (
                f" and {mean / typical:.2g}x the model's typical gradient (the median "
                f"root-mean-square of its others, {typical:.3g}; threshold {self.relative:g}x)"
            )
        return (
            f"{t.name} has mean |grad| {mean:.3g}{nonzero}, below {self.threshold:.3g}{relative}.",
            "The gradient vanishes on its way back: look for saturated activations upstream, "
            "add normalisation or residual connections, or check the initialisation.",
        )


def _attention_like(t: TensorStats) -> bool:
    where = f"{t.module}.{t.module_type}".lower()
    return "attn" in where or "attention" in where
