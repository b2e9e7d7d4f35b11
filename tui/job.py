"""The ranks of a job, from the main UI: ``R`` inspects the next rank, ``F9`` shows them side by
side (:mod:`tensordbg.tui.screens.ranks`). A mixin of :class:`~tensordbg.tui.app.TensorDbgApp`."""

from __future__ import annotations

import contextlib
from typing import Any

from tensordbg.tui.errors import work
from tensordbg.tui.remote import OVER
from tensordbg.tui.screens.ranks import RanksScreen, job_sessions


class JobRanks:
    """Needs the app's ``info``, ``state``, ``main``, ``notify``, ``push_screen`` and its
    connection (``_connect``, ``_switch_path``, ``_lost_reason``, ``_lost``)."""

    info: dict[str, Any]
    state: Any
    _connect: Any

    def action_next_rank(self) -> None:
        """Inspect the next rank of this job (R)."""
        ranks = [int(s.rank) for s in self._job()]
        if len(ranks) < 2:
            self.notify(self._why_one_rank(), title="Ranks", markup=False)
            return
        here = int(self.info.get("rank", 0))
        self._switch_to_rank(next((r for r in ranks if r > here), ranks[0]))

    def action_ranks(self) -> None:
        """The job's ranks side by side (F9)."""
        self._open_ranks()

    def _job(self) -> list[Any]:
        if self._connect is None or "run_id" not in self.info:
            return []  # a client handed in: no other rank to reach
        return job_sessions(self.info["run_id"])

    def _switch_to_rank(self, rank: int) -> None:
        path = next((str(s.path) for s in self._job() if int(s.rank) == rank), None)
        if path is None or rank == self.info.get("rank"):
            return
        self.main.log_entry(f"inspecting rank {rank}")
        self._switch_path = path
        self._lost_reason = f"switching to rank {rank}"
        self._lost.set()

    @work(group="ranks", exclusive=True)
    async def _open_ranks(self) -> None:
        from tensordbg.transport.client import Client

        job = self._job()
        if len(job) < 2:
            self.notify(self._why_one_rank(), title="Ranks", markup=False)
            return
        clients = {int(s.rank): await Client.connect(str(s.path), timeout=5.0) for s in job}

        async def closed(rank: int | None) -> None:
            for client in clients.values():
                with contextlib.suppress(Exception):
                    await client.close()
            if rank is not None:
                self._switch_to_rank(rank)

        screen = RanksScreen(self.info["run_id"], clients, int(self.info.get("rank", 0)))
        self.push_screen(screen, closed)

    def _why_one_rank(self) -> str:
        """Why R and F9 have no other rank to show."""
        world = int(self.info.get("world_size", 1))
        if world < 2:
            return "This training runs on one rank."
        if self.state == "replay":
            return (f"A replay shows one rank of the {world}: open another with tensordbg "
                    "replay DIR --rank N.")  # fmt: skip
        if self._connect is None and self.state not in OVER:
            return f"The job's other ranks cannot be reached from this UI (of {world})."
        if self.state in OVER or not self._job():
            return (f"The job's other ranks are gone (its {world} ranks' sessions ended with "
                    "the training): only this one's record is here.")  # fmt: skip
        return f"The job's other ranks cannot be reached from this UI (of {world})."
