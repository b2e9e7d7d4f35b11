"""A phase's statistics, waiting on the device for one transfer to the host."""

from __future__ import annotations

import torch
from torch import Tensor


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
