"""Statistics of many tensors at once: a phase's, waiting on the device for one transfer to the
host (:class:`StatsBatch`); the norms of many tensors in one pass (:func:`norms_of`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

_F64 = torch.float64


class StatsBatch:
    """The statistic vectors of one phase, waiting on the device for one transfer to the host.

    >>> batch = StatsBatch()
    >>> slot = batch.add(device_stats(t, (MIN, MAX)))
    >>> values = batch.flush()[slot]
    """

    def __init__(self) -> None:
        self._vectors: list[Tensor] = []

    def __len__(self) -> int:
        return len(self._vectors)

    def add(self, vector: Tensor) -> int:
        self._vectors.append(vector)
        return len(self._vectors) - 1

    def flush(self) -> list[list[float]]:
        """All vectors as host lists, in the order added; one copy per device."""
        vectors, self._vectors = self._vectors, []
        if not vectors:
            return []
        by_device: dict[torch.device, list[int]] = {}
        for i, v in enumerate(vectors):
            by_device.setdefault(v.device, []).append(i)
        result: list[list[float]] = [[] for _ in vectors]
        for indices in by_device.values():
            parts = [vectors[i] for i in indices]
            flat = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()
            offset = 0
            for i in indices:
                size = vectors[i].numel()
                result[i] = flat[offset : offset + size]
                offset += size
        return result


# Statistics a norm of the whole tensor gives at once: finite (the norm is) and the norm.
_NORM_STATS = frozenset({"finite", "l2"})


def on_host(t: Tensor) -> bool:
    """Whether reading ``t`` costs no synchronization with a device."""
    return t.device.type == "cpu"


def norm_only(record: Any, tensor: Tensor) -> bool:
    """Whether a record's statistics all come from the tensor's norm (:func:`norms_of`)."""
    return (
        tensor.dtype in (torch.float32, _F64)
        and tensor.layout is torch.strided
        and all(s.name in _NORM_STATS for s in record.wanted)
    )


def norms_of(tensors: Sequence[Tensor]) -> list[float]:
    """The L2 norms of float32/float64 tensors as Python floats, in one pass over all of them
    (one read of the host). A norm that is not finite may be squares past the dtype's range:
    the caller measures that tensor exactly."""
    if not tensors:
        return []
    return torch.stack(torch._foreach_norm(list(tensors))).tolist()  # float64 if any is
