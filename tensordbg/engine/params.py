"""Parameters and their updates: which optimizer steps which parameter, what a step changed.

Telling whether a step changed a parameter must cost almost nothing on the common path. A
parameter's :class:`Digest` is read anyway (it says the parameter is finite): the norms of all
float32/float64 parameters in one pass, the range of the others; when it moved by more than the
tolerance allows, some element did too, so the step changed it. Otherwise it may not have changed:
it is copied before the next step (within ``update_budget``) and compared then: first a sample of
its elements (one that moved proves the change), and every element only when none did. A
parameter whose sample told (with a tolerance given to WeightNotChanging, an embedding that Adam
moves everywhere by steps too small to move its norm past it) is sampled before its next suspect
step, not copied: a few hundred bytes instead of a copy of the table; a step its sample cannot
tell goes unmeasured, and it is copied whole before the next one. A step whose learning rate
is 0 is foreseen to leave its parameters as they are: they are copied before it (not sampled: a
sample proves only a change), so the first step of a learning rate set to 0, at step 0 or later,
is measured, not only the steps after it. Rules that measure updates (``update_abs_mean``) get a
copy of every parameter, the budget rotating over a model larger than it.

When the rules ask of an update only whether it changed the parameter (``update_unchanged``, as
WeightNotChanging does), a parameter that keeps changing is news only once: its update record is
made when it did not change, or may not have, and on the first step it changed again; not on
every step it changes as before (:meth:`ParamWatch.moving`). A rule on these records sees every
transition between changing and not changing.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.parameter import is_lazy

from tensordbg.engine.digests import Digest, samples_apart, view_of
from tensordbg.engine.records import Record, new_record, submodule
from tensordbg.statistics import Stat
from tensordbg.statistics.batch import on_host

# Update statistics that need a copy of the parameter from before the step.
SNAPSHOT_STATS = frozenset({"update_abs_mean", "prev_abs_mean"})


@dataclass(eq=False)
class Param:
    """A watched parameter: its name, and the module that owns it."""

    name: str
    param: torch.nn.Parameter
    owner: str
    owner_type: str

    def record(self, kind: str, name: str, step: int, phase: str = "optimizer") -> Record:
        """A record of the parameter (``kind="param"``) or of its update (``"update"``), in
        ``phase`` (an optimizer's, or attach's check)."""
        return new_record(self.param, name, kind, phase, step, module=self.owner,
                          module_type=self.owner_type, trainable=self.param.requires_grad,
                          param=self.name)  # fmt: skip


SAMPLE = 64
"""How many evenly spaced elements of a parameter :func:`sample_moved` compares."""
ROTATION = 8
"""Sampled checks read every parameter whole at least once in this many steps."""


def _rate(lr: Any) -> float | None:
    """A group's learning rate as a float (a tensor's too: ``capturable`` optimizers)."""
    try:
        rate = float(lr)
    except (TypeError, ValueError, RuntimeError):
        return None
    return rate if math.isfinite(rate) and rate >= 0 else None


def held_params(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the parameters ``optimizer`` updates."""
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def parameter_count(module: torch.nn.Module) -> int:
    """The number of parameter elements of ``module``, those of a lazy module's parameters that
    have no shape yet left out (``numel()`` of one raises)."""
    return sum(p.numel() for p in module.parameters() if not is_lazy(p))


def sample_of(t: torch.Tensor) -> torch.Tensor:
    """``SAMPLE`` evenly spaced elements of ``t`` (a view)."""
    flat = t.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLE)]


def sample_moved(current: torch.Tensor, previous: torch.Tensor, rtol: float, atol: float,
                 sampled: bool = False) -> bool:  # fmt: skip
    """Whether one of ``SAMPLE`` evenly spaced elements moved by more than ``atol + rtol *
    |previous|``: proof that the step changed the parameter (the statistic ``update_unchanged``
    is then 0), read from a few hundred bytes. False proves nothing: compare every element.
    ``sampled``: ``previous`` is already the sample (:func:`sample_of`)."""
    a, b = sample_of(current), previous if sampled else sample_of(previous)
    return bool(((a - b).abs_() - b.abs().mul_(rtol) > atol).any())


class ParamWatch:
    """The model's parameters, and what is needed to measure their updates."""

    def __init__(self, model: torch.nn.Module, update_budget: int):
        self.update_budget = update_budget
        self._model = weakref.ref(model)
        self._said_unwatched: set[int] = set()
        self.params: dict[int, Param] = {}
        for name, param in model.named_parameters():
            owner = name.rpartition(".")[0]
            owner_type = type(submodule(model, owner)).__name__
            self.params[id(param)] = Param(name, param, owner, owner_type)
        self.by_name = {p.name: p for p in self.params.values()}
        self.digests: dict[str, Digest] = {}
        """Each parameter's digest after the last step."""
        self.suspects: set[str] = set()
        """Parameters whose change could not be told by their range: copied before next step."""
        self.snapshots: dict[str, torch.Tensor] = {}
        self.samples: dict[str, torch.Tensor] = {}
        """Suspects copied only in part before the step (see :meth:`before_step`)."""
        self.sample_tells: set[str] = set()
        """Parameters whose last exact comparison was decided by its sample alone."""
        self.proven: set[str] = set()
        """Parameters whose sample proved this step that it changed them."""
        self.versions: dict[str, int] = {}
        self.unsettled: set[str] | None = None
        """Parameters whose latest update record did not say "changed" (None: none made yet)."""
        self.lr_peaks: dict[tuple[int, int], float] = {}
        """The largest learning rate of each (optimizer, parameter group) while watched."""
        self.groups: dict[int, list[dict[str, Any]]] = {}
        self._owned: dict[int, tuple[tuple[Any, ...], list[Param]]] = {}  # (see owned)
        self._samples: tuple[Any, ...] | None = None  # the last samples taken (sampled)
        self._samples_before: np.ndarray | None = None  # the ones before, of the same params
        """Each optimizer's parameter groups (by its id), noted as its steps come: their
        learning rates before a step say which parameters it cannot move."""
        self._offset = 0
        self._turn = 0  # where the next rotation starts
        # The parameters sampled last, their samples, where each lies in the read, and the read
        self._sampling: tuple[list[Any], list[torch.Tensor], list[tuple[str, int, int]],
                              torch.Tensor] | None = None  # fmt: skip

    def note_learning_rates(self, optimizer: torch.optim.Optimizer) -> None:
        """Note each parameter group's learning rate after a step, the largest kept."""
        peaks = self.lr_peaks
        for i, group in enumerate(optimizer.param_groups):
            lr = _rate(group.get("lr"))
            if lr is not None and lr > peaks.get((id(optimizer), i), 0.0):
                peaks[(id(optimizer), i)] = lr

    def learning_rate_shares(self, optimizer: torch.optim.Optimizer) -> dict[int, float]:
        """Each parameter's learning rate now as a share of the largest its group has had, or
        was given by a scheduler (``initial_lr``, which torch's schedulers set: a warm-up from 0
        holds the rate at 0 first), by ``id``; none for a group whose rate was never above 0
        (a learning rate of zero from the start, no schedule to raise it, is a fault)."""
        shares: dict[int, float] = {}
        for i, group in enumerate(optimizer.param_groups):
            lr, peak = _rate(group.get("lr")), self.lr_peaks.get((id(optimizer), i), 0.0)
            peak = max(peak, _rate(group.get("initial_lr")) or 0.0)
            if lr is not None and peak > 0:
                shares.update(dict.fromkeys(map(id, group["params"]), lr / peak))
        return shares

    def owned(
        self, optimizer: torch.optim.Optimizer, optimizers: Sequence[torch.optim.Optimizer]
    ) -> list[Param]:
        """The parameters this optimizer steps; the first optimizer also takes those no
        optimizer holds (a parameter left out of the optimizer is a bug worth seeing)."""
        first = id(optimizer) not in self.groups
        self.groups[id(optimizer)] = optimizer.param_groups  # read again before each step
        # The same groups holding the same lists of the same lengths as at the last step (a
        # scheduler changes only their rates): the same answer, without two sets of ids.
        shape = (optimizer is optimizers[0], len(self.params),
                 *((id(o), *((id(g["params"]), len(g["params"])) for g in o.param_groups))
                   for o in optimizers))  # fmt: skip
        cached = self._owned.get(id(optimizer))
        if cached is not None and cached[0] == shape:
            return cached[1]
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if first:
            self._say_frozen(mine)
        if len(mine) > len(self.params) or not mine.issubset(self.params):
            self._say_unwatched(optimizer, mine)
        if optimizer is optimizers[0]:
            held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
            owned = [p for key, p in self.params.items() if key in mine or key not in held]
        else:
            owned = [p for key, p in self.params.items() if key in mine]
        self._owned[id(optimizer)] = (shape, owned)
        return owned

    def _say_frozen(self, mine: set[int]) -> None:
        """Say once, at an optimizer's first step, which of the model's parameters it holds
        that do not require grad: frozen on purpose (a backbone) or by mistake (a layer left
        frozen), nothing of theirs is checked, and nothing else would mention them."""
        frozen = sorted(p.name for key, p in self.params.items()
                        if key in mine and not p.param.requires_grad)  # fmt: skip
        if frozen:
            what = ", ".join(frozen[:4]) + (", ..." if len(frozen) > 4 else "")
            print(f"tensordbg: the optimizer holds {len(frozen)} parameter"
                  f"{'s' * (len(frozen) > 1)} that do{'es' * (len(frozen) == 1)} not require "
                  f"grad ({what}): frozen, they get no gradient and no update, and tensordbg "
                  "checks neither. Set requires_grad=True if they should learn.",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _say_unwatched(self, optimizer: torch.optim.Optimizer, mine: set[int]) -> None:
        """Say once which parameters the optimizer steps that are not watched: added after
        attach (a layer appended, ``add_param_group``), or not the model's at all."""
        new = mine.difference(self.params, self._said_unwatched)
        if not new:
            return
        self._said_unwatched |= new
        model = self._model()
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        named = [names[key] for key in new if key in names]
        apart = len(new) - len(named)
        what = ", ".join(sorted(named)[:4]) + (", ..." if len(named) > 4 else "")
        said = [f"{what}, added to the model after attach"] if named else []
        said += [f"{apart} that {'are' if apart > 1 else 'is'} not the model's"] if apart else []
        print(f"tensordbg: the optimizer steps {len(new)} parameter{'s' * (len(new) > 1)} "
              f"tensordbg does not watch: {'; '.join(said)}. Their values, gradients, updates "
              "and modules are not checked (tensordbg watches what the model held when it "
              "attached).", file=sys.stderr, flush=True)  # fmt: skip

    def before_step(self, owned: list[Param], wanted: Sequence[Stat], every: bool,
                    fused: bool = False, reads_free: Callable[[torch.Tensor], bool] = on_host,
                    ) -> None:  # fmt: skip
        """Note the versions of the parameters about to be stepped, and copy those whose update
        must be measured exactly (``every``: all of them, within the budget): the suspects,
        and those whose group's learning rate is 0 for this step (:meth:`held_still`). A fused
        optimizer (``AdamW(fused=True)``, the Hugging Face Trainer's default) writes without
        bumping a parameter's version: there a version tells nothing (-1 never matches). A
        sample stands for a copy only where ``reads_free`` (comparing it after the step reads
        the host)."""
        self.versions = {}
        self.snapshots = {}
        self.samples = {}
        self.proven = set()
        stepped = [p for p in owned if p.param.requires_grad and p.param.grad is not None]
        for p in stepped:
            self.versions[p.name] = -1 if fused else p.param._version
        every = every and any(s.name in SNAPSHOT_STATS for s in wanted)
        budget = self.update_budget
        start = self._offset % len(stepped) if stepped else 0
        taken = 0
        sampling = not every and len(wanted) == 1 and wanted[0].name == "update_unchanged"
        still = self.held_still()
        for p in stepped[start:] + stepped[:start]:
            foreseen = bool(still) and id(p.param) in still
            if not (every or foreseen or p.name in self.suspects):
                continue
            if sampling and not foreseen and p.name in self.sample_tells and reads_free(p.param):
                # It keeps changing where its digest cannot tell (an embedding under Adam):
                # its sample tells, for a few hundred bytes instead of a copy of the table.
                self.samples[p.name] = sample_of(p.param).clone()
                continue
            size = p.param.numel() * p.param.element_size()
            if size <= budget:
                self.snapshots[p.name] = p.param.detach().clone()
                budget -= size
                taken += 1
        self._offset = start + taken  # a model larger than the budget rotates

    def held_still(self) -> set[int]:
        """The ids of the parameters in a group whose learning rate is 0 for the step about
        to be taken: the step is foreseen to leave them as they are (a warmup's first step, a
        group set to 0 by hand). Without a copy from before it, such a step is not measured
        (its digest did not move), and the first step of a parameter that stopped changing
        would never count: it stopped a step before the first one found. A learning rate
        held in a tensor (``capturable`` optimizers) is not read: that costs a
        synchronization."""
        still: set[int] = set()
        for groups in self.groups.values():
            for group in groups:
                lr = group.get("lr")
                if type(lr) in (float, int) and lr == 0:
                    still.update(map(id, group["params"]))
        return still

    def sampled(self, params: list[Param]) -> tuple[dict[str, Digest], bool]:
        """Each parameter's digest from ``SAMPLE`` fixed elements, all read in one pass, and
        whether they are all finite (deferred checks on the host, after a clean step's update:
        a NaN the update wrote elsewhere is found by the rotation, or by the next forward)."""
        if not params:
            return {}, True
        key = [(p.name, p.param.data_ptr(), p.param.stride()) for p in params]
        cached = self._sampling
        if cached is None or cached[0] != key:
            views = [sample_of(p.param)[:SAMPLE] for p in params]
            spans, start = [], 0
            for p, view in zip(params, views, strict=True):
                spans.append((p.name, start, start + view.numel()))
                start += view.numel()
            wide = any(v.dtype == torch.float64 for v in views)
            out = torch.empty(start, dtype=torch.float64 if wide else torch.float32)
            if all(v.is_cpu and v.dtype in (torch.float32, torch.float64) for v in views):
                views, out = [v.numpy() for v in views], out.numpy()  # numpy's calls cost less
            # Where each parameter's samples start, to tell them apart in one call (none if
            # one has no elements: numpy's reduceat would count its neighbour's).
            starts = [a for _, a, b in spans] if all(a < b for _, a, b in spans) else None
            cached = (key, views, spans, out, starts)
            # Views of the parameters' memory, kept while it stays (an optimizer updates in
            # place); a parameter that is not contiguous gives a copy, made again each time.
            contiguous = all(p.param.is_contiguous() for p in params)
            self._sampling = cached if contiguous else None
        _, views, spans, out, starts = cached
        if type(out) is np.ndarray:  # on the host: one numpy call, ~0.2 ms less than torch's
            # A new array each step: the digests are views of it, and :meth:`moving` compares
            # it with the last step's all at once (53 tuples and comparisons: ~0.3 ms a step).
            now = np.concatenate(views)
            last, self._samples = self._samples, (key, now, spans, starts)
            self._samples_before = last[1] if last is not None and last[0] == key else None
            digests = {name: Digest("sample", now[a:b], b - a) for name, a, b in spans}
            return digests, bool(np.isfinite(now).all())
        torch.cat(views, out=out)
        finite = math.isfinite(out.sum(dtype=torch.float64).item())
        flat = out.tolist()
        of_sample = Digest.of_sample
        return {name: of_sample(tuple(flat[a:b])) for name, a, b in spans}, finite

    def rotation(self, params: list[Param]) -> list[Param]:
        """The parameters whose turn it is to be read whole: about a ``ROTATION``-th of the
        bytes, continuing where the last step's turn ended."""
        if not params:
            return []
        total = sum(p.param.numel() * p.param.element_size() for p in params)
        start = self._turn % len(params)
        taken, size = [], 0
        for p in params[start:] + params[:start]:
            if size * ROTATION >= total:
                break
            taken.append(p)
            size += p.param.numel() * p.param.element_size()
        self._turn = start + len(taken)
        return taken

    def sample_verdict(self, p: Param, moved: bool) -> None:
        """Note whether the sample alone told that ``p`` changed at its last exact comparison
        (then the next one is made from a sample: :meth:`before_step`). Only a suspect's
        comparison counts, one its digest could not tell: a parameter copied because its
        learning rate is 0 was not expected to change, and what its sample said then says
        nothing of how its changes are best seen."""
        if p.name not in self.suspects:
            return
        if moved:
            self.sample_tells.add(p.name)
        else:
            self.sample_tells.discard(p.name)

    def before(self, p: Param) -> torch.Tensor | None:
        """The parameter as it was before the step, if known: itself when the optimizer did not
        touch it (the update is exactly zero), else its copy."""
        if p.param._version == self.versions[p.name]:
            return p.param.detach()
        return self.snapshots.get(p.name)

    def resolve_by_range(
        self, records: list[Record], ranges: dict[str, Digest], wanted: Sequence[Stat]
    ) -> None:
        """Updates measured without a copy: a digest that moved says it changed (the statistic
        ``update_unchanged`` is 0); else the parameter becomes a suspect."""
        unchanged = next((s for s in wanted if s.name == "update_unchanged"), None)
        for record in records:
            if self.digest_moved(record.param, ranges, unchanged):
                record.stats.values = {unchanged: 0.0}
            else:
                self.suspects.add(record.param)

    def digest_moved(self, name: str, ranges: dict[str, Digest], unchanged: Stat | None) -> bool:
        before, after = self.digests.get(name), ranges.get(name)
        if unchanged is None or before is None or after is None:
            return False
        rtol, atol = unchanged.params
        return after.moved_from(before, rtol, atol)

    def unmeasured(self, p: Param, ranges: dict[str, Digest], wanted: Sequence[Stat]) -> bool:
        """Whether the step's update of ``p`` can be told by nothing this step: no copy from
        before it and a digest that did not move. Then no record is made (a rule could not
        judge it); the parameter becomes a suspect, copied before the next step, and counts
        as not known to change (see :meth:`settle`)."""
        if self.before(p) is not None:
            return False
        unchanged = next((s for s in wanted if s.name == "update_unchanged"), None)
        sample = self.samples.get(p.name)
        if sample is not None and unchanged is not None:
            moved = sample_moved(p.param, sample, *unchanged.params, sampled=True)
            self.sample_verdict(p, moved)
            if moved:
                self.proven.add(p.name)  # its record says it changed
                return False
        if self.digest_moved(p.name, ranges, unchanged):
            return False
        self.suspects.add(p.name)
        if self.unsettled is None:
            self.unsettled = set()
        self.unsettled.add(p.name)
        return True

    def moving(self, owned: list[Param], ranges: dict[str, Digest],
               wanted: Sequence[Stat]) -> set[str]:  # fmt: skip
        """Parameters whose update needs no record this step: the rules ask only whether it
        changed, the step wrote the parameter and its digest moved past the tolerance (so it
        changed), as it did at its latest record."""
        if self.unsettled is None or len(wanted) != 1 or wanted[0].name != "update_unchanged":
            return set()
        rtol, atol = wanted[0].params
        moving = set()
        _, now, spans, starts = self._samples or (None, None, (), None)
        last = self._samples_before
        moved: dict[str, bool] = {}
        if last is not None and starts is not None:  # this step's samples against the last's
            flags = np.logical_or.reduceat(samples_apart(now, last, rtol, atol), starts)
            moved = dict(zip((name for name, _, _ in spans), flags.tolist(), strict=True))
        for p in owned:
            name = p.name
            version = self.versions.get(name)
            if name in self.unsettled or version is None or p.param._version == version:
                continue
            before, after = self.digests.get(name), ranges.get(name)
            if before is None or after is None:
                continue
            if name in moved and view_of(before, last) and view_of(after, now):
                if moved[name]:
                    moving.add(name)
            elif after.moved_from(before, rtol, atol):
                moving.add(name)
        return moving

    def settle(self, records: list[Record], wanted: Sequence[Stat]) -> None:
        """Note which parameters' update records of this step said "changed". A suspect stays
        one (copied before each step, compared exactly) until it changes: a parameter that
        stopped changing is measured on every step of its streak, not every other one."""
        unchanged = next((s for s in wanted if s.name == "update_unchanged"), None)
        if unchanged is None:
            return
        if self.unsettled is None:
            self.unsettled = set()
        for record in records:
            if record.stats.values.get(unchanged) == 0.0:
                self.unsettled.discard(record.param)
                self.suspects.discard(record.param)
            else:
                self.unsettled.add(record.param)

    def remember_ranges(self, ranges: dict[str, Digest]) -> None:
        for name, digest in ranges.items():
            if digest.complete:
                self.digests[name] = digest

    def clear(self) -> None:
        """Let go of every parameter and copy (at detach)."""
        self.params = {}
        self.by_name = {}
        self.snapshots = {}
        self.samples = {}
        self.groups = {}
        self._owned = {}
        self._samples = self._samples_before = None
        self._sampling = None
