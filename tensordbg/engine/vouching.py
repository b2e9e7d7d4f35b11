"""Which activation gradients a parameter's gradient vouches for, so that a clean backward pass
need not read them.

A NaN or Inf in the gradient of a module's output reaches its parameters' gradients whole:
a Linear's (or a convolution's, or a norm layer's) bias gradient is the sum of every element
of it; its weight gradient sums every element of it times an input value (NaN times anything
is NaN, Inf times zero too); an embedding's weight gradient adds every row of it into a row of
the table. So when such a parameter's gradient is finite, so is the gradient of the module's
output, and the gradient itself need not be read. The same holds through what carries a NaN
or Inf on element by element: an activation or a dropout applied to that output
(``PASSES_NONFINITE_ON``), and autograd operations that add, multiply, move or reshape the
gradient but never drop an element of it (``CARRY_NODES``: a residual stream's addition hands
the very gradient on; ``ATTENTION_NODES``: attention without dropout hands a NaN in its
output's gradient to the gradients of its query, key and value).

Two ways of using this, by sync mode:

- :class:`Vouchers`, in the hooks (deferred checks on a device, and a float16 gradient): the
  output's gradient is held until its bias's gradient comes, which is read then (a few
  kilobytes instead of the gradient).
- :class:`GradientPlan`, at the end of the pass (deferred checks on the host): the gradients a
  parameter vouches for get no hook at all; the pass's one norm over every parameter gradient
  says whether they were finite. Only the gradients nothing vouches for are read, in their
  hooks. A voucher must be sound for the pass: its module called once since the last pass
  (two calls add two gradients into it), the parameter not shared with another module, the
  gradient's dtype wide enough that the sum cannot overflow where the gradient did not
  (float16 can), and the parameter's gradient computed by this pass (checked when it starts:
  ``torch.autograd.grad`` and ``backward(inputs=...)`` compute only some). A gradient whose
  voucher turns out not finite was not kept: it is judged "not finite" from the voucher,
  without its values (``sync="eager"`` keeps them). A parameter used outside its module's
  call (``F.linear(h, self.embed.weight)`` in the model's own code) adds gradients that no
  module call shows: a NaN made there alone would be taken for one in the module's output.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from tensordbg.engine.carrying import CARRY_DEPTH, carried_to, fed_by
from tensordbg.engine.carrying import consumers as graph_consumers
from tensordbg.engine.carrying import reached as reached_from
from tensordbg.engine.marks import own_work
from tensordbg.engine.phases import ActGradNote
from tensordbg.engine.records import Record
from tensordbg.statistics.torch_kernels import SCREEN, host_stats

# Modules whose backward sums every element of their output's gradient into their bias's
# gradient (over the batch, and the positions or pixels): Linear, convolutions, the norms.
SUMMED_INTO_BIAS = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._BatchNorm,
)
# Modules whose weight's gradient takes every element of their output's gradient, multiplied
# by an input value: the same modules, and an embedding that drops no row (no padding_idx, a
# dense gradient). tests/test_vouching.py checks each on torch.
MULTIPLIED_INTO_WEIGHT = (*SUMMED_INTO_BIAS, nn.Embedding)
# Modules whose backward multiplies their output's gradient element by element by a derivative
# (or dropout's mask and scale): a NaN or Inf there stays one in their input's gradient, even
# where the factor is 0 (NaN * 0 is NaN, Inf * 0 too). So a parameter that vouches for the
# gradient of their input vouches for their output's.
PASSES_NONFINITE_ON = (
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.ELU,
    nn.LeakyReLU,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
)
CHAIN = 4  # how many such modules in a row a parameter vouches through
# Gradients whose voucher's sum cannot overflow where they did not: float16's can.
WIDE = frozenset({torch.float32, torch.float64, torch.bfloat16})


def _passes_nonfinite_on(module: nn.Module) -> bool:
    kind = next((k for k in PASSES_NONFINITE_ON if isinstance(module, k)), None)
    return (
        kind is not None
        and type(module).forward is kind.forward
        and not getattr(module, "inplace", False)
    )


def _own_forward(module: nn.Module, kinds: tuple[type, ...]) -> bool:
    """Whether ``module`` is one of ``kinds`` with that class's own forward (a subclass that
    rewrites it may not behave so)."""
    kind = next((k for k in kinds if isinstance(module, k)), None)
    return kind is not None and type(module).forward is kind.forward


def _takes_every_row(module: nn.Module) -> bool:
    if not isinstance(module, nn.Embedding):
        return True
    return module.padding_idx is None and not module.sparse


class Vouchers:
    """Activation gradients that a bias's gradient vouches for, read in the hooks.

    The output's gradient is held until the bias's gradient arrives, which the autograd engine
    computes right after it, and read as before if the bias's is not finite, or if it never
    arrives (``torch.autograd.grad``, a frozen bias). A bias gradient that accumulates
    (gradient accumulation, a module called twice) vouches just as well: a sum of values of
    which one is not finite is not finite. Only modules whose ``forward`` is their class's
    own are trusted, and no activation that works in place.
    """

    def __init__(self, model: nn.Module, budget: int) -> None:
        self.budget = budget
        """The bytes the held gradients may take at once (the session's ``retain_bytes``)."""
        self.held = 0
        names = {id(p): name for name, p in model.named_parameters()}
        uses: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        self.bias_of: dict[str, str] = {}
        """Module path -> the name of the bias whose gradient vouches for its output's."""
        self.voucher_of: dict[str, str] = {}
        """Module path -> the parameter whose gradient vouches for its output's at the end of
        the pass: its bias, else its weight (a parameter shared by two modules never)."""
        for path, module in model.named_modules():
            bias = getattr(module, "bias", None)
            if (
                isinstance(bias, nn.Parameter)
                and id(bias) in names
                and _own_forward(module, SUMMED_INTO_BIAS)
            ):
                self.bias_of[path] = names[id(bias)]
            for name in ("bias", "weight"):
                p = getattr(module, name, None)
                if not (isinstance(p, nn.Parameter) and id(p) in names and uses[id(p)] == 1):
                    continue
                kinds = SUMMED_INTO_BIAS if name == "bias" else MULTIPLIED_INTO_WEIGHT
                if _own_forward(module, kinds) and _takes_every_row(module):
                    self.voucher_of[path] = names[id(p)]
                    break
        self.passes_on = {path for path, module in model.named_modules()
                          if _passes_nonfinite_on(module)}  # fmt: skip
        """Module paths whose input's voucher vouches for their output's gradient too."""
        self.awaiting: dict[str, list[ActGradNote]] = {}
        """Bias name -> the notes of the gradients it will vouch for, each holding its gradient."""

    def hold(self, forward: Record, grad: torch.Tensor, params: dict[str, Any],
             same: ActGradNote | None = None) -> ActGradNote | None:  # fmt: skip
        """A note holding ``grad`` until its module's bias gradient vouches for it; None when
        no bias will (the gradient is then screened where it is). ``same``: the note of an
        earlier gradient that is this very tensor, vouched for with it."""
        bias = self.voucher(forward, self.bias_of)
        param = params.get(bias) if bias is not None else None
        nbytes = grad.nbytes
        if param is None or not param.param.requires_grad or self.held + nbytes > self.budget:
            return None
        self.held += nbytes
        note = ActGradNote(forward, grad.shape, grad.dtype, grad)
        waiting = self.awaiting.setdefault(bias, [])
        if same is not None:
            self.held += nbytes
            waiting.append(same)
        waiting.append(note)
        return note

    def voucher(self, forward: Record, table: dict[str, str] | None = None) -> str | None:
        """The parameter of ``table`` (the biases, by default) whose gradient will vouch for
        the gradient of ``forward``, if any."""
        table = self.bias_of if table is None else table
        made_by = forward.producer  # set for a module's outputs only
        for _ in range(CHAIN + 1):
            if made_by is None:
                return None
            found = table.get(made_by.path)
            if found is not None or made_by.path not in self.passes_on or len(made_by.inputs) != 1:
                return found
            made_by = made_by.inputs[0][1].producer  # what made its input: whose bias sums it
        return None

    def settle(self, name: str, grad: torch.Tensor) -> bool:
        """Parameter ``name``'s gradient arrived: if it is a bias others wait for and it is
        finite, their gradients are finite and let go. False when it is not finite."""
        notes = self.awaiting.pop(name, None)
        if notes is None:
            return True
        self.held -= sum(note.grad.nbytes for note in notes)
        if host_stats(grad, SCREEN)[0] != 1.0:
            return False  # the notes keep their gradients, to be read
        for note in notes:
            note.grad = None
        return True

    def unsettled(self) -> list[ActGradNote]:
        """The notes whose bias gradient never came this pass (and forget them)."""
        notes = [note for waiting in self.awaiting.values() for note in waiting]
        self.awaiting, self.held = {}, 0
        return notes


class Planned:
    """A forward tensor whose gradient a parameter's vouches for: no hook, judged at the end
    of the pass from the voucher's norm. ``forward``: its record, or what stands for it until
    the record is made (engine/pending.py)."""

    __slots__ = ("box", "carried", "dtype", "forward", "handle", "node", "output_nr", "owner",
                 "voucher")  # fmt: skip

    def __init__(self, forward: Any, node: Any, output_nr: int, dtype: str, voucher: str,
                 owner: str, carried: bool = False):  # fmt: skip
        self.forward = forward
        self.node = node
        self.output_nr = output_nr
        self.dtype = dtype
        self.voucher = voucher  # the parameter's name
        self.owner = owner  # the path of the module whose call adds into it
        self.carried = carried
        """Vouched for by being carried on to a vouched tensor (:func:`~.carrying.carried_to`):
        it reaches that one whole, so a finite voucher says it is finite; but that one's
        gradient may hold others too (``x + f(x)``: ``x``'s gradient adds ``f``'s backward), so
        a voucher that is not finite says nothing of it by itself: it is kept and read then,
        or judged from the graph (:meth:`GradientPlan._carried_verdicts`)."""
        self.box: list[tuple] | None = None
        """A carried one's: the gradients its node received, in the pass that ran it (see
        :meth:`GradientPlan.keep`)."""
        self.handle: Any = None
        """The hook that fills :attr:`box`."""

    def kept(self) -> torch.Tensor | None:
        """A carried one's gradient, as its node received it last (None: not kept)."""
        if not self.box:
            return None
        grads = self.box[-1]
        return grads[self.output_nr] if self.output_nr < len(grads) else None


class GradientPlan:
    """The gradients of the step's forward tensors that the end of the pass vouches for (deferred
    checks on the host): which get a hook, which do not, and what each one's voucher said."""

    def __init__(self, vouchers: Vouchers, params: dict[str, nn.Parameter]) -> None:
        self.vouchers = vouchers
        self.params = params
        self.planned: list[Planned] = []
        """This step's vouched gradients, not yet judged by a pass."""
        self.param_order: dict[str, int] = {}
        """Where each parameter's gradient comes among its module's in autograd's order (a
        Linear's bias before its weight): learned from a module's output once."""
        self._names = {id(p): name for name, p in params.items()}
        self._ordered: set[str] = set()
        self.not_finite: set[str] = set()
        """Parameters whose gradient was not finite at the last pass's end."""
        self._accumulators: dict[int, tuple[torch.Tensor, Any]] = {}
        self.roots: list[Any] = []
        """The output nodes of the forwards whose gradients are planned (kept while some are)."""
        self.take: Callable[[int], bool] = lambda nbytes: False
        """Whether ``nbytes`` more may be kept (the session's phase budget, retain_bytes)."""

    def plan(self, seen: list[tuple[Any, Any, int, str]], calls: dict[str, int],
             roots: list[Any] = ()) -> list[tuple[Any, Any, int]]:  # fmt: skip
        """Split the forward tensors ``seen`` (a record, or what stands for it; the autograd
        node that made it; its output number; its dtype) into those vouched for (kept in the
        plan) and those to hook (returned, with the earlier planned ones that ``calls`` made
        unsound: a module called again). ``roots``: the nodes of the forward's outputs (the
        graph a pass that shows a problem is looked at in)."""
        self.roots += roots
        table = self.vouchers.voucher_of
        hook: list[tuple[Any, Any, int]] = []
        found: dict[tuple[int, int], Planned] = {}
        rest = []
        for forward, node, nr, dtype in seen:
            name = self.vouchers.voucher(forward, table)
            if name is None:
                rest.append((forward, node, nr, dtype))
                continue
            planned = Planned(forward, node, nr, dtype, name, name.rpartition(".")[0])
            found[id(node), nr] = planned
            if forward.producer is not None and forward.producer.path not in self._ordered:
                self._learn_order(forward.producer.path, node)
        self.planned.extend(found.values())
        for forward, node, nr, dtype in rest:
            via = carried_to(node, found, CARRY_DEPTH)
            if via is None:
                hook.append((forward, node, nr))
                continue
            planned = Planned(forward, node, nr, dtype, via.voucher, via.owner, carried=True)
            self.planned.append(planned)
        return hook + self.unsound(calls)

    @staticmethod
    def keep(planned: Planned) -> None:
        """Keep a carried planned tensor's gradient (a reference, not read) until its voucher's
        verdict: read only if that is not finite (its gradient may be finite then). The hook
        is the box's own ``append``, a builtin: no Python runs for it in the backward pass
        (a Python hook there took ~25 us, 13 a step in the benchmark's model). A node with
        several outputs (a split) hands the hook all their gradients, which would be kept
        too: its hook is Python's, keeping its own alone. Registered when a pass starts,
        within the phase's budget (:meth:`not_computed`): a pass that none of the session's
        hooks sees keeps none."""
        box: list[tuple] = []
        outputs = getattr(planned.node, "_input_metadata", ())  # (torch >= 2.1)
        hook = box.append if len(outputs) == 1 else partial(_keep_one, box, planned.output_nr)
        planned.box, planned.handle = box, planned.node.register_prehook(hook)

    def unsound(self, calls: dict[str, int]) -> list[tuple[Any, Any, int]]:
        """The planned gradients whose voucher can no longer vouch (taken out of the plan): its
        module called again, or its gradient not finite already (an earlier pass of gradients
        that accumulate: a sum of which one is not finite says nothing of the others)."""
        keep, out = [], []
        for p in self.planned:
            param = self.params.get(p.voucher)
            sound = (
                param is not None
                and param.requires_grad
                and calls.get(p.owner, 0) <= 1
                and p.dtype in _WIDE_NAMES
                and (p.voucher not in self.not_finite or param.grad is None)
            )
            (keep if sound else out).append(p)
        self.planned = keep
        return _released(out)

    def not_computed(self) -> list[tuple[Record, Any, int]]:
        """At a pass's start: the planned gradients this pass computes while their voucher's
        gradient is not computed (``torch.autograd.grad``, ``backward(inputs=...)``), taken out
        of the plan, to be hooked. The carried ones it computes with their voucher's get the
        hook that keeps their gradient (:meth:`keep`), within the phase's budget: before any
        of their nodes runs, for the model's outputs come first in the pass."""
        will = torch._C._will_engine_execute_node
        executes: dict[str, bool] = {}
        keep, out = [], []
        for p in self.planned:
            if not will(p.node):
                keep.append(p)  # not in this pass
                continue
            ok = executes.get(p.voucher)
            if ok is None:
                param = self.params[p.voucher]
                ok = executes[p.voucher] = param.requires_grad and will(self._accumulator(param))
            (keep if ok else out).append(p)
            if ok and p.carried and p.box is None and self.take(p.forward.nbytes):
                self.keep(p)  # within the phase's budget: its gradient is kept
        self.planned = keep
        return _released(out)

    def judged(
        self, finite: dict[str, bool]
    ) -> tuple[list[Planned], list[Planned], list[Planned], list[tuple[Planned, torch.Tensor]]]:
        """At a pass's end, given which parameter gradients the pass made and whether each is
        finite: the planned gradients they vouch for (taken out of the plan), those whose
        voucher is finite, those whose voucher is not (so neither are they), those whose
        voucher is not finite but says nothing of them (carried on to a gradient that holds
        others too: not read, no verdict), and those kept for it, with their gradient, to be
        read and judged as they are. The forward saved no NaN or Inf (else every gradient was
        hooked: :meth:`~.backward.BackwardPhase.plan_gradients`), so the nodes on the way make
        none of their own."""
        keep, clean, bad = [], [], []
        for p in self.planned:
            ok = finite.get(p.voucher)
            if ok is None:
                keep.append(p)  # its voucher got no gradient in this pass: a later one's
            else:
                (clean if ok else bad).append(p)
        self.planned = keep
        unread: list[Planned] = []
        read: list[tuple[Planned, torch.Tensor]] = []
        if any(p.carried for p in bad):
            guessed = []
            for p in bad:
                grad = p.kept() if p.carried else None
                if grad is None:
                    guessed.append(p)
                else:
                    read.append((p, grad))
            bad, more_clean, unread = self._carried_verdicts(clean, guessed, finite)
            clean += more_clean
        if not keep:
            self.roots = []
        _released(clean + bad + unread + [p for p, _ in read])
        return clean, bad, unread, read

    def _carried_verdicts(self, clean: list[Planned], bad: list[Planned],
                          finite: dict[str, bool]
                          ) -> tuple[list[Planned], list[Planned], list[Planned]]:  # fmt: skip
        """The carried gradients of ``bad`` judged again, from every vouched tensor they reach
        through carrying nodes (not only the nearest): finite when one of those is vouched
        finite (it holds the whole of theirs); not finite when one whose voucher is not gets
        nothing but theirs (every node on the way there, and that tensor, is fed only from
        nodes on the way: :func:`~.carrying.fed_by`); else not known. Only on a pass that
        showed a problem: it walks the whole graph."""
        targets = {(id(p.node), p.output_nr): finite[p.voucher] for p in clean + bad
                   if not p.carried}  # fmt: skip
        carried = [p for p in bad if p.carried]
        consumers = graph_consumers(self.roots + [p.node for p in carried])
        still_bad, now_clean, unread = [p for p in bad if not p.carried], [], []
        for p in carried:
            reached = reached_from(p.node, targets, CARRY_DEPTH)
            if any(targets[key] for key in reached):
                now_clean.append(p)
            elif any(fed_by(p.node, key, consumers, CARRY_DEPTH) for key in reached):
                still_bad.append(p)
            else:
                unread.append(p)
        return still_bad, now_clean, unread

    def clear(self) -> None:
        _released(self.planned)
        self.planned, self.roots = [], []

    def _accumulator(self, param: torch.Tensor) -> Any:
        """The autograd node that accumulates ``param``'s gradient, kept: the same one from
        step to step (torch keeps it only while a graph uses it, and would make a new one)."""
        known = self._accumulators.get(id(param))
        if known is None or known[0] is not param:
            known = self._accumulators[id(param)] = (param, get_gradient_edge(param).node)
        return known[1]

    def forget(self) -> None:
        """Let go of every parameter (at detach)."""
        _released(self.planned)
        self.planned, self.params, self._names = [], {}, {}
        self._accumulators, self.roots = {}, []

    def _learn_order(self, path: str, node: Any) -> None:
        """The order in which autograd accumulates module ``path``'s parameter gradients, from
        its output's node: nearest first, then as the node lists its inputs (what a pass that
        shows a problem is sorted by, since these gradients have no hook)."""
        self._ordered.add(path)
        frontier, rank = [node], 0
        for _ in range(3):
            following = []
            for fn in frontier:
                for nxt, _ in fn.next_functions:
                    if nxt is None:
                        continue
                    name = self._names.get(id(getattr(nxt, "variable", None)))
                    if name is not None and name.rpartition(".")[0] == path:
                        self.param_order.setdefault(name, rank)
                        rank += 1
                    else:
                        following.append(nxt)
            frontier = following


def _released(planned: list[Planned]) -> list[tuple[Any, Any, int]]:
    """Planned gradients taken out of the plan let go of their nodes: each forward tensor, its
    node and output number. A carried one's hook is removed and its box emptied: the node
    would keep the gradients it holds (a graph kept for another pass would add more); and a
    Planned that held its node while a hook held the Planned made a cycle through autograd's
    C++ that Python's collector cannot break (a step's graph kept alive at each step)."""
    taken = []
    for p in planned:
        taken.append((p.forward, p.node, p.output_nr))
        p.node = None
        if p.handle is not None:
            p.handle.remove()
            p.handle = p.box = None
    return taken


@own_work
def _keep_one(box: list[tuple], output_nr: int, grads: tuple) -> None:
    """The hook of a carried planned tensor made by a node with several outputs: its own
    gradient kept, in its place (:meth:`Planned.kept`)."""
    if output_nr < len(grads):
        box.append((None,) * output_nr + (grads[output_nr],))


_WIDE_NAMES = frozenset(str(d).removeprefix("torch.") for d in WIDE)
