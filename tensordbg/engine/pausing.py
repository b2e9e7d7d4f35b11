"""Pausing: where a hit, a request or a finished step stops the training, and what it does
instead where it cannot stop (a forked worker; ``on_hit="skip"``, ``"raise"`` or a callable).
Part of :class:`~tensordbg.engine.session.Session` (see :mod:`.pipeline`)."""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

from tensordbg.engine import origin
from tensordbg.engine.control import DETACHED, STEP
from tensordbg.engine.phases import records_of
from tensordbg.engine.records import CHECKS
from tensordbg.hit import Hit, WatchpointHit

FORKED_SAID = 20  # hits a forked process prints at most


class Pausing:
    """The pausing part of a session's pipeline."""

    def _pause_if_needed(self) -> None:
        if not self._pausing:
            return
        pausing, self._pausing = self._pausing, []
        self.record_clean_gradients(events=False)  # what the halt and the pause list
        first = next((h for h in pausing if h.origin), pausing[0])
        if self.on_hit in ("raise", "pause") and self.bus.wants("halt"):
            self.bus.publish("halt", {"step": self.step, "phase": self.phase,
                                      "records": list(self.phases.records)})  # fmt: skip
        if callable(self.on_hit):
            for hit in pausing:
                try:
                    self.on_hit(hit)
                except Exception as e:  # the user's code: raised in the user's, not ours
                    e._from_on_hit = True  # type: ignore[attr-defined]
                    raise
        elif self.on_hit == "raise":
            if self.ranks is not None:
                self.ranks.abort(first)  # the other ranks stop too, instead of hanging
            raise WatchpointHit(first)
        elif self.on_hit == "skip":
            self._skip_automatically(first)
        elif self.on_hit == "pause":
            if self.forked():
                return  # recorded; a forked worker cannot be driven from the UI (said once)
            self._block(f"{first.rule} hit: {first.message}", first)

    def _boundary(self, completed_step: bool = False) -> None:
        """A place where the training can stop: apply the changes other threads asked for,
        and pause if asked to (or when the steps to run are done)."""
        if self.control.pending:
            self.control.apply()
        if completed_step and self.ranks is not None and not self.optimizers:
            self.ranks.safe_point()  # no optimizer watched: a step ends at a root forward
        control = self.controller
        if not (control.pause_requested or (completed_step and control.mode == STEP)):
            return
        reason = control.wants_pause(completed_step)
        if reason:
            self._block(reason, None)

    stopped_at: tuple[int, str] | None = None
    """The step and phase of a pause an exception (Ctrl-C) ended."""

    def _block(self, reason: str, hit: Hit | None) -> None:
        if self._detach_requested() or self.forked():
            return
        if self.ranks is not None and self.ranks.defer(reason, hit):
            return  # every rank pauses together at its next safe point (distributed/)
        _print_pause(self, reason, hit)
        self.materialize_forward()  # what a person may look at while it is paused
        self.record_clean_gradients(events=False)
        self.publish()
        self.bus.publish("pause", {"state": "paused", "step": self.step, "reason": reason})
        started = time.perf_counter()
        try:
            self.controller.block(reason, hit)
        except BaseException:  # Ctrl-C while paused: where it stood, for the last word
            self.stopped_at = (self.step, self.where)  # (the ranks' safe point ends after)
            raise
        finally:
            self.metrics.paused += time.perf_counter() - started  # not the step's own time
        if not self._detach_requested():
            self.bus.publish("resume", {"state": "running", "step": self.step})

    def _detach_requested(self) -> bool:
        """The UI asked to detach (from its thread): finish it here, on the training thread."""
        if self.controller.state == DETACHED and not self.detached:
            # The terminal's last word was maybe "training paused": say that it is not.
            print(f"tensordbg: detached ({self.at}): the training goes on unwatched",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.detach()
        return self.detached

    def _skip_automatically(self, hit: Hit) -> None:
        """``on_hit="skip"``: a hit before the update skips that update; past
        ``max_skipped_steps`` in a row the training cannot recover this way, and the hit is
        raised. A hit after the update (a parameter) can only be recorded, and so can one of
        a forward without gradients (an evaluation under ``no_grad``): no update comes of it."""
        if (self.phase == "optimizer" or self.phase in CHECKS) and not self._stepping:
            return
        if self.evaluating():
            return
        if self._skips_in_row >= self.amp.max_skipped_steps:
            # Raised with the origin of what it kept skipping (a weight set to Inf at the first
            # skipped step stays so: the later steps' hits are passed on), as a raise names it.
            hit = next((h for h in reversed(self.hits) if h.origin and h.step <= hit.step), hit)
            if self.ranks is not None:
                self.ranks.abort(hit)
            raise WatchpointHit(
                hit,
                f"{hit.message} tensordbg skipped {self._skips_in_row} updates in a row "
                "(max_skipped_steps) and stops skipping.",
            )
        if not self._skip_requested:
            self._skip()

    def skip_step(self) -> int:
        """Skip this step's update, as a GradScaler skips an overflowing one: at the next
        ``optimizer.step()`` the gradients are dropped, so the parameters and the optimizer's
        state stay bitwise as they are. Call it while the training is paused on a hit before the
        update (from the UI: ``k``); from another thread it is made by the training thread.
        Returns the step that will be skipped.

        >>> session.skip_step()   # paused on an exploding gradient: that update never lands
        """
        return self.control.submit(self._skip).result()

    def evaluating(self) -> bool:
        """Whether the training is in a forward without gradients (an evaluation under
        ``no_grad``): no update comes of it, and the next one is a later step's."""
        return self.phase == "forward" and not self.capture.with_grad

    def _skip(self) -> int:
        if self.evaluating():
            # k at a validation batch's NaN dropped the next step's clean update, where
            # on_hit="skip" drops none (found trying the UI as a new user).
            raise ValueError(
                "this is a forward without gradients (an evaluation under no_grad): no update "
                "comes of it, so there is none to skip; a skip drops an update from a pause in "
                "the training's forward or backward phase"
            )
        if self.update_made():
            raise ValueError(
                f"step {self.step}'s update is made already (this hit was found after "
                "it): a skip drops an update from a pause before it, on a hit in the "
                "forward or backward phase, or between steps for the next one"
            )
        self._skip_requested = True
        self.log(f"step {self.step}: its update will be skipped (asked for)", "warning")
        return self.step

    def recheck(self) -> list[Hit]:
        """Judge the current phase again with the rules as they are now (edited thresholds,
        added rules), without re-running the step; like MindInsight's recheck. Rules judge with
        a copy of their memory, so a recheck does not count as another step. Returns the hits
        that were not found before (they join ``session.hits``).

        The origin of a condition is taken from the first judgement of the phase; a rule added
        since is an origin wherever it fires (its propagation is not traced again)."""
        self.rules_changed()
        already = {(h.ref, h.rule) for h in self.hits}
        origins = {h.ref for h in self.hits if h.origin}
        found: list[Hit] = []
        unjudged, why = 0, ""
        later = records_of(self.undrained)
        for record in self.records:
            stats = record.stats
            applicable = self.ruleset.applicable(stats)
            record.rule_ids = applicable.rule_ids
            if id(record) in later:
                # Judged after this pause, in execution order, with the rules as they are now
                # (its origin traced then): judging it here too made each of its hits twice.
                record.checks = applicable.checks
                continue
            missing = tuple(s for s in applicable.wanted if s not in stats.values)
            tensor = record.held()
            if missing and tensor is not None and stats.kind != "update":
                stats.values.update(zip(missing, self.measure(stats, tensor, missing),
                                        strict=True))  # fmt: skip
            elif missing:  # its rules judge it without what they want: not "no new hit"
                unjudged += 1
                why = why or f"{stats.name}: {self.why_not_kept(record)}"
            for rule_id, finding in self.ruleset.rejudge(record, already):
                is_origin = not stats.nonfinite or stats.ref in origins
                before = len(self.hits)
                self._hit(origin.Verdict(record, rule_id, finding, is_origin))
                found.extend(self.hits[before:])
        self._pausing = []  # already paused: what a recheck finds is shown, not paused on
        self.recheck_unjudged = (unjudged, why)
        return found

    recheck_unjudged: tuple[int, str] = (0, "")
    """How many tensors the last recheck could not judge (a statistic its rules want was never
    measured, and the tensor is not held), and why, of the first."""

    def recheck_reply(self) -> dict[str, Any]:
        """:meth:`recheck`, as a UI is answered (``contract.Recheck``)."""
        hits = [h.as_dict() for h in self.recheck()]
        unjudged, why = self.recheck_unjudged
        return {"at": self.at, "hits": hits, "unjudged": unjudged, "why": why}

    def forked(self) -> bool:
        """Whether this is a forked child of the attaching process (a DataLoader worker that
        runs the model, say): it records or raises but never pauses, and says so once."""
        if os.getpid() == self.pid:
            return False
        if self._forked_hits is None:
            self._forked_hits = 0
            print(f"tensordbg: process {os.getpid()} is a fork of the training ({self.pid}): "
                  "hits here never pause it (no UI can reach a forked worker), and the training's "
                  "session does not see them: each hit at its origin is printed here, "
                  f"{FORKED_SAID} at most", file=sys.stderr, flush=True)  # fmt: skip
        return True

    def say_forked_hit(self, hit: Hit) -> None:
        """A forked child's hit at its origin, printed: its record dies with the process (a
        DataLoader worker ends without a summary)."""
        if not hit.origin or not self.forked() or self._forked_hits > FORKED_SAID:
            return
        self._forked_hits += 1
        # No step: a worker that only runs the model ends none, so its step is the training's
        # as it was forked, and its calls of the model are numbered on (#131.input[0]).
        name = re.sub(r"^#\d+\.", "", hit.tensor)
        line = (f"tensordbg: process {os.getpid()} (a fork of the training), {hit.phase}: "
                f"[{hit.rule}] {hit.message.replace(hit.tensor, name)}")  # fmt: skip
        if self._forked_hits > FORKED_SAID:  # the 21st: it and the ones after are not printed
            line = f"tensordbg: process {os.getpid()}: more hits, not printed"
        print(line, file=sys.stderr, flush=True)


def _print_pause(session: Any, reason: str, hit: Hit | None) -> None:
    lines = [f"tensordbg: training paused ({session.at}): {reason}"]
    if session.server is not None and getattr(session.server, "clients", 0):
        lines.append("  the UI connected to it shows it; continue with c there")
    elif session.server is not None:
        lines.append(
            f"  inspect it: tensordbg tui (run {session.run_id}, rank {session.rank}); "
            "continue with c there"
        )
        if not _at_a_terminal():  # CI, nohup, < /dev/null: it would wait in silence
            lines.append("  no terminal: it waits until a UI connects; an unattended run wants "
                         "on_hit='record' or 'raise' (tensordbg run --on-hit record)")  # fmt: skip
    else:
        lines.append("  continue from another thread: session.controller.resume()")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _at_a_terminal() -> bool:
    """Whether a person may be at this training's terminal (its stdin is one)."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError, OSError):  # replaced or closed
        return False
