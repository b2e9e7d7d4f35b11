"""Deferred checks on the host vouch for an activation's gradient with a parameter's gradient that
takes every element of it (tensordbg/engine/vouching.py): such gradients get no hook and are not
read in a clean pass. Each claim that rests on is checked on torch here, and a backward NaN is
still named where eager checks name it, where a voucher stands and where none can."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
from conftest import DEFERRED_ON_DEVICE
from models import SqrtOfSquare
from torch import nn
from torch.nn import functional as F

from tensordbg.engine.carrying import CARRY_NODES
from tensordbg.engine.vouching import Vouchers
from tensordbg.rules import NaN, Overflow

MODES = ("eager", "batched", "deferred", DEFERRED_ON_DEVICE)
BAD = [float("nan"), float("inf"), float("-inf")]

# Each module whose parameter vouches for its output's gradient, with an input for it (zeros
# where a product with an input value could hide a NaN: NaN * 0 is NaN all the same).
VOUCHING = {
    "linear": (lambda: nn.Linear(6, 4), lambda: torch.randn(5, 6)),
    "linear without bias": (lambda: nn.Linear(6, 4, bias=False), lambda: torch.zeros(5, 6)),
    "padded conv2d": (lambda: nn.Conv2d(3, 2, 3, padding=1, bias=False),
                      lambda: torch.randn(2, 3, 4, 4)),
    "strided conv2d": (lambda: nn.Conv2d(3, 2, 3, stride=2, padding=1, bias=False),
                       lambda: torch.randn(2, 3, 5, 5)),
    "grouped conv1d": (lambda: nn.Conv1d(4, 4, 3, groups=2, bias=False),
                       lambda: torch.randn(2, 4, 7)),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2, bias=False), lambda: torch.randn(1, 2, 3, 3, 3)),
    "transposed conv2d": (lambda: nn.ConvTranspose2d(2, 2, 3, stride=2, bias=False),
                          lambda: torch.randn(1, 2, 3, 3)),
    "layernorm without bias": (lambda: nn.LayerNorm(6, bias=False), lambda: torch.randn(5, 6)),
    "batchnorm": (lambda: nn.BatchNorm1d(6), lambda: torch.randn(5, 6)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), lambda: torch.randn(2, 4, 5)),
    "embedding": (lambda: nn.Embedding(10, 4), lambda: torch.randint(0, 10, (7,))),
    "embedding by frequency": (lambda: nn.Embedding(10, 4, scale_grad_by_freq=True),
                               lambda: torch.tensor([1, 1, 2, 3, 1])),
}  # fmt: skip


@pytest.mark.parametrize("case", VOUCHING)
@pytest.mark.parametrize("bad", BAD, ids=str)
def test_the_parameter_that_vouches_takes_every_element_of_the_output_gradient(case, bad):
    """Wherever the output's gradient holds one NaN or Inf, the voucher's gradient is not
    finite: a finite one proves the output's gradient finite."""
    make_module, make_input = VOUCHING[case]
    torch.manual_seed(0)
    module = make_module()
    voucher = module.get_parameter(Vouchers(module, 0).voucher_of[""])
    x = make_input()
    shape = module(x).shape
    for index in itertools.product(*map(range, shape)):
        module.zero_grad(set_to_none=True)
        grad = torch.zeros(shape)
        grad[index] = bad
        module(x).backward(grad)
        assert not voucher.grad.isfinite().all(), index


def _carried(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """An operation making each node of CARRY_NODES, on ``a`` (and ``b``)."""
    return {
        "AddBackward0": a + b, "SubBackward0": a - b, "RsubBackward0": torch.rsub(a, b),
        "RsubBackward1": 1 - a, "MulBackward0": a * b, "DivBackward0": a / b,
        "NegBackward0": -a, "CloneBackward0": a.clone(), "ToCopyBackward0": a.double(),
        "ViewBackward0": a.view(12),
        "UnsafeViewBackward0": torch.ops.aten._unsafe_view(a * 1, [12]),
        "TransposeBackward0": a.transpose(0, 1), "TransposeBackward1": (a * 1).transpose_(0, 1),
        "PermuteBackward0": a.permute(1, 0), "ExpandBackward0": a[:1].expand(3, 4),
        "UnsqueezeBackward0": a.unsqueeze(0), "SqueezeBackward0": a.unsqueeze(0).squeeze(),
        "SqueezeBackward1": a.unsqueeze(0).squeeze(0), "SqueezeBackward2": a[None].squeeze((0,)),
        "SelectBackward0": a[1], "SliceBackward0": a[1:], "GeluBackward0": F.gelu(a * 30),
        "SiluBackward0": F.silu(a * 30), "TanhBackward0": torch.tanh(a * 30),
        "SigmoidBackward0": torch.sigmoid(a * 30), "SoftplusBackward0": F.softplus(a * 30),
        "EluBackward0": F.elu(a * 30), "LeakyReluBackward0": F.leaky_relu(a * 30, 0.0),
        "MishBackward0": F.mish(a * 30),
        "NativeDropoutBackward0": torch.native_dropout(a, 0.5, True)[0],
        "UnbindBackward0": a.unbind(0)[1], "SplitBackward0": a.split(2)[1],
        "SplitWithSizesBackward0": a.split([1, 2])[1],
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(CARRY_NODES))
@pytest.mark.parametrize("bad", BAD, ids=str)
def test_each_carrying_node_is_what_torch_makes_and_keeps_a_nan_in_each_inputs_gradient(name, bad):
    """A residual's addition, a view, an activation: one NaN or Inf in the gradient they get
    is one in the gradient of each of their inputs, even where the factor is 0 (an activation
    saturated at 30 standard deviations, a dropped element, a slope of 0)."""
    torch.manual_seed(0)
    a = torch.randn(3, 4, requires_grad=True)
    b = (torch.rand(3, 4) + 0.5).requires_grad_()
    out = _carried(a, b)[name]
    assert type(out.grad_fn).__name__ == name
    inputs = [a, b] if name in ("AddBackward0", "SubBackward0", "RsubBackward0", "MulBackward0",
                                "DivBackward0") else [a]  # fmt: skip
    for index in itertools.product(*map(range, out.shape)):
        grad = torch.zeros(out.shape, dtype=out.dtype)
        grad[index] = bad
        for g in torch.autograd.grad(out, inputs, grad, retain_graph=True):
            assert not g.isfinite().all(), index


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["random", "zero keys", "zero values", "zero queries",
                                  "saturated softmax", "all zero"])  # fmt: skip
def test_attention_hands_a_nan_in_its_outputs_gradient_to_its_querys_keys_and_values(case, causal):
    """ATTENTION_NODES: one NaN or Inf anywhere in the gradient of attention's output (the
    fused CPU kernel, no dropout) is one in the gradients of the query, the key and the value,
    also where a factor is zero (keys, values or queries all zero, a softmax saturated to 0/1)."""
    from tensordbg.engine.carrying import ATTENTION_NODES

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3) for _ in range(3))
    if case in ("zero keys", "all zero"):
        k.zero_()
    if case in ("zero values", "all zero"):
        v.zero_()
    if case in ("zero queries", "all zero"):
        q.zero_()
    if case == "saturated softmax":
        q, k = q * 100, k * 100
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert type(out.grad_fn).__name__ in ATTENTION_NODES
    for bad in BAD:
        for index in itertools.product(*map(range, out.shape)):
            grad = torch.zeros(out.shape)
            grad[index] = bad
            for g in torch.autograd.grad(out, inputs, grad, retain_graph=True):
                assert not g.isfinite().all(), (bad, index)


def test_which_parameter_vouches_for_which_module():
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # rewritten: not trusted
            return super().forward(x) * 2

    tied = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.Linear(4, 4, bias=False),
        Scaled(4, 4),
        nn.Conv2d(1, 1, 3, bias=False),
        nn.Embedding(4, 4),
        nn.Embedding(4, 4, padding_idx=0),  # a padding row's gradient is dropped
        nn.Embedding(4, 4, sparse=True),
        tied,
        nn.Sequential(tied),  # the same weight in two places: its gradient sums both
        nn.LayerNorm(4),
    )
    assert Vouchers(model, 0).voucher_of == {
        "0": "0.bias", "1": "1.weight", "3": "3.weight", "4": "4.weight", "9": "9.bias",
    }  # fmt: skip


def _nan_behind(first: list[nn.Module]) -> nn.Sequential:
    """sqrt's backward makes NaN in the gradient of what ``first`` returns (their weights and
    biases are zero, so sqrt's input is 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(*first, SqrtOfSquare(), nn.Flatten(), nn.LazyLinear(2))
    with torch.no_grad():
        for module in first:
            for p in module.parameters(recurse=False):
                p.zero_()
    return model


CASES = {
    # The Linear's weight vouches for its output's gradient: sqrt is named all the same.
    "bias-free linear": (lambda: _nan_behind([nn.Linear(4, 4, bias=False)]),
                         lambda: torch.randn(3, 4), "1"),
    # A convolution without bias, then BatchNorm: the norm's bias vouches, then the weight.
    "conv and batchnorm": (lambda: _nan_behind([nn.Conv2d(1, 2, 3, bias=False),
                                                nn.BatchNorm2d(2)]),
                           lambda: torch.randn(3, 1, 5, 5), "2"),
}  # fmt: skip


@pytest.mark.parametrize("sync", MODES)
@pytest.mark.parametrize("case", CASES)
def test_a_backward_nan_behind_a_voucher_is_named_where_eager_checks_name_it(watch, sync, case):
    make_model, make_input, sqrt = CASES[case]
    model = make_model()
    x = make_input()
    model(x)  # the lazy head takes its shape
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    model(x).sum().backward()
    [origin] = [h for h in session.hits if h.origin]
    assert (origin.module, origin.tensor) == (sqrt, f"{sqrt}.grad_input[0]")


class Attending(nn.Module):
    """Two pre-norm transformer blocks (fused attention, a residual stream) and a head."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln1": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim),
                           "proj": nn.Linear(dim, dim), "ln2": nn.LayerNorm(dim),
                           "mlp": nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                nn.Linear(2 * dim, dim))})
            for _ in range(2)
        )  # fmt: skip
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        for block in self.blocks:
            qkv = block["qkv"](block["ln1"](x)).view(b, t, 3, self.heads, d // self.heads)
            q, k, v = (u.transpose(1, 2) for u in qkv.unbind(2))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["proj"](attn.transpose(1, 2).reshape(b, t, d))
            x = x + block["mlp"](block["ln2"](x))
        return self.head(self.ln(x))


@pytest.mark.parametrize("sync", MODES)
def test_an_overflow_in_a_residual_blocks_backward_is_named_where_eager_checks_name_it(watch, sync):
    """The second block's output projection makes an Inf in its input's gradient (a huge weight
    column, a zero input column: its forward is finite); everything before it in the backward
    pass is finite. The residual stream's gradients are vouched for by the nearest bias (the
    block's last Linear, which sums exactly them), not by the embedding-side parameters that
    the Inf reaches later: no mode names a gradient of the stream, nearer the loss, instead."""
    torch.manual_seed(0)
    model = Attending()
    proj, qkv = model.blocks[1]["proj"], model.blocks[1]["qkv"]
    with torch.no_grad():
        proj.weight[:, 3] = 3e38
        qkv.weight[2 * 32 + 3] = 0.0  # the value's column 3, hence the attention's: zero
        qkv.bias[2 * 32 + 3] = 0.0
    session = watch(model, on_hit="record", rules=[NaN(), Overflow()], sync=sync)
    out = model(torch.randn(2, 6, 32))
    assert out.isfinite().all()
    (out.sum() * 1e5).backward()
    origins = [(h.module, h.tensor) for h in session.hits if h.origin]
    assert origins == [("blocks.1.proj", "blocks.1.proj.grad_input[0]")]


class Twice(nn.Module):
    """One Linear called twice: its bias's gradient sums two output gradients, so it vouches
    for neither (a NaN in one would be taken for one in the other)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.sqrt, self.head = nn.Linear(4, 4), SqrtOfSquare(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.sqrt(self.shared(x))))


@pytest.mark.parametrize("sync", MODES)
def test_a_module_called_twice_vouches_for_neither_call(watch, sync):
    torch.manual_seed(0)
    model = Twice()
    with torch.no_grad():
        model.shared.weight.zero_()
        model.shared.bias.zero_()
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    model(torch.randn(3, 4)).sum().backward()
    [origin] = [h for h in session.hits if h.origin]
    assert (origin.module, origin.tensor) == ("sqrt", "sqrt.grad_input[0]")


@pytest.mark.parametrize("sync", MODES)
def test_a_pass_that_computes_only_some_parameter_gradients_reads_what_they_cannot_vouch(
    watch, sync
):
    """``backward(inputs=[first Linear's weight])`` computes no bias gradient: the gradients
    the biases would vouch for are hooked when the pass starts, and sqrt is named."""
    model = _nan_behind([nn.Linear(4, 4)])
    x = torch.randn(3, 4)
    model(x)
    session = watch(model, on_hit="record", rules=[NaN()], sync=sync)
    model(x).sum().backward(inputs=[model[0].weight])
    [origin] = [h for h in session.hits if h.origin]
    assert (origin.module, origin.tensor) == ("1", "1.grad_input[0]")
    assert model[0].bias.grad is None


@pytest.mark.parametrize("sync", MODES)
def test_a_backward_pass_no_hook_sees_is_checked_before_the_update(watch, sync):
    """A penalty on a weight alone reaches no watched activation: its pass ends unseen, and
    the NaN it puts in the weight's gradient is found at the optimizer's step, before the
    update, in the backward phase of that step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[NaN()], sync=sync)
    model(torch.randn(3, 4))  # an evaluation whose output goes nowhere
    with torch.no_grad():
        model[0].weight[0, 0] = -1.0
    model[0].weight.sqrt().nansum().backward()  # sqrt(-1): a NaN gradient there
    optimizer.step()
    first = next(h for h in session.hits if h.origin)
    assert (first.tensor, first.step, first.phase) == ("0.weight.grad", 0, "backward")


@pytest.mark.parametrize("budget", [1 << 20, 0])
def test_a_carried_gradient_is_kept_by_its_nodes_hook_alone_within_the_budget(budget):
    """A carried planned tensor's gradient is kept as its node received it, its own alone (a
    split's other output's is not held), by a hook its pass registers when it starts, while
    the phase's budget allows; once judged, the hook is gone and nothing is held."""
    from types import SimpleNamespace

    from tensordbg.engine.vouching import GradientPlan, Planned

    model = nn.Linear(4, 4)
    plan = GradientPlan(Vouchers(model, budget), dict(model.named_parameters()))
    taken: list[int] = []
    plan.take = lambda nbytes: (taken.append(nbytes), sum(taken) <= budget)[1]
    x = torch.randn(3, 4, requires_grad=True)
    whole = x * 3  # one output
    first, second = (x * 5).split(2, dim=1)  # a node with two outputs
    out = model(whole + torch.cat([first * 7, second * 11], 1))
    planned = [Planned(SimpleNamespace(nbytes=t.nbytes), t.grad_fn, t.output_nr, "float32",
                       "weight", "", carried=True) for t in (whole, second)]  # fmt: skip
    plan.planned = list(planned)
    out.grad_fn.register_prehook(lambda grads: (plan.not_computed(), None)[1])
    out.sum().backward()
    assert taken == [whole.nbytes, second.nbytes]
    kept = [p.kept() for p in planned]
    if budget:
        expected = model.weight.sum(0).expand(3, 4)  # d out.sum() / d whole
        torch.testing.assert_close(kept[0], expected)
        torch.testing.assert_close(kept[1], 11 * expected[:, 2:])
        assert planned[1].box[-1][0] is None  # the split's first output: not held
    else:
        assert kept == [None, None]
    plan.judged({"weight": True})
    assert all(p.kept() is None and p.handle is None for p in planned)


def test_a_clean_step_keeps_no_plan_and_reads_no_vouched_gradient(watch, monkeypatch):
    """The GPT of the tests: in its clean steps only the attention's output gradients (made
    by code between modules, which no parameter takes whole) are read in their hooks, and
    nothing of the plan outlives the step (its autograd nodes)."""
    from models import train_gpt

    from tensordbg.engine import backward

    read: list[str] = []
    real = backward.BackwardPhase._screen_in_hook

    def spy(self, forward, grad):
        read.append(self._record_of(forward).stats.name)
        return real(self, forward, grad)

    monkeypatch.setattr(backward.BackwardPhase, "_screen_in_hook", spy)
    _, session = train_gpt(lambda m, o: watch(m, optimizer=o, on_hit="record"), steps=3)
    assert session.hits == [] and session.plan.planned == []
    per_step = sorted(set(read))
    assert len(read) == 3 * len(per_step)
    assert all(".attn.proj.input" in name for name in per_step), per_step


def test_no_step_leaves_its_autograd_graph_behind(watch):
    """A carried tensor's hook holds what stands for it in the plan, which held its autograd
    node: a cycle through autograd's C++ that Python's collector cannot break. Each step kept
    its graph's nodes alive, a few dozen Python objects more a step for the whole training."""
    from models import gpt_step

    from tensordbg.demo import TinyGPT, batches

    torch.manual_seed(0)
    model = TinyGPT(dim=32, heads=2, layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    session = watch(model, optimizer=optimizer, on_hit="record")

    def alive() -> int:
        gc.collect()
        return sum(type(o).__name__.endswith("Backward0") or type(o).__name__ == "Planned"
                   for o in gc.get_objects())  # fmt: skip

    data = list(batches(12, -1, seed=0))
    for tokens in data[:4]:
        gpt_step(model, optimizer, tokens, session)
    before = alive()
    for tokens in data[4:]:
        gpt_step(model, optimizer, tokens, session)
    assert session.hits == [] and session.plan is not None
    assert alive() == before


class NaNRowSGD(torch.optim.Optimizer):
    """Plain SGD whose update at step ``at`` writes NaN into row ``row`` of the first parameter,
    from finite gradients (an optimizer's own arithmetic: eps=0 on rows with no gradient, say).
    Its own step, not SGD's through super(): torch runs the step hooks of each class's step."""

    def __init__(self, params, at: int, row: int) -> None:
        super().__init__(params, {"lr": 0.01})
        self.at, self.row, self.steps = at, row, 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        if self.steps == self.at:
            self.param_groups[0]["params"][0][self.row] = float("nan")
        self.steps += 1


class TableAndSpares(nn.Module):
    """An embedding table and nine more parameters of its size: a rotating eighth of the
    parameters' bytes is two of them a step, the table's turn every fifth step (0, 5, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(1000, 16)
        self.spares = nn.ModuleList(nn.Linear(16, 1000, bias=False) for _ in range(9))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


@pytest.mark.parametrize("used", [False, True])
def test_a_nan_an_update_writes_outside_the_sample_is_found(watch, used):
    """After a clean step's update, deferred checks read each parameter's sample and a rotating
    eighth of them whole. A NaN the update of step 2 writes in a row outside the sample is
    found by the forward that uses it (step 3), which names the parameter; when no forward
    uses it, by the rotation (the table's turn, at step 5, within ROTATION steps)."""
    from tensordbg.engine.params import ROTATION

    torch.manual_seed(0)
    model = TableAndSpares()
    optimizer = NaNRowSGD(model.parameters(), at=2, row=999)  # not among the sampled elements
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[NaN()])
    for step in range(2 + ROTATION):
        tokens = torch.randint(0, 999, (32,))
        if used and step == 3:
            tokens[0] = 999
        model(tokens).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    first = next(h for h in session.hits if h.origin)
    assert (first.tensor, first.kind) == ("table.weight", "param")
    assert (first.step, first.phase) == ((3, "forward") if used else (5, "optimizer"))
