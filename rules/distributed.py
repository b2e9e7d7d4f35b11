"""Rules about the ranks of a job (``torchrun``, ``DistributedDataParallel``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

from tensordbg.rules.base import Finding, Rule, check_count, check_number


class RankDivergence(Rule):
    """Parameters that data parallelism keeps identical on every rank have drifted apart.

    DDP all-reduces the gradients, so every rank applies the same update to the same weights: a
    rank whose weights differ (a non-deterministic custom op, an update applied on one rank only,
    a parameter changed by hand, a missed broadcast) trains a different model from then on,
    silently. No single-process check can see it. Every ``every`` optimizer steps each rank
    publishes one norm per parameter (a fingerprint, one fused kernel) through the job's store,
    never through a collective; a rank whose norm differs from rank 0's by more than ``rtol``
    (relative) reports the parameter. Parameters sharded by FSDP2 differ by design and are not
    compared. A drift is reported at most ``2 * every`` steps after it happened.

    Defaults: ``every`` = 10 steps (a norm per parameter every 10 steps costs well under 1 % of
    a step); ``rtol`` = 1e-5, far above the rounding of one norm computed with another thread
    count, far below any real drift. Added to the default rules when a job has several ranks.
    ``every`` is a whole number of 1 or more, ``rtol`` a number of 0 or more (0: any difference).

    Example: ``RankDivergence(every=1, exclude="*.bias")`` checks every step.
    """

    kinds = frozenset({"param"})
    # Judged on fingerprints exchanged between ranks (tensordbg.distributed), never on one tensor.

    def __init__(self, *, every: int = 10, rtol: float = 1e-5, **selection: Any):
        super().__init__(**selection)
        self.every = every
        self.rtol = rtol

    def check_params(self) -> None:
        check_count(self, "every")
        check_number(self, "rtol", least=0)

    def silent_when_finite(self, t: Any) -> bool:
        return True

    def selects(self, name: str) -> bool:
        """Whether the parameter ``name`` is compared (``match``/``exclude`` patterns)."""
        return any(fnmatchcase(name, p) for p in self.match) and not any(
            fnmatchcase(name, p) for p in self.exclude
        )

    def check(self, t: Any, state: dict[str, Any]) -> None:
        return None

    def compare(
        self, name: str, mine: float, reference: float, rank: int, reference_rank: int = 0
    ) -> Finding | None:
        """Judge one parameter's norm on this rank against the reference rank's."""
        if mine == reference or (math.isnan(mine) and math.isnan(reference)):
            return None
        scale = max(abs(mine), abs(reference))
        drift = abs(mine - reference) / scale if scale > 0 else math.inf
        if math.isfinite(drift) and drift <= self.rtol:
            return None
        return Finding(
            drift,
            self.rtol,
            f"{name} differs between ranks: its norm is {mine:.6g} on rank {rank} and "
            f"{reference:.6g} on rank {reference_rank} (relative difference {drift:.3g}); "
            "data parallelism keeps it identical on every rank, so this rank now trains a "
            "different model.",
        )


def drifted(
    rule: RankDivergence,
    names: Sequence[str],
    mine: Sequence[float],
    reference: Sequence[float],
    rank: int,
    reference_rank: int = 0,
) -> list[tuple[str, Finding]]:
    """Every selected parameter whose fingerprint differs, in order."""
    found = []
    for name, a, b in zip(names, mine, reference, strict=True):
        if rule.selects(name):
            finding = rule.compare(name, a, b, rank, reference_rank)
            if finding is not None:
                found.append((name, finding))
    return found
