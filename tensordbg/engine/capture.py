"""Hooks that capture a training's tensors: the first stage of tensordbg's pipeline.

What is hooked, and why this way (see reference.md, "Hook pitfalls"):

- Forward: a pre-hook and an always-called post-hook (with kwargs) on every selected module. The
  root's inputs and every module's outputs are watched, through any nesting of tuples, lists,
  dicts and dataclasses; each module call gets a :class:`Call` in a per-forward call tree, which
  is what lets the engine tell the module that produced a bad value from those that passed it on.
  Inside a module with a fused inference path that hooks turn off, the same hooks are global
  ones (fused.py).
- Backward: ``Tensor.register_hook`` on module outputs and inputs, installed from the forward
  hooks. ``register_full_backward_hook`` is not used: it breaks on in-place ops such as
  ``ReLU(inplace=True)``. A hook registered before an in-place op sees the gradient of the value
  before it, so a tensor modified in place gets one record per version.
- Parameter gradients: ``register_post_accumulate_grad_hook`` (``param.grad`` is final there).
- The end of a backward pass: a callback queued on the autograd engine from the first hook.
- Optimizer: step pre- and post-hooks (in the session).

Everything a hook learns becomes a :class:`~records.Record` handed to a :class:`Sink` (the
session), which computes the statistics and judges them. Where the session allows it (deferred
mode, while the phase shows no problem) the hooks of the root's children only note what they
saw, and the calls and records are made when the root returns, in one warm loop: a hook runs cold
between the model's kernels, and the same bookkeeping costs several times more there.

Every hook is registered through the session's :class:`~handles.HandleGroup`, so detaching
removes them all at once. A forward that runs again inside backward (activation checkpointing
recomputes it) is skipped, so nothing is counted twice.
"""

from __future__ import annotations

import sys
import weakref
from types import CodeType
from typing import Any, Protocol

import torch

from tensordbg.engine.fused import GlobalHooks, fused_modules
from tensordbg.engine.grad_hooks import GradHooks
from tensordbg.engine.handles import HandleGroup, Unhooked, hide_from_torchscript
from tensordbg.engine.marks import hook_of_ours, own_work
from tensordbg.engine.pending import COLD, ForwardLog, PendingForward, Seen, grad_edge
from tensordbg.engine.pinpoint import draws_random, random_state
from tensordbg.engine.records import Call, Record, memory_of, new_record, tensor_leaves, version_of
from tensordbg.engine.sites import HOOK_CALLER, in_reentrant_checkpoint, user_site
from tensordbg.engine.watched import enters_late, watched_modules
from tensordbg.statistics import FINITE, MEAN
from tensordbg.statistics.torch_kernels import SCREEN, watchable


class Sink(Protocol):
    """What the hooks hand their findings to (the session). Each method runs on the training
    thread, inside a hook; an exception other than ``passthrough`` goes to :meth:`fault`."""

    passthrough: tuple[type[BaseException], ...]
    step: int
    active: bool

    def begin_forward(self) -> None: ...
    def collect(self, record: Record, tensor: torch.Tensor) -> None: ...
    def collect_input(self, call: Call, record: Record, tensor: torch.Tensor) -> None: ...
    def enter(self, call: Call) -> None: ...
    def exit(self, call: Call) -> None: ...
    def end_forward(self, root: Call, listed: bool = True) -> None: ...
    def logs_forward(self) -> frozenset[torch.dtype]: ...
    def plans_gradients(self) -> bool: ...
    def lists_forward(self) -> bool: ...
    def keep_unlisted(self, record: Record, tensor: torch.Tensor) -> None: ...
    def plan_gradients(self, seen: list[tuple[Record, Any, int]], calls: dict[str, int],
                       roots: list[Any]) -> list[tuple[Record, Any, int]]: ...  # fmt: skip
    def pass_started(self, grads: tuple) -> None: ...
    def log_budget(self) -> int: ...
    def screens_noted(self) -> bool: ...
    def boundary_wanted(self) -> bool: ...
    def param_grad(self, name: str, owner: str, owner_type: str, grad: torch.Tensor) -> None: ...
    def fault(self, error: Exception) -> None: ...


def _as_seen(leaves: list[tuple[str, torch.Tensor]]) -> list[Seen]:
    seen: list[Seen] = []
    for suffix, t in leaves:
        if not watchable(t):
            continue
        seen.append((suffix, t, version_of(t), grad_edge(t)))
    return seen


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (a checkpointed
    forward being recomputed, for instance)."""
    return torch._C._current_graph_task_id() != -1


class Capture(ForwardLog):
    """Installs the hooks on a model and turns what they see into records for the session."""

    def __init__(
        self,
        session: Sink,
        model: torch.nn.Module,
        include: tuple[str, ...],
        exclude: tuple[str, ...],
    ):
        self.session = session
        self.include, self.exclude = include, exclude  # module path patterns
        self.paths, self.types, self.direct_params = watched_modules(model, include, exclude)
        self.random: set[int] = set()  # modules that draw random numbers (dropout) in forward
        self.stack: list[Call] = []
        self.root: Call | None = None
        self.calls_by_path: dict[str, list[Call]] = {}
        self._root_calls: list[Call] = []  # the calls of the current root forward
        self._root_grad = True  # whether it ran with gradients (a backward can come)
        self._counts: dict[int, int] = {}
        self._checkpointed: set[str] = set()  # called inside a reentrant checkpoint this step
        self._seen: dict[int, Record] = {}
        self._outputs: dict[tuple[Any, ...], Record] = {}  # the step's model outputs, by memory
        self.root_outputs: list[weakref.ref[torch.Tensor]] = []
        """The step's root calls' outputs, weakly: where the loss code starts (pinpoint.py)."""
        self._skipping = 0
        self.suspended = False  # True while a forward runs again (pinpoint.py): hooks are off
        self._open = 0  # module calls entered and not yet returned, as the hooks count them
        # The forward log: module calls only noted by the hooks, replayed when the root returns.
        self._log: list[tuple[int | None, list[Seen], tuple[CodeType, int] | None, Any]] | None
        self._log = None
        self._log_bytes = 0
        self._last_noted: list[tuple[Any, ...]] | tuple[()] = ()  # the last hook's (pending.py)
        self._log_dtypes: frozenset[torch.dtype] = frozenset()
        self._log_room = 0
        self._log_whole = True
        self._hot: dict[int, tuple[int, float]] | None = None  # finite outputs: version, mean
        self.grad_hooks: GradHooks | None = None
        self._planning: list[tuple[Record, Any, int]] = []  # gradients the session may vouch for
        self._listing = True  # calls and records join the phase's events as they are made
        self.pending: list[PendingForward] = []
        """This step's root forwards whose calls and records are not made yet (pending.py)."""
        self._made: list[Record] | None = None  # while a pending forward is made: its records
        self._structure = False  # ... and whether they join no phase (a later phase's need)
        self.calls_since_pass: dict[str, int] = {}
        """How often each module was called since the last backward pass ended."""
        self.empty_calls: dict[int, int] = {}
        """How often each module (by id) was called this step with only empty tensors (an
        expert no token chose): its parameters' gradients are zeros of no data."""
        self._ids = {path: key for key, path in self.paths.items()}

    @property
    def with_grad(self) -> bool:
        """Whether the latest root forward ran with gradients (a backward can come of it)."""
        return self._root_grad

    # --- installation ----------------------------------------------------------------------

    def install(self, model: torch.nn.Module, handles: HandleGroup) -> None:
        """Hook every selected module's forward, and every trainable parameter's gradient."""
        self.grad_hooks = GradHooks(self.session, handles)
        self.random = {id(m) for m in model.modules() if id(m) in self.paths and draws_random(m)}
        fused = fused_modules(model.modules()) & self.paths.keys()
        if fused:  # hooks their fused path would see turn it off: global ones (fused.py)
            GlobalHooks(fused, self.on_enter, self._on_exit).install(handles)
        for module in model.modules():
            if id(module) not in self.paths or id(module) in fused:
                continue
            late = enters_late(module, model, self.random, self.session.plans_gradients())
            ids = set()
            if not late:
                pre = module.register_forward_pre_hook(self.on_enter, with_kwargs=True)
                ids.add(handles.add(pre).id)
            post = handles.add(
                module.register_forward_hook(
                    self._on_leaf_exit if late else self._on_exit,
                    with_kwargs=True,
                    always_call=True,
                )
            )
            ids.add(post.id)
            # torch.save(model) and copy.deepcopy(model) see the module without these hooks.
            unhooked = Unhooked(module, ids)
            handles.patch(module, "__reduce_ex__", unhooked)
            if hasattr(type(module), "__deepcopy__"):
                handles.patch(module, "__deepcopy__", unhooked.deepcopy)
        self.grad_hooks.watch_parameters(model, hooked=not self.session.plans_gradients())
        hide_from_torchscript(handles)
        handles.callback(self.reset)
        handles.callback(self.new_step)

    def reset(self) -> None:
        """Start a new root forward. The calls of the step's earlier root forwards stay in
        :attr:`calls_by_path` (a GAN calls ``G(z)``, ``D(fake)``, ``D(real)`` before its backward
        passes: their origins are reasoned over all of them) until :meth:`new_step`."""
        if not self._root_grad and self._root_calls:
            # An evaluation under no_grad: no backward will reason over its calls.
            gone = {id(c) for c in self._root_calls}
            self.calls_by_path = {
                path: kept
                for path, calls in self.calls_by_path.items()
                if (kept := [c for c in calls if id(c) not in gone])
            }
        self._root_calls = []
        self._root_grad = torch.is_grad_enabled()
        self._planning = []
        self.stack.clear()
        self.root = None
        self._skipping = 0
        self._end_log()

    def new_step(self) -> None:
        """A step ended: forget its calls (nothing is kept across steps)."""
        self.calls_by_path = {}
        self._root_calls = []
        self._seen.clear()  # a tensor made by one root forward and used by the next is one record
        self._outputs.clear()
        self.root_outputs = []
        self._counts.clear()  # a module's calls are numbered across the step's root forwards
        self._checkpointed.clear()
        self.empty_calls.clear()
        self.pending = []
        self.grad_hooks.forget_dead_leaves()

    def fed_nothing(self, path: str) -> bool:
        """Whether every call this step of the module at ``path`` got only empty tensors (an
        expert of a mixture that no token chose): its parameters' gradients are zeros that no
        data made, as if no pass had reached it."""
        key = self._ids.get(path)
        return key is not None and self.empty_calls.get(key, 0) == self._counts.get(key, -1)

    # --- forward -------------------------------------------------------------------------------

    # torch.compile must not trace the hooks (they keep Python state): it runs them eagerly, at a
    # graph break around each watched module.
    @hook_of_ours
    @own_work
    def on_enter(self, module: torch.nn.Module, args: tuple, kwargs: dict | None) -> None:
        self._entering(module, args, kwargs)

    @hook_of_ours
    @own_work
    def _on_leaf_exit(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any
                      ) -> None:  # fmt: skip
        """A leaf's call (:func:`~.watched.enters_late`), entered and left in its one hook:
        nothing of ours runs inside it, so the log is the same, and a clean forward makes
        fewer hook calls (the benchmark's model: 28 of 65, each ~10 us in the cold cache its
        module's kernels leave)."""
        self._entering(module, args, kwargs, leaf=True)
        self._leaving(module, args, kwargs, output)

    def _entering(self, module: torch.nn.Module, args: tuple, kwargs: dict | None,
                  leaf: bool = False) -> None:  # fmt: skip
        """A module's call starts (called by its hook: the user's line is found past it).
        ``leaf``: left at once (:meth:`_on_leaf_exit`), whose noting of the log's growth
        counts this entry too."""
        session = self.session
        if not session.active or self.suspended:
            return
        try:
            if self._skipping or (not self._open and in_backward()):
                # A forward recomputed during backward (activation checkpointing): skip it all.
                self._skipping += 1
                return
            site = user_site(sys._getframe(HOOK_CALLER + 1))
            if (self._open and self._root_grad and not torch.is_grad_enabled()
                    and in_reentrant_checkpoint(sys._getframe(2))):  # fmt: skip
                self._checkpointed.add(self.paths[id(module)])
            leaves = tensor_leaves(args, "")
            if kwargs:
                leaves += tensor_leaves(kwargs, "")
            log = self._log
            seen = self._note(leaves) if log is not None and self._open else None
            if seen is None:
                if log is not None and self._open:
                    self.replay(resume=False)  # a tensor its rules must see at once: live from here
                seen = _as_seen(leaves)
            if not seen and leaves and not any(t.numel() for _, t in leaves):
                self.empty_calls[id(module)] = self.empty_calls.get(id(module), 0) + 1
            self._open += 1
            drawn = random_state(seen) if module.training and id(module) in self.random else None
            # Keyword arguments unknown (fused.py): no re-run, no masks described.
            invocation = None if kwargs is None else (module, args, kwargs, seen, drawn)
            if self._log is not None and self._open > 1:
                self._log.append((id(module), seen, site, invocation))
                if not leaf:
                    self._noted()
                return
            self._enter(id(module), seen, site, invocation, is_root=self._open == 1)
        except Exception as e:
            session.fault(e)

    @hook_of_ours
    @own_work
    def _on_exit(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._leaving(module, args, kwargs, output)

    def _leaving(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        session = self.session
        if not session.active or self.suspended:
            return
        if self._skipping:
            self._skipping -= 1
            return
        if not self._open:
            return
        self._open -= 1
        try:
            leaves = tensor_leaves(output, "") if output is not None else []
            if not self._open:
                self.root_outputs += [weakref.ref(t) for _, t in leaves if t.grad_fn is not None]
            if self._log is not None and self._open:
                seen = self._note(leaves)
                if seen is not None:
                    self._log.append((None, seen, None, None))
                    if self._hot is not None:
                        self._screen_hot(seen)
                    self._noted()
                    return
                self.replay(resume=False)  # a tensor its rules must see at once: live from here
            seen = _as_seen(leaves)
            if self._log is not None:
                if self._log_whole and self.session.defers_forward(seen):
                    self._defer(seen)  # no call or record: only what the backward needs
                    return
                # The calls and records are made now; the phase's events for them only if it
                # turns out to need them (see ForwardPhase.end_forward).
                self._listing = self.session.lists_forward()
                try:
                    self.replay(resume=False)
                    self._exit(seen)
                finally:
                    self._listing = True
                return
            self._exit(seen)
        except Exception as e:
            session.fault(e)

    def forget_invocations(self) -> None:
        """Let go of the arguments of this step's module calls (the forward phase ended)."""
        for calls in self.calls_by_path.values():
            for call in calls:
                call.invocation = None

    def _enter(self, key: int, seen: list[Seen], site: tuple[CodeType, int] | None,
               invocation: Any = None, is_root: bool = False) -> None:  # fmt: skip
        session = self.session
        if is_root:
            self.grad_hooks.watch_waiting()
            session.begin_forward()
            self.reset()
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        parent = self.stack[-1] if self.stack else None
        call = Call(
            path=self.paths[key],
            module_type=self.types[key],
            index=index,
            parent=parent,
            depth=0 if parent is None else parent.depth + 1,
            params=self.direct_params[key],
            site=site,
            invocation=invocation,
        )
        if parent is not None:
            parent.children.append(call)
        else:
            self.root = call
        self.calls_by_path.setdefault(call.path, []).append(call)
        self._root_calls.append(call)
        made = self._made
        if made is None:  # a pending forward's calls were counted when the light pass met them
            self.calls_since_pass[call.path] = self.calls_since_pass.get(call.path, 0) + 1
        self.stack.append(call)
        for suffix, t, version, node in seen:
            record = self._known(t, version)
            aliased = record is None and is_root and (record := self._alias(t, version)) is not None
            if record is None:
                record = self._new_record(t, version, call, "input", suffix, hidden=not is_root)
                self._remember(t, record)
                if is_root:
                    session.collect(record, t)
                elif self._listing:
                    session.collect_input(call, record, t)
                else:
                    session.keep_unlisted(record, t, self._structure)
            if not aliased or node is not False:  # a detached alias: no gradient reaches it
                record.consumed_by(call)
            call.inputs.append((suffix, record))
            if made is None:
                self._hook_grad(t, node, record)
            else:  # hooked when the root returned, or vouched for
                record.grad_hooked = record.grad_hooked or node is not False
                made.append(record)
        if self._listing:
            session.enter(call)
        if is_root:
            self._start_log()  # the root's children may be noted, and replayed when it returns

    def _exit(self, seen: list[Seen]) -> None:
        if not self.stack:
            return
        session = self.session
        call = self.stack.pop()
        made = self._made
        for suffix, t, version, node in seen:
            record = self._known(t, version)
            if record is None:
                record = self._new_record(t, version, call, "output", suffix)
                record.producer = call
                self._remember(t, record)
                if self._listing:
                    session.collect(record, t)
                else:
                    session.keep_unlisted(record, t, self._structure)
                hot = self._hot.get(id(t), COLD) if self._hot else COLD
                if hot[0] == version and record.lazy and record.wanted == SCREEN:
                    record.stats.values = {FINITE: 1.0, MEAN: hot[1]}  # read in its hook
            elif record.producer is not None and record.producer is not call:
                record.passed_up_to(call)
            if call.parent is None and not self._structure:
                self._outputs[memory_of(t)] = record
                if t.is_contiguous():  # its reshapes too: the same values in the same order
                    self._outputs[memory_of(t, reshaped=True)] = record
            call.outputs.append((suffix, record))
            if made is None:
                self._hook_grad(t, node, record)
            else:
                record.grad_hooked = record.grad_hooked or node is not False
                made.append(record)
        if self._checkpointed and call.path in self._checkpointed:
            call.unseen_grads = True
        if self._listing:
            session.exit(call)
        if not self.stack and made is None:
            self._end_log()
            self.grad_hooks.watch_waiting()  # a lazy module's parameters have their shapes now
            if self._planning:
                self._plan(seen, call)
            session.end_forward(call, listed=self._listing)

    def _plan(self, seen: list[Seen], root: Call) -> None:
        """The root returned: hook the gradients nothing vouches for (see engine/vouching.py),
        and have the model's outputs start the backward pass whatever they get."""
        planning, self._planning = self._planning, []
        outputs = [record for _, record in root.outputs]
        self._hook_planned(planning, outputs, seen)

    def _known(self, t: torch.Tensor, version: int) -> Record | None:
        """The record of this very tensor at this very version, if it was seen in this forward."""
        record = self._seen.get(id(t))
        if record is None or record.weak is None or record.weak() is not t:
            return None
        if record.version != version:
            return None
        return record

    def _alias(self, t: torch.Tensor, version: int) -> Record | None:
        """The record of a model output of this step that ``t`` is another tensor of: the same
        memory, shape and version (``fake.detach()`` handed from a GAN's generator to its
        discriminator) or a reshape of the same values (``out.flatten(1)``, under ``no_grad``:
        no graph tells it), while that output lives (its memory is not another tensor's)."""
        record = self._outputs.get(memory_of(t)) if self._outputs else None
        if record is None and self._outputs and t.is_contiguous():
            record = self._outputs.get(memory_of(t, reshaped=True))  # out.flatten(1)
        if record is None or record.version != version or record.weak is None:
            return None
        return record if record.weak() is not None else None

    def _remember(self, t: torch.Tensor, record: Record) -> None:
        record.weak = weakref.ref(t)
        self._seen[id(t)] = record

    def _new_record(self, t: torch.Tensor, version: int, call: Call, kind: str, suffix: str,
                    hidden: bool = False) -> Record:  # fmt: skip
        record = new_record(t, call.tensor_name(kind, suffix), kind, "forward", self.session.step,
                            module=call.path, module_type=call.module_type, call=call.index,
                            suffix=suffix, hidden=hidden)  # fmt: skip
        record.version = version  # as the hook saw it (a noted call is replayed later)
        return record

    # --- backward -------------------------------------------------------------------------------

    def _hook_grad(self, t: torch.Tensor, node: Any, record: Record) -> None:
        """Hook the gradient of ``t`` as the forward hook saw it: ``node`` is the autograd node
        that made that version and its output number (None: a leaf; False: no gradient)."""
        if record.grad_hooked or node is False or not torch.is_grad_enabled():
            return
        record.grad_hooked = True
        if node is None:  # a leaf: only a tensor hook sees its gradient
            self.grad_hooks.hook_leaf(t, record)
        elif self.session.plans_gradients():  # hooked, or not, when the root returns
            self._planning.append((record, *node, record.stats.dtype))
        else:
            self.grad_hooks.hook_node(record, *node)
