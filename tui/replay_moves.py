"""n and p in a recorded run: each press moves one dumped step, however fast they come. A mixin
of :class:`~tensordbg.tui.app.TensorDbgApp`."""

from __future__ import annotations

from typing import Any

from tensordbg.tui.errors import work
from tensordbg.tui.remote import RequestFailed


class ReplayMoves:
    """Needs the app's ``remote``, ``main`` and ``notify``. Presses that come while a move is
    asked for add up, and the next request moves by all of them (a new request cancelling the
    one under way dropped presses: n n n moved one step, not three)."""

    remote: Any
    main: Any
    notify: Any
    _moves = 0  # presses not asked for yet
    _moving = False

    def action_replay_step(self, move: int) -> None:
        self._moves += move
        if not self._moving:
            self._moving = True
            self._replay_moves()

    @work(group="replay-moves")
    async def _replay_moves(self) -> None:
        try:
            while self._moves:
                move, self._moves = self._moves, 0
                try:
                    info = await self.remote.goto(move=move)
                except RequestFailed:
                    self._moves = 0
                    return  # the Log tab says why
                where = info.get("replay") or {}
                if where.get("index") == (where.get("steps", 0) - 1 if move > 0 else 0):
                    end = "last" if move > 0 else "first"  # the key may have done nothing
                    self.notify(f"Step {info['step']} is the {end} dumped step.", title="Replay")
                self.main.show_replay_step(info)
        finally:
            self._moving = False
