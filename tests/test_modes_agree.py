"""Every sync mode tells the same story, on models nobody wrote by hand: random compositions of
linear layers, activations, norms, attention, gates, a layer called twice, residual blocks,
nested containers and a parent's own code, with one fault planted at a random place (a NaN made
by a forward, by a backward alone, or by a forward that hides it from its output; in a module
or in the parent's code between its children).
Two steps each: the fault's step, and the next, whose weights the first step's update made NaN.

Eager checks read every tensor where it is made; batched and deferred checks (the CPU's default)
read less and reason about the rest (engine/vouching.py, engine/carrying.py). Each mode must
name the same origins and hit the same tensors as eager checks. Before this suite, deferred
checks named another origin, hit a finite gradient or missed a NaN on 128 of these 150 models
(model 114 needs the gradients carried on to a bad voucher kept and read: engine/vouching.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEFERRED_ON_DEVICE
from torch import nn

from tensordbg.rules import NaN

MODES = ("eager", "batched", "deferred", DEFERRED_ON_DEVICE)
WIDTH = 8
MODELS = 150


class NaNBackward(nn.Module):
    """Finite forward; its backward makes NaN (sqrt's derivative at 0 is 1/0, times 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x * 0)


class NaNForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan")


class MaskedNaN(nn.Module):
    """A NaN its forward hides (``nan_to_num``): its output is finite, its backward is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nan_to_num(x * float("nan"))


class Residual(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class ParentCode(nn.Module):
    """Two children, and code of its own between them that may make the fault."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.a, self.b, self.fault = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.fault == "forward":
            h = h * float("nan")
        elif self.fault == "backward":
            h = h + torch.sqrt(h * 0)
        elif self.fault == "hidden":
            h = h + torch.nan_to_num(h * float("nan"))
        return self.b(torch.tanh(h))


class Attention(nn.Module):
    """Fused attention over two heads of one position: its backward carries a gradient on."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, 1, 3, 2, 4).unbind(2))
        attended = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(attended.transpose(1, 2).reshape(b, WIDTH))


class Twice(nn.Module):
    """One Linear called twice: its bias's gradient sums two output gradients."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * torch.sigmoid(self.b(x))


LEAVES = (
    lambda: nn.Linear(WIDTH, WIDTH),
    lambda: nn.Tanh(),
    lambda: nn.GELU(),
    lambda: nn.LayerNorm(WIDTH),
    lambda: nn.Linear(WIDTH, WIDTH),
    lambda: nn.SiLU(),
    lambda: nn.Identity(),
    lambda: nn.ReLU(),
    lambda: nn.Softmax(-1),
    lambda: nn.Dropout(0.0),
    lambda: nn.Linear(WIDTH, WIDTH, bias=False),
    Attention,
    Twice,
    Gated,
)


def _fault(kind: str) -> nn.Module:
    return {"backward": NaNBackward, "forward": NaNForward, "hidden": MaskedNaN}[kind]()


def _body(rng: random.Random, depth: int, faults: list[str]) -> nn.Sequential:
    parts: list[nn.Module] = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if depth < 2 and r < 0.25:
            parts.append(Residual(_body(rng, depth + 1, faults)))
        elif depth < 2 and r < 0.4:
            parts.append(_body(rng, depth + 1, faults))
        elif depth < 2 and r < 0.5 and faults and rng.random() < 0.5:
            parts.append(ParentCode(faults.pop()))
        else:
            parts.append(rng.choice(LEAVES)())
        if faults and rng.random() < 0.2:
            parts.append(_fault(faults.pop()))
    return nn.Sequential(*parts)


def random_model(seed: int) -> nn.Sequential:
    rng = random.Random(seed)
    faults = [rng.choice(["backward", "forward", "hidden"])]
    body = _body(rng, 0, faults)
    if faults:  # not placed yet: somewhere at the top
        parts = list(body)
        parts.insert(rng.randint(0, len(parts)), _fault(faults.pop()))
        body = nn.Sequential(*parts)
    return nn.Sequential(nn.Linear(4, WIDTH), body, nn.Linear(WIDTH, 2))


def story(watch, seed: int, sync: str) -> tuple[list, list]:
    """The origins and the hits of two steps of model ``seed`` in mode ``sync``."""
    torch.manual_seed(seed)
    model = random_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=opt, on_hit="record", rules=[NaN()], sync=sync)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    session.flush()
    assert not session.broken, session.broken
    origins = [(h.step, h.tensor) for h in session.hits if h.origin]
    hits = sorted({(h.step, h.phase, h.tensor) for h in session.hits})
    session.detach()
    return origins, hits


@pytest.mark.parametrize("seed", range(MODELS))
def test_every_mode_names_the_same_origins_and_hits_on_a_random_model(watch, seed):
    eager = story(watch, seed, "eager")
    assert eager[0], f"model {seed}: no origin named\n{random_model(seed)}"
    for sync in MODES[1:]:
        assert story(watch, seed, sync) == eager, f"{sync}, model {seed}:\n{random_model(seed)}"
