"""Which job and which rank a process is, read from its launcher's environment.

``torchrun`` (and ``torch.multiprocessing`` scripts that follow its conventions) set ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_RUN_ID``.
Every rank of one job derives the same run id from them, so ``tensordbg tui`` can show the job
as one entry with its ranks.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """One process of a job.

    >>> RankIdentity.from_environment({"RANK": "1", "WORLD_SIZE": "2",
    ...                                "TORCHELASTIC_RUN_ID": "job7"})
    RankIdentity(run_id='job7', rank=1, local_rank=1, world_size=2)
    """

    run_id: str | None
    """The job's id shared by all its ranks; None for a single process without a launcher."""
    rank: int
    local_rank: int
    world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def with_run_id(self, run_id: str) -> RankIdentity:
        return RankIdentity(run_id, self.rank, self.local_rank, self.world_size)

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> RankIdentity:
        """From the launcher's variables; where it set none (Lightning's own DDP launcher sets
        no ``RANK``), from the process group the job started, when there is one: else every
        rank called itself rank 0 of one."""
        env = os.environ if env is None else env
        rank, world = _int(env.get("RANK"), -1), _int(env.get("WORLD_SIZE"), 0)
        group = _process_group() if rank < 0 or world < 1 else None
        if group is not None:
            rank, world = (group[0] if rank < 0 else rank), (group[1] if world < 1 else world)
        rank, world = max(rank, 0), max(world, 1)
        local = _int(env.get("LOCAL_RANK"), rank)
        return cls(job_run_id(env, world), rank, local, world)


def _process_group() -> tuple[int, int] | None:
    """This process's rank and the world size of the default process group, if one is up."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # a torch without it, a group torn down: as if none
        return None
    return None


def job_run_id(env: Mapping[str, str], world: int | None = None) -> str | None:
    """The run id every rank of a job agrees on: ``TENSORDBG_RUN_ID`` when set, else torchrun's
    ``TORCHELASTIC_RUN_ID`` (``torchrun --rdzv-id``; ``--standalone`` makes a fresh one), else one
    derived from the rendezvous address the ranks share. None outside a launcher."""
    explicit = env.get("TENSORDBG_RUN_ID")
    if explicit:
        return explicit
    elastic = env.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return _UNSAFE.sub("_", elastic)[:64]
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port and (world if world is not None else _int(env.get("WORLD_SIZE"), 1)) > 1:
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        digest = hashlib.sha256(f"{addr}:{port}:{restart}".encode()).hexdigest()[:8]
        return f"job{digest}"
    return None


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
