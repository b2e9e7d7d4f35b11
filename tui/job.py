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
        here = int(self.info.get("rank", 0))
        others = [int(s.rank) for s in self._job() if int(s.rank) != here]
        if not others:
            self.notify(self._why_one_rank(), title="Ranks", markup=False)
            return
        self._switch_to_rank(next((r for r in others if r > here), others[0]))

    def action_ranks(self) -> None:
        """The job's ranks side by side (F9)."""
        self._open_ranks()

    def action_one_rank(self) -> None:
        """R or F9 on a training of one rank: they have nothing to show, and say why."""
        self.notify(self._why_one_rank(), title="Ranks", markup=False)

    def said_rank_shown(self, before: dict[str, Any]) -> None:
        """The session reached is another rank of the job shown ``before`` (R, or Enter in
        F9): the body changed with no other sign, so a notification says whose it is now."""
        info = self.info
        if before.get("run_id") == info["run_id"] and before.get("rank") != info["rank"]:
            self.notify(f"Now inspecting rank {info['rank']} of {info.get('world_size', '?')} "
                        f"(it was rank {before.get('rank')}).", title="Ranks",
                        markup=False)  # fmt: skip

    def _job(self) -> list[Any]:
        if self._connect is None or "run_id" not in self.info:
            return []  # a client handed in: no other rank to reach
        return job_sessions(self.info["run_id"])

    def _switch_to_rank(self, rank: int) -> None:
        path = next((str(s.path) for s in self._job() if int(s.rank) == rank), None)
        if rank == self.info.get("rank"):
            return
        if path is None:  # it ended since it was listed
            self.notify(f"Rank {rank}'s session has ended with the training: it cannot be "
                        "inspected.", title="Ranks", markup=False)  # fmt: skip
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
            return ("This training runs on one rank: R and F9 show the ranks of a job of "
                    "several (torchrun).")  # fmt: skip
        if self.state == "replay":
            return (f"A replay shows one rank of the {world}: open another with tensordbg "
                    "replay DIR --rank N.")  # fmt: skip
        if self._connect is None and self.state not in OVER:
            return f"The job's other ranks cannot be reached from this UI (of {world})."
        running = [int(s.rank) for s in self._job()]
        if not running:
            return (f"The job has ended: the sessions of its {world} ranks closed with it, and "
                    "R and F9 read a rank only while its session is open. What this UI read "
                    f"of rank {self.info.get('rank')} stays on screen.")  # fmt: skip
        if running == [self.info.get("rank")]:
            return (f"Only this rank of the job's {world} still runs: the others' sessions "
                    "have ended.")  # fmt: skip
        return f"Only rank {running[0]} of the job's {world} ranks still runs: R inspects it."
