"""What tensordbg measures of a tensor: each statistic defined once in :data:`REGISTRY` with
its numpy reference (:mod:`.registry`, no torch); its torch kernel is attached under the same
name in :mod:`.torch_kernels`.

>>> from tensordbg.statistics import NAN, L2, TensorStats, definition
>>> definition(L2).scaling
<Scaling.LINEAR: 'linear'>
"""

from tensordbg.statistics.registry import (
    ABS_MEAN,
    FINITE,
    FLOAT_MAX,
    KINDS,
    L2,
    MAX,
    MEAN,
    MIN,
    NAN,
    NEGINF,
    POSINF,
    PREV_ABS_MEAN,
    REGISTRY,
    SCALE_LINEAR,
    STD,
    UPDATE_ABS_MEAN,
    UPDATE_STATS,
    ZERO_FRAC,
    Definition,
    Scaling,
    Stat,
    Summary,
    TensorStats,
    compute_numpy,
    dead_unit_frac,
    definition,
    describe,
    in_range_frac,
    stats_from_numpy,
    summarize_numpy,
    update_unchanged,
)

LR_SHARE = Stat("lr_share")
"""Not measured of a tensor: an update's learning rate, as a share of the largest its parameter
group has had while watched (the engine gives it to update records; WeightNotChanging reads
it: a schedule's tail leaves weights in place by design)."""

__all__ = [
    "ABS_MEAN",
    "FINITE",
    "FLOAT_MAX",
    "KINDS",
    "L2",
    "LR_SHARE",
    "MAX",
    "MEAN",
    "MIN",
    "NAN",
    "NEGINF",
    "POSINF",
    "PREV_ABS_MEAN",
    "REGISTRY",
    "SCALE_LINEAR",
    "STD",
    "UPDATE_ABS_MEAN",
    "UPDATE_STATS",
    "ZERO_FRAC",
    "Definition",
    "Scaling",
    "Stat",
    "Summary",
    "TensorStats",
    "compute_numpy",
    "dead_unit_frac",
    "definition",
    "describe",
    "in_range_frac",
    "stats_from_numpy",
    "summarize_numpy",
    "update_unchanged",
]
