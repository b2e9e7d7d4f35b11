"""Statistics: each defined once in the registry, computed next to the tensor by its torch kernel
and offline by its numpy reference. What each costs in passes over the tensor, and that the
device path (batched), the host path (eager) and numpy (offline) give the same values on random
and adversarial tensors, and scale under a loss scale as the registry declares."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensordbg.statistics import (
    ABS_MEAN,
    FINITE,
    L2,
    MAX,
    MEAN,
    MIN,
    NAN,
    PREV_ABS_MEAN,
    REGISTRY,
    SCALE_LINEAR,
    STD,
    UPDATE_ABS_MEAN,
    Scaling,
    Stat,
    compute_numpy,
    dead_unit_frac,
    in_range_frac,
    torch_kernels,
    update_unchanged,
)
from tensordbg.statistics.batch import StatsBatch
from tensordbg.statistics.registry import ANY_NONFINITE
from tensordbg.statistics.summaries import summary_vector
from tensordbg.statistics.torch_kernels import (
    device_parts,
    device_stats,
    dtype_name,
    host_stats,
    scale_vector,
    update_stats,
)

ml_dtypes = pytest.importorskip("ml_dtypes")


class _Ops(TorchDispatchMode):
    """Every aten operation run inside it, with the sizes and addresses of its tensor
    arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[int], list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            sizes = [a.numel() for a in tensors]
            self.ops.append((str(func.overloadpacket), sizes, [a.data_ptr() for a in tensors]))
        return func(*args, **(kwargs or {}))


def full_passes(fn: Callable[..., object], t: torch.Tensor, *args: object) -> list[str]:
    """The operations ``fn(t, *args)`` runs that read a tensor the size of ``t``: its passes."""
    with _Ops() as seen:
        fn(t, *args)
    return [op for op, sizes, _ in seen.ops if t.numel() in sizes]


# --- "finite" comes free with a statistic computed anyway ------------------------------------


def test_finite_costs_one_sum_alone_and_no_pass_beside_a_witness():
    t = torch.randn(4096)
    assert full_passes(device_stats, t, (FINITE,)) == ["aten.sum"]
    for stats in ((FINITE, MIN, MAX), (MIN, MAX, FINITE), (FINITE, MIN)):
        assert full_passes(device_stats, t, stats) == ["aten.aminmax"]
    assert full_passes(device_stats, t, (FINITE, L2)) == ["aten.linalg_vector_norm"]
    for stats in ((FINITE, MIN, MAX), (FINITE, L2)):
        assert "aten.sum" not in full_passes(host_stats, t, stats)


def _tensors() -> dict[str, torch.Tensor]:
    finite = torch.randn(64, 32)
    nan, posinf, neginf = finite.clone(), finite.clone(), finite.clone()
    nan[3, 4] = math.nan
    posinf[5, 6] = math.inf
    neginf[7, 8] = -math.inf
    return {
        "finite": finite,
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
        "huge": torch.full((64, 32), 1e30),  # finite, yet its L2 norm overflows float32
        "bfloat16 +inf": posinf.bfloat16(),
    }


STATS = (
    (FINITE,),
    (FINITE, MIN, MAX),
    (MIN, MAX, FINITE),
    (FINITE, MIN),
    (MAX, FINITE),
    (FINITE, L2),
    (L2, FINITE),
    (FINITE, MEAN),
    (FINITE, STD, ABS_MEAN),
    (MEAN, L2),
)


@pytest.mark.parametrize("stats", STATS, ids=lambda s: ",".join(map(str, s)))
@pytest.mark.parametrize("name", list(_tensors()))
def test_device_and_host_agree_and_any_nan_or_inf_makes_finite_zero(name, stats):
    t = _tensors()[name]
    on_device = device_stats(t, stats).tolist()
    on_host = host_stats(t, stats)
    assert on_device == pytest.approx(on_host, rel=1e-6, nan_ok=True)
    assert _batched(t, stats) == pytest.approx(on_device, rel=0, nan_ok=True)
    if FINITE in stats:
        finite = on_host[stats.index(FINITE)]
        assert finite == on_device[stats.index(FINITE)]
        if name in ("nan", "posinf", "neginf", "bfloat16 +inf"):
            assert finite == 0.0
        elif name == "finite":
            assert finite == 1.0
        else:  # huge: finite, and so is its norm (accumulated where x * x cannot overflow)
            assert finite == 1.0


def test_a_phase_of_many_tensors_costs_its_kernels_and_a_few_launches_for_the_transfer():
    """Batched checks launch each tensor's kernels and nothing else per tensor (no conversion,
    no stacking: on CUDA, launches are what hundreds of small tensors cost); the transfer
    converts and stacks them a few at a time, whatever their number. Each tensor's values are
    those of its own vector, among tensors of other dtypes, empty ones and a ready vector."""
    common = [(FINITE,), (FINITE, MIN, MAX), (FINITE, L2)]  # activations, weights, gradients
    plain = torch.randn(64, 32)
    for stats in common:
        with _Ops() as seen:
            StatsBatch().add_parts(*device_parts(plain, stats))
        assert len(seen.ops) == 1, (stats, seen.ops)  # the sum, the range or the norm alone
    tensors = [_tensors()[name] for name in _tensors()] * 20
    tensors += [torch.empty(0), torch.randn(7, dtype=torch.float64)]
    chosen = [STATS[i % len(STATS)] for i in range(len(tensors))]
    batch = StatsBatch()
    for t, stats in zip(tensors, chosen, strict=True):
        batch.add_parts(*device_parts(t, stats))
    vector = torch.tensor([1.0, -2.5], dtype=torch.float64)
    slot = batch.add(vector)
    with _Ops() as seen:
        values = batch.flush()
    assert len(seen.ops) <= 3 * 4 + 2, [op for op, _, _ in seen.ops]  # stacks, casts, one cat
    for t, stats, got in zip(tensors, chosen, values[:-1], strict=True):
        expected = device_stats(t, stats).tolist()
        assert got == pytest.approx(expected, rel=0, nan_ok=True), (t.dtype, stats)
    assert values[slot] == [1.0, -2.5]


# --- update statistics ------------------------------------------------------------------------


UPDATES = (UPDATE_ABS_MEAN, PREV_ABS_MEAN, update_unchanged(1e-3, 1e-6), update_unchanged(0, 0))


@pytest.mark.parametrize("order", [UPDATES, UPDATES[::-1], UPDATES[2:] + UPDATES[:2]])
def test_update_statistics_subtract_once_in_any_order_and_match_numpy(order):
    before = torch.randn(256, 64)
    after = before.clone()
    after[:8] += 1e-2
    ops = _Ops()
    with ops:
        values = update_stats(after, before, order).tolist()
    operands = [after.data_ptr(), before.data_ptr()]
    assert [op for op, _, ptrs in ops.ops if ptrs == operands] == ["aten.sub"]
    expected = compute_numpy(after.numpy(), order, prev=before.numpy())
    assert values == pytest.approx([expected[s] for s in order], rel=1e-6)


def test_update_statistics_keep_other_statistics_of_the_parameter():
    before = torch.randn(32)
    after = before.clone()
    after[0] = math.nan
    values = update_stats(after, before, (FINITE, UPDATE_ABS_MEAN, NAN)).tolist()
    assert values[0] == 0.0 and math.isnan(values[1]) and values[2] == 1.0


# --- summaries and dead units ---------------------------------------------------------------


def test_a_summary_masks_non_finite_elements_with_one_isfinite(monkeypatch):
    calls = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda x: calls.append(x) or isfinite(x))
    t = torch.tensor([1.0, math.nan, 3.0, math.inf])
    numel, nan, posinf, neginf, zeros, lo, hi, *_ = summary_vector(t).tolist()
    assert (numel, nan, posinf, neginf, zeros, lo, hi) == (4, 1, 1, 0, 0, 1.0, 3.0)
    assert len(calls) == 1


def test_dead_units_of_a_relu_take_one_comparison_and_agree_with_numpy():
    x = torch.relu(torch.randn(64, 32))
    x[:, :24] = 0.0
    x[0, 0] = math.inf  # an overflowed unit is live: its single +Inf is positive
    dead = dead_unit_frac(0, math.inf, -1, 0.01)
    comparisons = [
        op
        for op in full_passes(device_stats, x, (dead,))
        if op in ("aten.gt", "aten.lt", "aten.ge", "aten.le")
    ]
    assert comparisons == ["aten.gt"]
    assert device_stats(x, (dead,)).tolist() == [compute_numpy(x.numpy(), (dead,))[dead]]
    saturated = dead_unit_frac(-0.5, 0.5, -1, 0.01)
    assert device_stats(x, (saturated,)).tolist() == [
        compute_numpy(x.numpy(), (saturated,))[saturated]
    ]


def test_a_unit_live_in_exactly_the_threshold_share_is_not_dead_on_either_side():
    # 7 of 100 live is 0.07, not under 0.07, though 0.07 * 100 is 7.000000000000001 in float64.
    x = torch.zeros(100, 3)
    x[:7, 0] = x[:6, 1] = x[:8, 2] = 1.0  # live in 7 %, 6 % and 8 %: only the second is dead
    dead = dead_unit_frac(0, math.inf, -1, 0.07)
    assert device_stats(x, (dead,)).tolist() == host_stats(x, (dead,)) == [1 / 3]
    assert compute_numpy(x.numpy(), (dead,))[dead] == 1 / 3


# --- one registry: the torch kernels and the numpy references agree ----------------------------

# Every registered statistic, the parameterised ones with parameters that probe them: bounds that
# integers hit exactly, bounds between two values of the half types (tanh(8.8) rounds to 1.0 in
# bfloat16), an open end, a per-unit threshold that is not a multiple of 1 / elements per unit.
EXAMPLES = [Stat(name) for name, entry in REGISTRY.items() if not entry.params] + [
    in_range_frac(-1, 1),
    in_range_frac(math.tanh(-8.8), math.tanh(8.8)),
    in_range_frac(-math.inf, 0),
    dead_unit_frac(0, math.inf, -1, 0.01),
    dead_unit_frac(-0.5, 0.5, 0, 0.3),
    update_unchanged(1e-3, 1e-6),
    update_unchanged(0, 0),
]
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def test_every_statistic_has_a_kernel_a_reference_and_an_example():
    assert set(REGISTRY) == set(torch_kernels._KERNELS) == {s.name for s in EXAMPLES}
    for entry in REGISTRY.values():
        assert set(entry.poisoned_by) <= ANY_NONFINITE
        assert all(0 <= i < len(entry.params) for i in entry.scaled_params)


def test_the_statistics_and_the_rules_load_without_torch():
    code = (
        "import sys, tensordbg.statistics, tensordbg.statistics.registry, tensordbg.rules; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_statistic_or_a_wrong_number_of_parameters_is_named():
    x = torch.ones(3)
    with pytest.raises(KeyError, match="unknown statistic median"):
        host_stats(x, (Stat("median"),))
    with pytest.raises(ValueError, match=r"takes the parameters \(lo, hi\)"):
        compute_numpy(x.numpy(), (Stat("in_range_frac", (1.0,)),))
    with pytest.raises(ValueError, match="needs the previous value"):
        device_stats(x, (UPDATE_ABS_MEAN,))


def _cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random and adversarial tensors of ``dtype`` (made in float64, then rounded to it)."""
    g = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    randn = torch.randn(64, 32, generator=g, dtype=torch.float64)
    uniform = torch.rand(64, 32, generator=g, dtype=torch.float64)

    def planted(*values: float) -> torch.Tensor:
        x = randn.clone()
        x.view(-1)[torch.randperm(x.numel(), generator=g)[: len(values)]] = torch.tensor(
            values, dtype=torch.float64
        )
        return x

    cases = {
        "random": randn * 3,
        "nan": planted(math.nan, math.nan),
        "+inf": planted(math.inf),
        "-inf": planted(-math.inf),
        "mixed": planted(math.nan, math.inf, -math.inf, 0.0, -0.0, math.inf),
        "all nan": torch.full((16, 4), math.nan, dtype=torch.float64),
        "empty": torch.empty(0, 32, dtype=torch.float64),
        "integers": torch.randint(-3, 4, (64, 32), generator=g).double(),
        "near max": randn.sign() * info.max * (1 - uniform / 4),
        "denormals": randn.sign() * info.tiny * uniform,  # under the smallest normal number
        "scalar": torch.tensor(-2.5, dtype=torch.float64),
        "one element": torch.tensor([7.0], dtype=torch.float64),
        "constant": torch.full((2048,), 0.1, dtype=torch.float64),
    }
    return {name: x.to(dtype) for name, x in cases.items()}


def _numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor as numpy holds it: bfloat16 and float8 through ml_dtypes, bit for bit."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def _tolerance(stat: Stat, x: np.ndarray, dtype: torch.dtype) -> tuple[float, float, bool]:
    """(relative, absolute, may_overflow) for comparing a torch value of ``stat`` with numpy's.

    Counts, fractions, the range and "finite" are exact on both sides: elements are compared as
    they are (a bound is rounded outwards to the dtype, so that no element crosses it), counts
    are integers, and fractions are divided in float64 on both sides. (``update_unchanged``
    rounds its bound in the tensor's dtype, but the updates here are either exactly zero or far
    above the bound.)

    Sums are not exact: numpy sums in float64, torch accumulates in float32 (float64 for float64
    tensors), and each addition rounds by up to eps of the accumulator. torch adds in a tree (or
    in vector lanes), whose error grows like log2(n) eps rather than n eps: 64 eps bounds it for
    these n <= 2**11 with a margin. The error of a mean is relative to mean |x| (cancellation can
    make the mean itself tiny), and a standard deviation inherits the error of the mean it is
    centred on. Squares of subnormal numbers underflow in float32 (the reference keeps them):
    each square loses at most the smallest subnormal, so a norm loses at most sqrt(n * that). An
    update |p - p_prev| is rounded to the tensor's dtype before it is summed: one eps more.

    A float32 accumulator overflows where the float64 reference does not (a sum of |x| or of x²
    beyond 3.4e38; for float64 tensors both overflow, each in its own order of additions). Then
    either side may say Inf or NaN; the engine takes a non-finite statistic as "count NaN and
    Inf", which settles it. Such a value is accepted.
    """
    entry = REGISTRY[stat.name]
    accumulator = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    xd = x.astype(np.float64)
    finite = xd[np.isfinite(xd)]
    with np.errstate(over="ignore"):
        sums = (np.sum(np.abs(finite)), np.sum(finite * finite))
    may_overflow = bool(finite.size) and max(sums) > accumulator.max
    exact = entry.scaling is Scaling.INVARIANT or stat in (MIN, MAX)
    if exact:  # "finite" alone is read off the sum, which can overflow too
        return 0.0, 0.0, may_overflow and stat == FINITE
    with np.errstate(over="ignore"):
        mean_abs = float(np.mean(np.abs(finite))) if finite.size else 0.0
    smallest_subnormal = accumulator.smallest_normal * accumulator.eps
    rel = 64 * accumulator.eps
    if entry.needs_prev:
        rel += torch.finfo(dtype).eps
    return (
        rel,
        64 * accumulator.eps * mean_abs + math.sqrt(x.size * smallest_subnormal),
        may_overflow,
    )


def _previous(x: torch.Tensor) -> torch.Tensor:
    """A value before a step: every third element moved by a lot, the others left exactly."""
    moved = torch.arange(x.numel()).reshape(x.shape) % 3 == 0
    wide = x.double()
    return torch.where(moved, wide * 0.75 + 0.25, wide).to(x.dtype)


def _batched(x: torch.Tensor, stats: tuple[Stat, ...], prev: torch.Tensor | None = None) -> list:
    """The statistics as batched checks compute them: kernel results left on the device, made
    values of in the phase's one transfer."""
    batch = StatsBatch()
    slot = batch.add_parts(*device_parts(x, stats, prev))
    return batch.flush()[slot]


def _torch_values(stats: tuple[Stat, ...], x: torch.Tensor, prev: torch.Tensor) -> list[list]:
    """The statistics by every torch path: the device vector, the batched parts, and the host
    read when the statistics do not need the previous value."""
    if any(REGISTRY[s.name].needs_prev for s in stats):
        return [update_stats(x, prev, stats).tolist(), _batched(x, stats, prev)]
    return [device_stats(x, stats).tolist(), _batched(x, stats), host_stats(x, stats)]


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _id(stat: Stat) -> str:
    return (
        f"{stat.name}({', '.join(f'{p:.9g}' for p in stat.params)})" if stat.params else stat.name
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("stat", EXAMPLES, ids=_id)
def test_torch_and_numpy_agree_on_random_and_adversarial_tensors(stat, dtype):
    for case, x in _cases(dtype).items():
        prev = _previous(x)
        expected = compute_numpy(_numpy(x), (stat,), prev=_numpy(prev))[stat]
        if x.numel() == 0:
            assert _same(expected, REGISTRY[stat.name].empty)
        rel, abs_, may_overflow = _tolerance(stat, _numpy(x), dtype)
        for (value,) in _torch_values((stat,), x, prev):
            # An overflowed sum: Inf or NaN, and for "finite" (read off the sum) 0.
            overflowed = not (math.isfinite(value) and math.isfinite(expected)) or (
                stat == FINITE and value == 0.0
            )
            if may_overflow and overflowed:
                continue
            assert value == pytest.approx(expected, rel=rel, abs=abs_, nan_ok=True), case


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_all_statistics_at_once_are_each_alone_and_finite_is_exact(dtype):
    stats = (FINITE, *EXAMPLES, MIN)  # "finite" read off the range; one statistic asked twice
    for case, x in _cases(dtype).items():
        prev = _previous(x)
        together = update_stats(x, prev, stats).tolist()
        assert together[0] == compute_numpy(_numpy(x), (FINITE,))[FINITE], case
        for stat, value in zip(stats, together, strict=True):
            if stat == FINITE:  # alone, it is read off the sum, which overflows "near max"
                continue
            (alone,) = _torch_values((stat,), x, prev)[0]
            assert _same(value, alone), (case, str(stat))
        plain = tuple(s for s in stats if not REGISTRY[s.name].needs_prev)
        on_device, batched, on_host = _torch_values(plain, x, prev)
        assert on_device[0] == batched[0] == on_host[0] == together[0], case
        assert _batched(x, stats, prev) == pytest.approx(together, nan_ok=True), case


def test_an_untouched_parameter_is_unchanged_on_both_sides():
    for dtype in DTYPES:
        x = _cases(dtype)["random"]
        for stat in (update_unchanged(0, 0), UPDATE_ABS_MEAN):
            expected = compute_numpy(_numpy(x), (stat,), prev=_numpy(x))[stat]
            assert update_stats(x, x.clone(), (stat,)).tolist() == [expected]
            assert expected == (1.0 if stat.name == "update_unchanged" else 0.0)


def test_a_bound_between_two_values_of_the_dtype_is_not_rounded_into_the_range():
    # tanh(8.8) = 1 - 4.5e-8 rounds to 1.0 in bfloat16, yet a saturated output of 1.0 lies
    # outside [tanh(-8.8), tanh(8.8)]: the kernel rounds the bound inwards, not to the nearest.
    x = torch.tensor([1.0, 0.5, -1.0, -0.25], dtype=torch.bfloat16)
    stat = in_range_frac(math.tanh(-8.8), math.tanh(8.8))
    assert device_stats(x, (stat,)).tolist() == host_stats(x, (stat,)) == [0.5]
    assert compute_numpy(_numpy(x), (stat,))[stat] == 0.5


@pytest.mark.parametrize("stat", EXAMPLES, ids=_id)
def test_a_loss_scale_changes_each_statistic_as_the_registry_declares(stat):
    entry = REGISTRY[stat.name]
    scale = 2.0**10  # a power of two, as GradScaler's: scaling by it rounds nothing
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    x[:, :4] = 0.0
    prev = _previous(x)
    params = tuple(p * scale if i in entry.scaled_params else p for i, p in enumerate(stat.params))
    scaled = Stat(stat.name, params)
    factor = scale if entry.scaling is Scaling.LINEAR else 1.0
    expected = compute_numpy(x.numpy(), (stat,), prev=prev.numpy())[stat]
    got = compute_numpy((x * scale).numpy(), (scaled,), prev=(prev * scale).numpy())[scaled]
    assert got == expected * factor
    for unscaled, on_scaled in zip(
        _torch_values((stat,), x, prev),
        _torch_values((scaled,), x * scale, prev * scale),
        strict=True,
    ):
        assert on_scaled == [unscaled[0] * factor]
    if not entry.scaled_params:  # what the engine does to a scaled gradient's vector
        inverse = scale_vector((stat,), torch.tensor(1 / scale))
        (vector,) = _torch_values((stat,), x * scale, prev * scale)[:1]
        assert (torch.tensor(vector, dtype=torch.float64) * inverse).tolist() == [
            _torch_values((stat,), x, prev)[0][0]
        ]
    assert (stat.name in SCALE_LINEAR) == (entry.scaling is Scaling.LINEAR)


@pytest.mark.parametrize("stat", [s for s in EXAMPLES if REGISTRY[s.name].poisoned_by], ids=_id)
def test_a_statistic_is_non_finite_for_the_values_it_declares_it_shows(stat):
    for kind, value in (("nan", math.nan), ("+inf", math.inf), ("-inf", -math.inf)):
        if kind not in REGISTRY[stat.name].poisoned_by:
            continue
        x = torch.randn(64)
        x[5] = value
        values = [compute_numpy(x.numpy(), (stat,))[stat], *device_stats(x, (stat,)).tolist()]
        values += host_stats(x, (stat,))
        assert not any(math.isfinite(v) for v in values), kind


def test_a_tuple_of_statistics_is_planned_once(monkeypatch):
    made = []
    make = torch_kernels._make_plan
    monkeypatch.setattr(
        torch_kernels, "_make_plan", lambda stats: made.append(stats) or make(stats)
    )
    monkeypatch.setattr(torch_kernels, "_PLANS", {})
    t = torch.randn(32)
    for _ in range(3):
        host_stats(t, (FINITE, MIN, L2))
        device_stats(t, (FINITE, MIN, L2))
        host_stats(t, (FINITE,))  # the screen alone needs no plan
    assert made == [(FINITE, MIN, L2)]


def test_the_norm_of_a_finite_float32_tensor_past_1e19_is_finite():
    """x * x overflows float32 past |x| ~ 1.8e19; the norm of such a gradient is still finite
    (a hit that says "norm inf" on a finite tensor is a false statement)."""
    t = torch.tensor([-1.14e26, 3.0e25])
    expected = float(np.linalg.norm(t.double().numpy()))
    assert host_stats(t, (L2,))[0] == pytest.approx(expected, rel=1e-6)  # eager and deferred
    assert device_stats(t, (L2,)).tolist()[0] == pytest.approx(expected, rel=1e-6)  # batched


# --- statistics of a large slice, streamed --------------------------------------------------------


class _PeakAllocation(TorchDispatchMode):
    """The largest new storage an operation allocates while the mode is on (bytes; views of
    an input allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.peak = max(self.peak, t.untyped_storage().nbytes())  # a new allocation
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_streamed_summary_and_histogram_agree_with_one_pass_over_the_tensor(dtype):
    from tensordbg.statistics.summaries import streamed_histogram, streamed_summary, summarize

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 11, 13, generator=g) * 3 + 1).to(dtype)
    x[3, 4, 5], x[20, 1, 2], x[36, 10, 12] = math.nan, math.inf, -math.inf
    x[7] = 0
    view = x[:, 2:9, ::2]  # strided: never copied whole
    whole, streamed = summarize(view), streamed_summary(view, size=50)
    assert (streamed.numel, streamed.nan, streamed.posinf, streamed.neginf, streamed.zeros) == (
        whole.numel, whole.nan, whole.posinf, whole.neginf, whole.zeros)  # fmt: skip
    for field in ("min", "max", "mean", "std", "abs_mean", "l2"):
        assert getattr(streamed, field) == pytest.approx(getattr(whole, field), rel=1e-5), field
    finite = view[torch.isfinite(view)].float()
    expected = torch.histc(finite, bins=16, min=-5, max=7).to(torch.int64).tolist()
    assert streamed_histogram(view, 16, -5.0, 7.0, size=50) == expected


def test_statistics_of_a_large_slice_allocate_a_chunk_not_the_slice():
    from tensordbg.statistics.summaries import streamed_histogram, streamed_summary

    x = torch.randn(64, 1024, 64)  # 16 MiB
    with _PeakAllocation() as mode:
        summary = streamed_summary(x, size=1 << 16)
        streamed_histogram(x, 64, summary.min, summary.max, size=1 << 16)
    # A float64 copy of one chunk (512 KiB) is the largest temporary, not the 16 MiB view
    # (one pass would make a float copy, a mask and a masked copy of all of it).
    assert mode.peak <= (1 << 16) * 8
    assert summary.numel == x.numel()


def test_an_empty_slice_is_said_empty_not_nan():
    """``[3:1]`` selects nothing: the line says so, not a NaN range, mean and spread."""
    from tensordbg.statistics import summarize_numpy
    from tensordbg.statistics.registry import describe

    line = describe(summarize_numpy(np.zeros((0, 3), dtype=np.float32)).as_dict(), (0, 3),
                    "float32")  # fmt: skip
    assert line == "tensor[0,3] float32 n=0 empty"
    assert "nan" not in describe({"numel": 4, "min": 0.0, "max": 1.0, "mean": 0.5}).lower()


@pytest.mark.parametrize("stats", [(FINITE,), (FINITE, MEAN), (FINITE, MEAN, L2)])
def test_finite_values_whose_sum_overflows_read_finite_on_the_host(stats):
    """A sum (or the squares of a norm) past float32's range is not a NaN or an Inf: on the host
    the screen settles it with one element-wise pass, only then."""
    huge = torch.full((64,), 3e38)
    values = dict(zip(stats, host_stats(huge, stats), strict=True))
    assert values[FINITE] == 1.0
    huge[5] = math.inf
    assert host_stats(huge, stats)[0] == 0.0


def test_a_summary_of_finite_values_whose_sums_overflow_has_finite_moments():
    """Values near float32's largest: the summary of a hit read "mean nan, std nan" though
    every value is finite (its sums passed the range). They match float64's."""
    from tensordbg.statistics.summaries import summarize

    huge = (torch.rand(1001, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 3e38
    huge[::3] = 2.5e38
    assert torch.isfinite(huge).all()
    summary = summarize(huge)
    exact = huge.double()
    assert math.isclose(summary.mean, exact.mean().item(), rel_tol=1e-5, abs_tol=1e30)
    assert math.isclose(summary.std, exact.std(unbiased=False).item(), rel_tol=1e-5)
    assert math.isclose(summary.abs_mean, exact.abs().mean().item(), rel_tol=1e-5)
    assert math.isclose(summary.l2, exact.norm().item(), rel_tol=1e-5)
