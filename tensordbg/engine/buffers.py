"""The model's floating-point buffers after a forward wrote them: BatchNorm's running statistics
and the like, which a training forward changes without making an output of them.

A batch whose variance overflows (a constant batch of 1e20: its variance is 1e40, past float32)
leaves a BatchNorm's running variance Inf while every output of that forward stays finite (the
module normalizes with the batch's own statistics, and 1e20 / Inf is 0). ``model.eval()`` then
divides by that Inf: every input gives the same output. No output and no gradient shows it, so
the buffers are read themselves, at the end of each root forward: those of the modules whose
buffers the forward changed. A change is told by versions: torch's batch-norm kernel writes the
running statistics without bumping their version, but BatchNorm adds to ``num_batches_tracked``
in Python, which does, so a module is taken whole when any of its buffers moved. An evaluation
changes none and reads none. What is read is one norm of each, summed (on a device, with the
phase's transfer); only a sum that is not finite reads them one by one.

A buffer found not finite is a hit once (the forward that made it is its origin) and then not
again while it stays so: it is read at each training forward, but its state is the same news.
One that held NaN or Inf when tensordbg attached came with the model (loaded so), and its hit
says that. Only NaN and +Inf count: an additive attention mask holds -inf by design (a
running statistic that overflows holds +Inf: its variance does). Modules given buffers after
attach are not watched.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from tensordbg.statistics.torch_kernels import SCREEN, host_stats, watchable


class Owner:
    """A module with buffers: its path, its type's name and its buffers' names."""

    __slots__ = ("module", "names", "path", "type_name")

    def __init__(self, path: str, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)
        self.path = path
        self.type_name = type(module).__name__
        prefix = f"{path}." if path else ""
        self.names = tuple((n, f"{prefix}{n}") for n in module._buffers)  # (own, full)

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Its buffers now (a script may assign a new tensor to one), by full name."""
        module = self.module()
        if module is None:
            return []
        found = [(full, module._buffers.get(n)) for n, full in self.names]
        return [(name, b) for name, b in found if b is not None]


class BufferWatch:
    """Which buffers a forward changed, and which were found not finite."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.owners = [Owner(path, m) for path, m in model.named_modules() if m._buffers]
        self._versions: list[tuple[int, ...]] = []
        self.fired: set[str] = set()
        """Buffers found not finite and reported: not again while they stay so."""
        self.came_bad = {name for owner in self.owners for name, b in _floating(owner) if _bad(b)}
        """Buffers that held NaN or Inf when tensordbg attached: the model came with them."""

    def begin(self) -> None:
        """A root forward starts: its buffers' versions now (a change between forwards, a
        hand's, is no forward's)."""
        self._versions = [_versions(owner) for owner in self.owners]

    def changed(self) -> list[tuple[Owner, str, torch.Tensor]]:
        """The floating-point buffers of the modules whose buffers moved since :meth:`begin`."""
        return [(owner, name, b) for owner, before in zip(self.owners, self._versions, strict=False)
                if _versions(owner) != before for name, b in _floating(owner)]  # fmt: skip

    def all_finite(self, written: list[tuple[Owner, str, torch.Tensor]]) -> bool:
        """On the host: whether the sum of their norms is finite (one read of them all)."""
        return math.isfinite(torch.stack(self.norms(written)).sum().item())

    def read_each(self, changed: list[tuple[Owner, str, torch.Tensor]],
                  report: Callable[[Owner, str, torch.Tensor], None]) -> None:  # fmt: skip
        """Each of ``changed`` read alone: the sum of their norms was not finite (squares of
        large finite values can overflow it: those stay unreported)."""
        for owner, name, b in changed:
            if not _bad(b):
                self.fired.discard(name)
            elif name not in self.fired:
                self.fired.add(name)
                report(owner, name, b)

    def norms(self, changed: list[tuple[Owner, str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each one's norm, as 0-d tensors in one call (on a device, for the phase's transfer;
        a BatchNorm's are small, so the calls cost more than the reads)."""
        return list(torch._foreach_norm([b.detach().float() for _, _, b in changed]))


def _versions(owner: Owner) -> tuple[int, ...]:
    return tuple(b._version for _, b in owner.buffers())


def _floating(owner: Owner) -> list[tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in owner.buffers() if watchable(b)]


def _bad(b: torch.Tensor) -> bool:
    """NaN, or +Inf: an additive attention mask holds -inf by design (a running statistic
    that overflows holds +Inf: a variance, and a mean's square in it)."""
    b = b.detach()
    if host_stats(b, SCREEN)[0] == 1.0:
        return False
    return bool(torch.isnan(b).any() or torch.isposinf(b).any())
