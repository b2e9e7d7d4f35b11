"""The hit log: each finding of a rule becomes a :class:`~tensordbg.hit.Hit` with an id, a
sentence that says where the value came from, and a place in a bounded log.

A training that stays NaN makes a hit per tensor per step; past ``max_hits`` only hits at their
origin are kept, and the log says so once.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, TextIO

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from tensordbg.engine.fused import FUSED
from tensordbg.engine.judge import ActiveRule
from tensordbg.engine.origin_notes import ORIGIN_NOTE, SET_APART, note_kind
from tensordbg.engine.records import NONFINITE, Call, Record, submodule
from tensordbg.hit import Hit, said_of
from tensordbg.rules.base import Finding
from tensordbg.statistics import L2
from tensordbg.statistics.summaries import next_nonfinite, summarize

MAX_HITS = 100_000


def print_summary(session: Any, file: TextIO | None = None) -> None:
    """Print ``session.summary()`` once. The demo, ``tensordbg run`` and the exit of a program
    that attached each print it when hits were recorded; a script run by ``tensordbg run`` that
    prints it too would show it twice."""
    if session.hitlog.summarized:
        return
    session.hitlog.summarized = True
    print(ranked_line(session, session.summary()), file=file or sys.stderr, flush=True)


def ranked_line(session: Any, text: str, ranked: bool | None = None) -> str:
    """A line ``"tensordbg: ..."`` (a summary) saying which rank said it, in a job of several
    ranks (``ranked``: whether it is one, known before a detach let go of the ranks)."""
    if ranked is None:
        ranked = getattr(session, "ranks", None) is not None
    return text.replace("tensordbg:", f"tensordbg (rank {session.rank}):", 1) if ranked else text


class HitLog:
    """Every hit of a session, in the order found.

    >>> log = HitLog(log=print)
    >>> log.add(hit, active)        # False when the cap dropped it
    """

    def __init__(self, log: Callable[[str, str], None], model: torch.nn.Module | None = None,
                 max_hits: int = MAX_HITS, watched: Any = None):  # fmt: skip
        self._model = weakref.ref(model) if model is not None else None
        self._watched = watched
        """The session's ParamWatch: its ``params`` are the watched parameters, by id (a layer
        appended after attach is not among them), read when asked (detach empties them, and
        a copy held here kept them alive); None: every one is watched."""
        self.hits: list[Hit] = []
        self.max_hits = max_hits
        self.capped = False
        self.fired_last_step: set[tuple[str, str]] = set()
        self.fired_this_step: set[tuple[str, str]] = set()
        self.streaks: dict[tuple[str, str], int] = {}
        """The step each rule began to fire on each tensor, at every step since."""
        self.first_origin: dict[int, str] = {}
        """The first tensor named the origin of each condition this step (for messages)."""
        self.first_in_root: dict[tuple[int, int], str] = {}
        """The same, by root call of the step (by ``id``, in the order they had one), or the
        parameter that passed it on there (:attr:`carried`)."""
        self.carried: set[str] = set()
        """Parameters named there that held it before the forward: an earlier step made them
        so, so the values after them were not "first produced" there."""
        self._log = log
        self.rank = 0
        """The session's rank: every hit logged carries it."""
        self.summarized = False
        """Whether the session's summary was printed (see :func:`print_summary`)."""

    def add(self, hit: Hit, active: ActiveRule | None) -> bool:
        """Log a hit; False when the cap drops it (a hit not at its origin past ``max_hits``)."""
        if len(self.hits) >= self.max_hits and not hit.origin:
            if not self.capped:
                self.capped = True
                self._log(f"{self.max_hits} hits recorded: hits not at their origin are no "
                          "longer kept (raise max_hits to keep more)", "warning")  # fmt: skip
            return False
        hit.id = len(self.hits)
        hit.rank = self.rank
        self.hits.append(hit)
        if active is not None:
            active.hits += 1
        key = (hit.rule, hit.tensor)
        if key not in self.fired_last_step and key not in self.fired_this_step:
            self.streaks[key] = hit.step
        self.fired_this_step.add(key)
        return True

    def repeated(self, hit: Hit) -> bool:
        """Whether the same rule fired on the same tensor in the step before."""
        return (hit.rule, hit.tensor) in self.fired_last_step

    def streak(self, hit: Hit) -> int | None:
        """The step the same rule began to fire on the same tensor, at every step since, when
        it fired in the step before; else None."""
        return self.streaks.get((hit.rule, hit.tensor)) if self.repeated(hit) else None

    def changed_before_step(self, step: int, records: dict[int, Record],
                            params: dict[str, Any]) -> None:  # fmt: skip
        """Before the step's first update: a parameter gradient a hit of this step was found on
        that the script changed since (``clip_grad_norm_``) says so, with both norms
        (ExplodingGradient advised clipping to a script that clips, as if unseen)."""
        for hit in reversed(self.hits):
            if hit.step != step:
                return
            record = records.get(hit.ref) if hit.kind == "grad" and hit.origin else None
            p = params.get(hit.tensor.removesuffix(".grad")) if record is not None else None
            before = record.stats.values.get(L2) if record is not None else None
            grad = p.param.grad if p is not None else None
            if before is None or grad is None or grad.is_sparse or not math.isfinite(before):
                continue
            now = float(torch.linalg.vector_norm(grad.detach(), dtype=torch.float64))
            if abs(now - before) > 1e-3 * before:
                hit.message += (
                    f" The script then changed it before the update: its norm "
                    f"{before:.3g} became {now:.3g} (as clip_grad_norm_ does)."
                )

    def end_step(self) -> None:
        self.streaks = {k: v for k, v in self.streaks.items() if k in self.fired_this_step}
        self.fired_last_step, self.fired_this_step = self.fired_this_step, set()
        self.first_origin, self.first_in_root, self.carried = {}, {}, set()

    def summary(self, skipped_steps: list[int], origins: int = 5) -> str:
        """The hits in a few lines: those at their origin first, else the first hit (another
        rank's NaN that the all-reduce brought says where it came from)."""
        if not self.hits:
            return "tensordbg: no hits."
        first = [h for h in self.hits if h.origin]
        total = len(self.hits)
        where = (
            f"{len(first)} at their origin"
            if total != 1
            else f"{'' if first else 'not '}at its origin"
        )
        lines = [f"tensordbg: {total} hit{'s' * (total != 1)}, {where}."]
        for hit in first[:origins] or self.hits[:1]:
            lines.append(f"  step {hit.step} {hit.phase}: [{hit.rule}] {hit.tensor}")
            lines.append(f"    {hit.message}")
        if len(first) > origins:
            by_rule: dict[str, int] = {}
            for hit in first[origins:]:
                by_rule[hit.rule] = by_rule.get(hit.rule, 0) + 1
            rules = ", ".join(f"{n} {rule}" for rule, n in by_rule.items())
            lines.append(f"  ... and {len(first) - origins} more at their origin ({rules})")
        if skipped_steps:
            lines.append(f"  steps the GradScaler skipped: {skipped_steps[:20]}")
        return "\n".join(lines)

    def make(
        self,
        record: Record,
        active: ActiveRule,
        finding: Finding,
        is_origin: bool,
        condition: int | None,
        module: Call | None = None,
        kind: str | None = None,
        name: str | None = None,
        by_gradient: bool = False,
        unseen: str = "",
        bad_since: int | None = None,
    ) -> Hit:
        """The hit of one finding on one record; ``module``/``kind``/``name`` name another place
        when the value is reported where it was made (a parent's own code, a consumer's
        backward)."""
        stats = record.stats
        tensor = record.held()
        if is_origin and stats.summary is None and tensor is not None:
            stats.summary = summarize(tensor)  # for the UI; downstream hits skip it
        if is_origin and condition == NONFINITE and tensor is not None:
            finding = replace(finding, message=finding.message + _first_bad(tensor, stats))
        kind = kind or stats.kind
        path = module.path if module is not None else stats.module
        # The gradient of a value reported at the call whose own code used it (origin.py).
        own_code = kind == "grad_output" and module is not None and record.grad_of is not None \
            and module is not record.grad_of.producer  # fmt: skip
        if name:  # named where it was made: the sentence says the same
            finding = replace(finding, message=said_of(finding.message, stats.name, name))
        # Where it was first produced: in the same root call when one there was (an
        # evaluation between steps does not feed the training forward after it).
        root = _root_call(module or record.producer) if stats.phase == "forward" else None
        first = self.first_origin.get(condition, "")
        first = self.first_in_root.get((id(root), condition), first) if root else first
        if kind == "observed":  # a loss: of the latest root call that had one, if any did
            first = next((v for (_, c), v in reversed(self.first_in_root.items())
                          if c == condition), first)  # fmt: skip
        bad_params = (self.bad_params(path) if not is_origin and kind == "output"
                      and path is not None else ())  # fmt: skip
        maker = module or record.producer  # an output beside the origin, of the same call
        sibling = bool(not is_origin and kind == "output" and first and maker is not None
                       and any(r.stats.name == first for _, r in maker.outputs))  # fmt: skip
        hit = Hit(
            rule=active.rule.name,
            tensor=name or stats.name,
            module=path,
            kind=kind,
            step=stats.step,
            phase=stats.phase,
            origin=is_origin,
            value=float(finding.value),
            threshold=None if finding.threshold is None else float(finding.threshold),
            message=with_origin(
                finding,
                is_origin,
                condition,
                "grad_code" if own_code else note_kind(kind, name or stats.name, path, record),
                path,
                first,
                self.bad_buffers(path) if is_origin and kind == "output" and path else (),
                by_gradient,
                bad_params,
                unseen,
                bad_since,
                self.unwatched_bad(path) if is_origin and kind == "output" else (),
                sibling,
                self.stepped_apart() if is_origin and kind == "observed" else (0, ()),
                carried=first in self.carried,
            ),
            ref=stats.ref,
            call=module.index if module is not None else stats.call,
            summary=_summary(record),
            stored_as=stats.name if name and name != stats.name else "",
        )
        if is_origin and condition is not None:
            self.first_origin.setdefault(condition, hit.tensor)
        if root is not None and condition is not None and (is_origin or bad_params):
            self.first_in_root.setdefault((id(root), condition),
                                          hit.tensor if is_origin else bad_params[0])  # fmt: skip
            if not is_origin and self.first_in_root[id(root), condition] == bad_params[0]:
                self.carried.add(bad_params[0])
        return hit

    def bad_buffers(self, path: str | None = None) -> list[str]:
        """The floating-point buffers holding a NaN or Inf: the module's own at ``path``, or
        every one of the model's. A forward writes them (BatchNorm's running statistics), so
        a bad batch leaves them so though its update is skipped, and a later clean batch
        turns bad in that module with its inputs and parameters clean."""
        module = self._module(path)
        if module is None:
            return []
        if path is not None and isinstance(module, _BatchNorm) and module.training:
            return []  # it normalizes with the batch's statistics: its buffers fed nothing
        found = (module.named_buffers(prefix=path, recurse=False)
                 if path is not None else module.named_buffers())  # fmt: skip
        return _not_finite(found)

    def bad_params(self, path: str) -> list[str]:
        """The module's own parameters holding a NaN or Inf (an earlier update, or a hand,
        wrote them): the value its output passes on though its inputs were clean."""
        module = self._module(path)
        if module is None:
            return []
        # A fused layer's kernel used its submodules' parameters (fused.py).
        recurse = isinstance(module, FUSED)
        watched = self._watched.params if self._watched is not None else {}
        # A tied weight by the name it is watched (and opened) under: its first module's.
        return _not_finite(
            (getattr(watched.get(id(p)), "name", n), p)
            for n, p in module.named_parameters(prefix=path, recurse=recurse)
        )

    def unwatched_bad(self, path: str | None) -> list[str]:
        """The parameters of the module at ``path``, its submodules' included, that are not
        watched (added after attach) and hold a NaN or Inf: what its output may come of."""
        module = self._module(path) if path is not None and self._watched is not None else None
        if module is None:
            return []
        return _not_finite((n, p) for n, p in module.named_parameters(prefix=path)
                           if id(p) not in self._watched.params)  # fmt: skip

    def stepped_apart(self) -> tuple[int, list[str]]:
        """The parameters the watched optimizers step that are not watched (a decoder beside
        the watched encoder, trained by the same optimizer): how many, and the shapes of those
        that hold a NaN or Inf."""
        if self._watched is None:
            return 0, []
        watched = self._watched.params
        apart = {id(p): p for groups in list(self._watched.groups.values()) for group in groups
                 for p in group["params"] if id(p) not in watched}  # fmt: skip
        return len(apart), _not_finite((str(tuple(p.shape)), p) for p in apart.values())

    def _module(self, path: str | None) -> torch.nn.Module | None:
        """The model's module at ``path`` (the model for None); None when the model is gone or
        the path no longer names a module."""
        model = self._model() if self._model is not None else None
        if model is None:
            return None
        try:
            return submodule(model, path) if path is not None else model
        except AttributeError:
            return None


def _first_bad(tensor: torch.Tensor, stats: Any) -> str:
    """Where the first value that is not finite lies, when only some are (a NaN in one sample
    of a batch of 24,576 values: the person need not scroll to it), else nothing."""
    summary = stats.summary
    bad = summary.nan + summary.posinf + summary.neginf if summary is not None else 0
    if not 0 < bad < tensor.numel() or tensor.layout is not torch.strided or not tensor.dim():
        return ""
    try:  # (read a chunk at a time, as the UI's f finds it; a dtype it cannot read: no more)
        at = next_nonfinite(tensor)
    except RuntimeError:
        return ""
    if at is None:
        return ""
    index = [int(i) for i in torch.unravel_index(torch.tensor(at[0]), tensor.shape)]
    return f" The first is at [{', '.join(map(str, index))}]."


def _not_finite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    return [name for name, t in named
            if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())]  # fmt: skip


def _summary(record: Record) -> dict[str, Any]:
    stats = record.stats
    return {
        **(stats.summary.as_dict() if stats.summary is not None else {}),
        "shape": list(stats.shape),
        "dtype": stats.dtype,
    }


def with_origin(finding: Finding, is_origin: bool, condition: int | None, kind: str,
                module: str, first: str, bad_buffers: Sequence[str] = (),
                by_gradient: bool = False, bad_params: Sequence[str] = (),
                unseen: str = "", bad_since: int | None = None,
                unwatched: Sequence[str] = (), sibling: bool = False,
                apart: tuple[int, Sequence[str]] = (0, ()),
                carried: bool = False) -> str:  # fmt: skip
    """The finding's sentence, followed by where the value came from. Its advice (what the
    condition usually means) is given where the condition arose, not repeated downstream.
    ``bad_buffers``: the module's buffers that are not finite (they fed its output);
    ``by_gradient``: a parameter's, which its gradient held before the step; ``bad_params``:
    the module's own parameters that are not finite (an output passed on from them);
    ``unseen``: the block around it whose gradients no hook saw (origin.py); ``bad_since``: a
    parameter's, the step since which it has not been finite; ``unwatched``: the module's
    parameters added after attach that are not finite; ``apart``: of a loss, the parameters
    its optimizers step that are not watched, and the shapes of those not finite; ``carried``:
    ``first`` is a parameter that held it before this forward (not produced there)."""
    if condition is None:
        return finding.advised
    if kind in ("param", "param_between") and bad_since is not None:  # (the last update skipped)
        return f"{finding.message} {_still_bad(is_origin, by_gradient, bad_since, first)}"
    if not is_origin:
        source = f" (first produced at {first})" if first else ""
        if carried:  # an earlier step's update made it so: nothing here produced it
            source = f" (from {first}, which held NaN or Inf before this forward)"
        if kind == "param" and by_gradient:
            return (f"{finding.message} The update wrote it in from the gradient, which held it "
                    f"already{source}. It has landed: to keep the weights clean, skip such an "
                    "update at the gradient's hit, before it lands (k there, or "
                    "on_hit='skip').")  # fmt: skip
        if kind == "param":
            return (f"{finding.message} It was so before this step{source}: the update did not "
                    "make it.")  # fmt: skip
        if bad_params:
            return (f"{finding.message} It was passed on from this module's own parameters "
                    f"{_names(bad_params)}, which held NaN or Inf before this forward"
                    f"{'' if carried else source}, not produced here.")  # fmt: skip
        if sibling:  # one origin a call: its other outputs are its work too
            return (f"{finding.message} It was produced by the same call as {first}, the "
                    "origin (named once a call).")  # fmt: skip
        return f"{finding.message} It was passed on from upstream{source}, not produced here."
    note = ORIGIN_NOTE.get((kind, bool(module))) or ORIGIN_NOTE[kind, not module]
    if unseen:
        note = (f"It first showed here, in {unseen} or just after it in backward: "
                f"torch.utils.checkpoint with use_reentrant=True runs {unseen} again in "
                "backward, where tensordbg sees no gradient but its parameters'. The backward "
                f"of {unseen} or of a module in it made it, or it came in with the gradient of "
                f"{unseen}'s output. With use_reentrant=False tensordbg names the "
                "module.")  # fmt: skip
    if unwatched:
        note = (f"Its inputs and the parameters tensordbg watches were clean, but parameters "
                f"added after attach, which it does not watch, hold NaN or Inf: "
                f"{_names(unwatched)}.")  # fmt: skip
    if apart[0]:  # a loss of a model apart too: its outputs were not seen
        n = len(apart[1])
        bad = (f"; {n} of them, of shape{'s' * (n > 1)} {_names(apart[1])}, hold"
               f"{'s' * (n == 1)} NaN or Inf" if n else "")  # fmt: skip
        note = (f"The watched model's outputs were clean, but its optimizer also steps "
                f"{apart[0]} parameters tensordbg does not watch (a model apart: a decoder "
                f"beside the watched encoder){bad}. What runs with them between the model and "
                "the loss may have made it, or the code that computes the loss. Attach a "
                "module holding every model the optimizer steps to see inside them.")  # fmt: skip
    if bad_buffers:
        note = (f"Its inputs and parameters were clean, but its buffers {_names(bad_buffers)} "
                "hold NaN or Inf: "
                "an earlier forward wrote them (BatchNorm's running statistics after a bad "
                "batch); reset them or load a checkpoint.")  # fmt: skip
    if kind.startswith("buffer") or kind in SET_APART:  # the rule's advice (a learning rate)
        return f"{finding.message} {note}"  # is not a buffer's, nor a weight's set by hand
    return f"{finding.advised} {note}"


def _still_bad(is_origin: bool, by_gradient: bool, since: int, first: str) -> str:
    """What a parameter that has not been finite since step ``since`` says: no update made it
    (the last was skipped) or one only spread it, and a skip cannot clean it."""
    advice = ("Skipping updates cannot clean a weight that was bad before them: set it right "
              "or load a checkpoint.")  # fmt: skip
    if is_origin:  # seen again after a skipped update (origin.py's update_skipped)
        return (f"It has been so since step {since}, and the updates since were skipped: no "
                f"update made it, and it makes this step's NaN or Inf again. {advice}")  # fmt: skip
    source = f" (first produced at {first})" if first else ""
    if by_gradient:
        return (f"It was so before this update already, since step {since}{source}, and its "
                f"gradient held it too. {advice}")  # fmt: skip
    return f"It has been so since step {since}{source}: the update did not make it."


def large_params(params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """For a module that made a NaN or Inf of finite inputs and parameters: the sentence
    naming its parameters so large that a product of two overflows their dtype (a weight an
    update sent to 1e38 makes a LayerNorm's Inf in the next forward), or nothing."""
    large, dtypes = [], set()
    for name, p in params:
        if not p.is_floating_point() or not p.numel():
            continue
        top = float(p.detach().abs().max())
        if math.isfinite(top) and top > math.sqrt(torch.finfo(p.dtype).max):
            large.append(f"{name} (up to {top:.3g})")
            dtypes.add(str(p.dtype).replace("torch.", ""))
    if not large:
        return ""
    return (
        f" Clean, but only finite: its parameters {_names(large)} are so large that a "
        f"product of two overflows {'/'.join(sorted(dtypes))}. An update wrote them (a "
        "learning rate too high for their parameter group?), or they were loaded so."
    )


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _root_call(call: Call | None) -> Call | None:
    while call is not None and call.parent is not None:
        call = call.parent
    return call
