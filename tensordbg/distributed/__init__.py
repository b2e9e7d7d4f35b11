"""Several ranks of one job (``torchrun``, ``torch.multiprocessing``; DDP, FSDP2).

``tensordbg.attach`` uses this package when the launcher's environment says the job has
several ranks: :class:`RankIdentity` names the job and the rank, :func:`unwrap` watches the
model inside ``DistributedDataParallel``, :class:`RankLink` pauses and stops every rank
together through the job's store, and :class:`Fingerprints` feeds the ``RankDivergence`` rule.
Nothing here runs a collective on the training's process group.
"""

from __future__ import annotations

from tensordbg.distributed.coordination import RankLink, Request, launcher_store
from tensordbg.distributed.identity import RankIdentity, job_run_id
from tensordbg.distributed.models import is_dtensor, local_shard, unwrap

__all__ = [
    "RankIdentity",
    "RankLink",
    "Request",
    "is_dtensor",
    "job_run_id",
    "launcher_store",
    "local_shard",
    "unwrap",
]
