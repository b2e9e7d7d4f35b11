"""Statistics computed next to the tensor: what each costs in passes over it, and that the device
path (batched), the host path (eager) and numpy (offline) give the same values."""

from __future__ import annotations

import math
from collections.abc import Callable

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
    STD,
    UPDATE_ABS_MEAN,
    compute_numpy,
    dead_unit_frac,
    update_unchanged,
)
from tensordbg.statistics.torch_kernels import (
    device_stats,
    host_stats,
    summary_vector,
    update_stats,
)


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
    assert full_passes(device_stats, t, (FINITE, L2)) == ["aten.dot"]
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
    if FINITE in stats:
        finite = on_host[stats.index(FINITE)]
        assert finite == on_device[stats.index(FINITE)]
        if name in ("nan", "posinf", "neginf", "bfloat16 +inf"):
            assert finite == 0.0
        elif name == "finite":
            assert finite == 1.0
        else:  # huge: 0 where the norm overflowed, a witness too; the engine then counts NaN/Inf
            assert finite == (0.0 if L2 in stats else 1.0)


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
