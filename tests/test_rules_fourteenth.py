"""A learning rate of 0 on a step, as a warmup from 0 starts and as a parameter group set to 0
makes it: VanishingGradient does not take a residual branch that no update has lifted yet for a
dead one, and WeightNotChanging counts the step among those the parameter did not change.

Each test runs in every sync mode: the verdicts, and the steps they come at, are the same."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensordbg.rules import VanishingGradient, WeightNotChanging

SYNCS = ["eager", "deferred", "batched", "deferred-on-device"]


def _warmup(optimizer: torch.optim.Optimizer, steps: int = 4):
    """A linear warmup whose first learning rate is exactly 0 (LinearLR refuses a start factor
    of 0, so people write it as a LambdaLR)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, k / steps))


def _mode(sync: str) -> str:
    from conftest import DEFERRED_ON_DEVICE

    return DEFERRED_ON_DEVICE if sync == "deferred-on-device" else sync


# --- VanishingGradient: a zero by construction waits for the first update that moves ---------


class GatedBlock(nn.Module):
    """A pre-norm transformer block whose two residual branches are scaled by gates that start at
    0: ReZero (one number each) or LayerScale (one per channel)."""

    def __init__(self, dim: int, per_channel: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        shape = (dim,) if per_channel else ()
        self.gate1 = nn.Parameter(torch.zeros(shape))
        self.gate2 = nn.Parameter(torch.zeros(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.gate1 * self.attn(h, h, h, need_weights=False)[0]
        return x + self.gate2 * self.mlp(self.norm2(x))


class GatedLM(nn.Module):
    def __init__(self, per_channel: bool, vocab: int = 50, dim: int = 16, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[GatedBlock(dim, per_channel) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["rezero", "layerscale"])
def test_a_gated_residual_branch_under_a_warmup_from_zero_is_not_a_vanishing_gradient(
    watch, sync, per_channel
):
    """The warmup's first learning rate is 0: step 0's update leaves every gate at 0, so the
    branches get exactly zero gradients on step 1 as on step 0; step 1's update (at 1/4 of the
    rate) moves the gates, and they learn from step 2. The default rules said nothing of them
    before 24 parameters (25 in eager mode) were called cut off at steps 1 and 2."""
    torch.manual_seed(0)
    model = GatedLM(per_channel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = _warmup(optimizer)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=_mode(sync))
    branch = model.blocks[1].mlp[0].weight
    zero_at = []
    for step in range(8):
        tokens = torch.randint(0, 50, (8, 12))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        session.observe("loss", loss)
        loss.backward()
        if branch.grad.count_nonzero() == 0:
            zero_at.append(step)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    assert zero_at == [0, 1]  # the fault the rule must not see
    assert [(h.step, h.rule, h.tensor) for h in session.hits] == []


class ZeroInitBlock(nn.Module):
    """torchvision's ``zero_init_residual=True``: the last BatchNorm scale of the block is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        nn.init.zeros_(self.bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("warmup", [False, True], ids=["constant", "warmup from 0"])
def test_a_zero_init_residual_resnet_is_not_a_vanishing_gradient_with_or_without_warmup(
    watch, sync, warmup
):
    """The convolution before each zero scale gets an exactly zero gradient until an update
    moved the scale: on step 0 at a constant learning rate, on steps 0 and 1 under a warmup."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ZeroInitBlock(), ZeroInitBlock(),
                          nn.Flatten(), nn.Linear(4 * 8 * 8, 2))  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = _warmup(optimizer, 2) if warmup else None
    session = watch(model, optimizer=optimizer, on_hit="record", sync=_mode(sync))
    zero_at = []
    for step in range(6):
        x = torch.randn(16, 3, 8, 8)
        loss = nn.functional.cross_entropy(model(x), (x.mean((1, 2, 3)) > 0).long())
        session.observe("loss", loss)
        loss.backward()
        if model[1].conv.weight.grad.count_nonzero() == 0:
            zero_at.append(step)
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    assert zero_at == ([0, 1] if warmup else [0])
    assert [(h.step, h.rule, h.tensor) for h in session.hits] == []


def _dead_branch() -> nn.Sequential:
    """Its second ReLU is dead (weight 0, bias -1): every parameter but the last bias gets
    exactly zero gradients at every step, whatever an update does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.fill_(-1.0)
    return model


DEAD = {"0.weight.grad", "0.bias.grad", "2.weight.grad", "2.bias.grad", "4.weight.grad"}


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("warmup", [False, True], ids=["constant", "warmup from 0"])
def test_a_dead_branch_is_reported_on_the_first_step_after_an_update_moved_something(
    watch, sync, warmup
):
    """A dead branch is still dead once an update moved the model: reported at once, on step 1
    at a constant learning rate; under a warmup from 0, whose first update moves nothing, on
    step 2."""
    model = _dead_branch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = _warmup(optimizer) if warmup else None
    session = watch(model, optimizer=optimizer, on_hit="record", sync=_mode(sync))
    for _ in range(4):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    vanishing = [h for h in session.hits if h.rule == "VanishingGradient"]
    first = 2 if warmup else 1
    assert min(h.step for h in vanishing) == first
    assert {h.tensor for h in vanishing if h.step == first} == DEAD
    assert all("receives no gradient at all" in h.message for h in vanishing)


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_with_no_update_watched_a_dead_branch_is_reported_on_step_1(watch, sync):
    """VanishingGradient alone asks nothing of the updates, so no record of them is made: then
    step 0's update is taken to have moved the model, as before."""
    model = _dead_branch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[VanishingGradient()],
                    sync=sync)  # fmt: skip
    for _ in range(2):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert {h.tensor for h in session.hits if h.step == 1} == DEAD
    assert min(h.step for h in session.hits) == 1


# --- WeightNotChanging: the streak counts from the first unchanged step ------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(model, optimizer, steps: int, rates=None) -> None:
    """``steps`` steps; ``rates(step)`` gives the first group's learning rate for each."""
    for step in range(steps):
        if rates is not None:
            optimizer.param_groups[0]["lr"] = rates(step)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_a_learning_rate_of_zero_from_the_start_is_reported_at_the_third_step(watch, sync, kind):
    """Steps 0, 1 and 2 leave the parameters as they were: found at step 2, once. (Step 0 went
    unmeasured, nothing told to copy the parameters before it: found at step 3.)"""
    model = _mlp()
    optimizer = getattr(torch.optim, kind)(model.parameters(), lr=0.0)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[WeightNotChanging()],
                    sync=_mode(sync))  # fmt: skip
    _train(model, optimizer, 6)
    assert sorted((h.step, h.tensor) for h in session.hits) == [
        (2, "0.bias.update"), (2, "0.weight.update"), (2, "2.bias.update"), (2, "2.weight.update")
    ]  # fmt: skip
    assert {h.value for h in session.hits} == {3.0}


@pytest.mark.parametrize("sync", SYNCS)
def test_a_parameter_left_out_of_the_optimizer_is_reported_at_the_third_step(watch, sync):
    model = _mlp()
    optimizer = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[WeightNotChanging()],
                    sync=_mode(sync))  # fmt: skip
    _train(model, optimizer, 5)
    assert sorted((h.step, h.tensor) for h in session.hits) == [
        (2, "2.bias.update"), (2, "2.weight.update")
    ]  # fmt: skip


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_a_group_set_to_a_learning_rate_of_zero_mid_run_is_reported_at_its_third_step(
    watch, sync, kind
):
    """The first layer learns for steps 0-4, then its group's learning rate is 0: steps 5, 6 and
    7 leave it as it was, found at step 7 (it was found at step 8: step 5 went unmeasured, its
    digest could not tell, and nothing had told to copy it before). The other group learns on."""
    model = _mlp()
    optimizer = getattr(torch.optim, kind)(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.05
    )
    # decayed=0: the rate set to 0 by hand is not a schedule's tail here.
    session = watch(model, optimizer=optimizer, on_hit="record",
                    rules=[WeightNotChanging(decayed=0.0)], sync=_mode(sync))  # fmt: skip
    _train(model, optimizer, 10, rates=lambda step: 0.05 if step < 5 else 0.0)
    assert sorted((h.step, h.tensor) for h in session.hits) == [
        (7, "0.bias.update"), (7, "0.weight.update")
    ]  # fmt: skip


@pytest.mark.parametrize("sync", ["eager", "deferred"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "tolerance"])
def test_a_table_compared_from_a_sample_that_stops_is_reported_at_its_third_step(
    watch, sync, exact
):
    """Adam moves an embedding table everywhere by steps its norm cannot tell within
    MindInsight's tolerance: eager checks compare it from a sample of its elements before each
    step that suspects it. Its learning rate is 0 from step 8: a sample cannot prove that
    nothing moved, so the table is copied whole before step 8, and steps 8, 9 and 10 are found
    unchanged (it was found at step 12 with the tolerance: steps 8 and 9 went unmeasured, and at
    step 11 without: step 8 did)."""
    torch.manual_seed(0)
    model = nn.Embedding(1000, 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tolerance = {} if exact else {"rtol": 1e-5, "atol": 1e-8}
    rule = WeightNotChanging(decayed=0.0, **tolerance)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[rule], sync=sync)
    sampled = []
    for step in range(12):
        optimizer.param_groups[0]["lr"] = 1e-4 if step < 8 else 0.0
        model(torch.randint(0, 1000, (32,))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        sampled.append(bool(session.weights.sample_tells))
    if not exact and sync == "eager":
        assert any(sampled[:8])  # compared from a sample while it moved
    assert [(h.step, h.tensor) for h in session.hits] == [(10, "weight.update")]
