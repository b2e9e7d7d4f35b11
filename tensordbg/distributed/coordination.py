"""Pausing and stopping every rank of a job together, through the store its launcher provides.

The design, in short (the README's "Several ranks" says the same for users):

- **Where a rank stops.** A rank never pauses where a hit is found under several ranks: with
  ``DistributedDataParallel`` (or FSDP) the other ranks would wait for it inside the backward
  pass's all-reduce until the process group's timeout. It pauses at its *safe point*: the
  optimizer's step pre-hook, where the step's gradient collectives are complete and the next
  ones have not started (without a watched optimizer: the start of a root forward).
- **Which step.** A pause request names a target step: the step being run when it was made
  before that step's backward, else the next one. Every step's backward all-reduce involves
  every rank, so a request made before the requester's backward of step ``T`` is in the store
  before any rank can finish that backward and reach its safe point of step ``T``: every rank
  sees it there, and all stop at the same step, none inside a collective. (A rank already past
  the target, possible only when the ranks do not synchronise each step, stops at once.)
- **The store.** Requests are one small JSON value under ``tensordbg/<run id>/`` in the
  ``torch.distributed`` store of the job (``MASTER_ADDR``/``MASTER_PORT``, which ``torchrun``
  serves; else the default process group's store). Each safe point reads it once (one round
  trip, about 0.1 ms); nothing goes through the training's own process group.
- **Continue.** A rank that is resumed (``c`` in its UI, its UI going away, a detach) writes the
  pause it leaves; a small thread of each paused rank reads that and resumes it.
- **Raise.** ``on_hit="raise"``: the hitting rank writes an abort before raising
  :class:`~tensordbg.hit.WatchpointHit`; every other rank prints one line naming the rank, the
  step and the rule, and exits with status 1 at its next safe point, or after
  :data:`ABORT_GRACE` seconds when it is stuck in a collective the dead rank will never join.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from tensordbg.distributed.identity import RankIdentity
from tensordbg.hit import CARRIED_KINDS, Hit
from tensordbg.tracebacks import chain_excepthook

REQUEST, RESUMED, GENERATION = "request", "resumed", "generation"
NONE = b"{}"
POLL_SECONDS = 0.2
"""How often a rank's watcher thread reads the store (an abort; the end of a pause)."""
ABORT_GRACE = 10.0
"""Seconds a rank told to stop (another rank raised) waits to reach a safe point before it
exits anyway (it is stuck in a collective that will not complete)."""
STORE_TIMEOUT = timedelta(seconds=30)
CLOSE_WAIT = 2.0
"""Seconds a detach waits for the watcher thread to leave the store call it is in (a round
trip, a fraction of a millisecond, while the store is there)."""


@dataclass(frozen=True, slots=True)
class Request:
    """A pause or an abort asked by one rank, as the store holds it."""

    gen: int
    kind: str  # "pause" or "abort"
    rank: int
    step: int
    target: int
    reason: str
    rule: str = ""
    where: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Request | None:
        try:
            data = json.loads(raw)
            return cls(**data) if data else None
        except (ValueError, TypeError):
            return None


def launcher_store() -> Any:
    """The job's ``torch.distributed`` store, or None outside a launcher: a client of
    ``MASTER_ADDR:MASTER_PORT`` (what ``torchrun`` serves, and ``env://`` initialisation
    uses), else the default process group's store."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "0")
    if addr and port.isdigit() and int(port) > 0:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=STORE_TIMEOUT,
                             wait_for_workers=False)  # fmt: skip
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


class RankLink:
    """What a session of one rank of several does with the others (see the module docstring).
    Made by ``attach`` under a launcher; ``session.ranks`` holds it.

    >>> session.ranks.identity
    RankIdentity(run_id='af9aee17-...', rank=1, local_rank=1, world_size=2)
    """

    def __init__(self, session: Any, store: Any, identity: RankIdentity,
                 poll: float = POLL_SECONDS):  # fmt: skip
        import torch.distributed as dist

        self.session = session
        self.identity = identity
        self.rank = identity.rank
        self.store = dist.PrefixStore(f"tensordbg/{identity.run_id}/", store)
        self.store.compare_set(REQUEST, "", NONE)
        self.store.compare_set(RESUMED, "", "0")
        self._raw = self.store.get(REQUEST)
        self.request = Request.decode(self._raw)
        self.served = self.request.gen if self.request else 0
        """The newest request this rank has acted on (one made before it attached is old)."""
        self.closed = False
        self._closed_during: BaseException | None = None  # the error on its way up at close
        self._pending: tuple[str, Hit | None] | None = None  # this rank's own request
        self._passed = -1  # the last step whose safe point this rank passed
        self._at_safe_point = False
        self._paused_gen = 0
        self._said_abort = False
        self._published = -1  # the last step this rank published an origin for
        self._origins: tuple[int, dict[str, Any] | None] = (-1, None)  # (step, other's origin)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(poll,), daemon=True,
                                         name=f"tensordbg-ranks-{self.rank}")  # fmt: skip
        self._watcher.start()
        session.handles.callback(self.close, "the link to the other ranks")
        undo = chain_excepthook(self._stopped_by_another_rank)
        session.handles.callback(undo, "the excepthook of a job another rank stopped")

    # --- the training thread -------------------------------------------------------------

    def defer(self, reason: str, hit: Hit | None) -> bool:
        """The session is about to block: under several ranks, away from a safe point, it asks
        every rank to pause at the target step instead (True: do not block here)."""
        if self._at_safe_point or self.closed:
            return False
        self.session.controller.pause_requested = False
        if self._pending is not None:
            if hit is not None and self._pending[1] is None:
                self._pending = (reason, hit)
            return True
        self._pending = (reason, hit)
        with self._store_errors():
            request = self._new_request("pause", reason, hit)
            current = self._read()
            if current is not None and current.gen > self.served:
                return True  # another rank's pause is pending: this rank stops with it
            self.store.compare_set(REQUEST, self._raw, request.encode())
        return True

    def abort(self, hit: Hit) -> None:
        """This rank raises :class:`WatchpointHit`: the other ranks stop too."""
        if self.closed:
            return
        with self._store_errors():
            self.store.set(REQUEST, self._new_request("abort", hit.message, hit).encode())
            self.served = 1 << 62  # nothing more for this rank to act on

    def safe_point(self) -> None:
        """Where this rank may stop: pause when a request's target step is reached, exit when
        another rank aborted. One read of the store."""
        if self.closed:
            return
        step = self.session.step
        self._passed = step
        request = None
        with self._store_errors():
            request = self._read()
        if request is None or request.gen <= self.served:
            return
        if request.kind == "abort":
            self._exit(request)
        if step < request.target:
            return
        self.served = request.gen
        pending, self._pending = self._pending, None
        if pending is not None:
            reason, hit = pending
        else:
            reason, hit = f"rank {request.rank} paused the job: {request.reason}", None
        self._paused_gen = request.gen
        self._at_safe_point = True
        try:
            self.session._block(f"{reason} (every rank pauses at step {step})", hit)
        finally:
            self._at_safe_point = False
            self._paused_gen = 0
        with self._store_errors():
            self._resume_all(request.gen)

    def attribute(self, hit: Hit) -> None:
        """Publish an origin hit of this rank's own forward or backward for its step (called as
        each hit is logged), so that the ranks whose gradients go bad through the all-reduce can
        name it (:meth:`carried`). (Best effort: a backward origin judged only at the end of the
        other rank's backward may be published too late to be seen.)"""
        if self.closed or not hit.origin or hit.kind in CARRIED_KINDS:
            return
        if self._published != hit.step:
            self._published = hit.step
            mine = json.dumps({"rank": self.rank, "rule": hit.rule, "tensor": hit.tensor})
            with self._store_errors():
                self.store.compare_set(f"origin/{hit.step}", "", mine)

    def carried(self, step: int) -> str | None:
        """Where a gradient, parameter or update of this rank that went bad at ``step`` came
        from, when another rank published an origin there: the sentence that says so (the hit
        is then passed on, not made here), else None."""
        if self.closed:
            return None
        key = f"origin/{step}"
        if self._origins[0] != step:
            with self._store_errors():
                found = self.store.check([key])
                self._origins = (step, json.loads(self.store.get(key)) if found else None)
        other = self._origins[1]
        if not other or other["rank"] == self.rank:
            return None
        return (f"It came from rank {other['rank']} ({other['rule']} at {other['tensor']}): the "
                "gradient all-reduce carried it to every rank.")  # fmt: skip

    @property
    def at_safe_point(self) -> bool:
        """Whether this rank is paused at its safe point (the optimizer's step pre-hook)."""
        return self._at_safe_point

    def close(self) -> None:
        """Detached: stop watching the store (a pause this rank was in is left to the others)."""
        if self.closed:
            return
        self.closed = True
        self._closed_during = sys.exc_info()[1]  # an error on its way up keeps the excepthook
        self._stop.set()
        if threading.current_thread() is not self._watcher:
            # A daemon thread still inside a store call when the interpreter exits is stopped
            # in the middle of C++ code, which aborts the whole process ("terminate called
            # without an active exception"): the rank's job fails after its training ended.
            self._watcher.join(CLOSE_WAIT)

    # --- internals -------------------------------------------------------------------------

    def _new_request(self, kind: str, reason: str, hit: Hit | None) -> Request:
        session = self.session
        step = session.step
        after_backward = session.phase == "backward" or self._passed == step
        gen = int(self.store.add(GENERATION, 1))
        where = f"{hit.tensor}" if hit is not None else ""
        return Request(gen, kind, self.rank, step, step + 1 if after_backward else step,
                       reason, hit.rule if hit else "", where)  # fmt: skip

    def _read(self) -> Request | None:
        raw = self.store.get(REQUEST)
        if raw != self._raw:
            self._raw, self.request = raw, Request.decode(raw)
        return self.request

    def _resume_all(self, gen: int) -> None:
        done = int(self.store.get(RESUMED) or b"0")
        if done < gen:
            self.store.compare_set(RESUMED, str(done), str(gen))

    def _exit(self, request: Request) -> None:
        self._say_abort(request)
        self.close()
        raise SystemExit(1)

    def _stopped_by_another_rank(self, error: BaseException) -> bool:
        """The excepthook's part (see ``__init__``): when another rank raised, this rank's
        collective fails as that rank's process goes (gloo: "Connection closed by peer"), often
        before this rank reaches a safe point: that error ends the rank with the one line and
        status 1, not a traceback."""
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            return False
        if self.closed and not _caused_by(error, self._closed_during):
            return False  # the hook stayed for an error that was caught later: not this one
        request = None
        with contextlib.suppress(Exception):
            request = Request.decode(self.store.get(REQUEST))
        if request is None or request.kind != "abort" or request.rank == self.rank:
            return False
        self._say_abort(request)
        print(f"  ({type(error).__name__} in rank {self.rank} after that, from a collective "
              f"rank {request.rank} left: not shown)", file=sys.stderr, flush=True)  # fmt: skip
        return True

    def _say_abort(self, request: Request) -> None:
        with self._lock:
            if self._said_abort:
                return
            self._said_abort = True
        where = f" in {request.where}" if request.where else ""
        print(f"tensordbg: rank {request.rank} stopped the job: {request.rule or 'a hit'} at "
              f"step {request.step}{where}; rank {self.rank} stops too (on_hit='raise')",
              file=sys.stderr, flush=True)  # fmt: skip

    def _watch(self, poll: float) -> None:
        """The watcher thread: ends a pause the other ranks left, and a rank stuck in a
        collective after another rank raised."""
        import torch.distributed as dist

        store = self.store
        while not self._stop.wait(poll):
            try:
                request = Request.decode(store.get(REQUEST))
                if (request and request.kind == "abort" and request.rank != self.rank
                        and request.gen > self.served):  # fmt: skip
                    self._say_abort(request)
                    self.session.controller.resume()  # a paused rank goes to its exit
                    if not self._stop.wait(ABORT_GRACE):
                        os._exit(1)  # stuck in a collective the dead rank never joins
                    return
                gen = self._paused_gen
                if gen and int(store.get(RESUMED) or b"0") >= gen:
                    self.session.controller.resume()
            except (RuntimeError, ValueError, dist.DistStoreError) as e:
                if not self.closed:
                    self._give_up(e)
                return

    @contextlib.contextmanager
    def _store_errors(self) -> Any:
        try:
            yield
        except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
            self._give_up(e)

    def _give_up(self, error: BaseException) -> None:
        if self.closed:
            return
        self.close()
        warnings.warn(
            f"tensordbg: rank {self.rank} lost the job's store ({error}); it no longer pauses "
            "or stops together with the other ranks (its hits are still recorded)",
            RuntimeWarning,
            stacklevel=2,
        )


def _caused_by(error: BaseException | None, cause: BaseException | None) -> bool:
    """Whether ``cause`` is ``error`` or in the chain of errors that led to it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if error is cause:
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False
