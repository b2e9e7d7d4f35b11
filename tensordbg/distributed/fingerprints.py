"""Fingerprints of a rank's parameters, exchanged through the job's store for
:class:`~tensordbg.rules.distributed.RankDivergence`.

Every ``every`` steps, after the optimizer step, each rank computes one norm per replicated
parameter (``torch._foreach_norm``: one fused kernel and one transfer) and writes them under
``fp/<step>/<rank>``. At the next such step it reads the previous step's fingerprints of rank 0
(written long before: a rank cannot finish a step's backward all-reduce before every rank has
finished the step before) and compares its own with them. Nothing waits for another rank: a
fingerprint not there yet is simply not compared.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from tensordbg.distributed.models import is_dtensor
from tensordbg.hit import Hit
from tensordbg.rules.distributed import RankDivergence, drifted

MAX_HITS_PER_CHECK = 5
REFERENCE_RANK = 0


class Fingerprints:
    """Publishes this rank's fingerprints and compares them with rank 0's (subscribed to the
    session's ``step_end``)."""

    def __init__(self, session: Any, store: Any, rank: int):
        self.session = session
        self.store = store
        self.rank = rank
        self._previous: tuple[int, list[float]] | None = None  # (step, own norms)
        self._names: list[str] | None = None
        self._params: list[torch.Tensor] = []
        self._digest = ""

    def on_step_end(self, event: str, payload: Any) -> None:
        rules = [a for a in self.session.ruleset.active
                 if a.enabled and isinstance(a.rule, RankDivergence)]  # fmt: skip
        if not rules:
            return
        step = int(payload["step"])
        every = max(1, int(rules[0].rule.every))
        if step % every:
            return
        norms = self._norms()
        self.store.set(f"fp/{step}/{self.rank}", json.dumps([self._digest, norms]))
        previous, self._previous = self._previous, (step, norms)
        if previous is None:
            return
        before, mine = previous
        if self.rank != REFERENCE_RANK:
            reference = self._fingerprint(before, REFERENCE_RANK)
            if reference is not None:
                for active in rules:
                    self._report(active, before, mine, reference)
        old = f"fp/{before - every}/{self.rank}"
        if before - every >= 0 and self.store.check([old]):
            self.store.delete_key(old)

    def _norms(self) -> list[float]:
        if self._names is None:
            # Replicated parameters only: FSDP2 shards differ by design.
            sharded = set(getattr(self.session, "sharded", ()))
            params = [p for p in self.session.weights.params.values()
                      if p.name not in sharded and not is_dtensor(p.param)]  # fmt: skip
            self._names = [p.name for p in params]
            self._params = [p.param for p in params]
            self._digest = hashlib.sha256("\n".join(self._names).encode()).hexdigest()[:16]
        if not self._params:
            return []
        with torch.no_grad():
            norms = torch._foreach_norm([p.detach() for p in self._params])
            return torch.stack([n.float() for n in norms]).tolist()

    def _fingerprint(self, step: int, rank: int) -> list[float] | None:
        key = f"fp/{step}/{rank}"
        if not self.store.check([key]):
            return None
        digest, norms = json.loads(self.store.get(key))
        if digest != self._digest or len(norms) != len(self._names or ()):
            return None  # another model (a rank that watches something else): not comparable
        return [float(x) for x in norms]

    def _report(self, active: Any, step: int, mine: list[float], reference: list[float]) -> None:
        session = self.session
        found = drifted(active.rule, self._names or [], mine, reference, self.rank)
        for name, finding in found[:MAX_HITS_PER_CHECK]:
            message = finding.advised
            if len(found) > MAX_HITS_PER_CHECK and name == found[0][0]:
                message += f" ({len(found)} parameters differ.)"
            owner = session.weights.by_name.get(name)
            hit = Hit(
                rule=active.rule.name,
                tensor=name,
                module=owner.owner if owner else name.rpartition(".")[0],
                kind="param",
                step=step,
                phase="optimizer",
                origin=True,
                value=float(finding.value),
                threshold=finding.threshold,
                message=message,
            )
            session._add_hit(hit, active)
