"""Small models and training loops the engine tests plant faults in."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from tensordbg.demo import VOCAB, TinyGPT, batches


class SqrtOfSquare(nn.Module):
    """sqrt(x * x): finite forward, NaN backward where x == 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)


class LogHead(nn.Module):
    """A module whose own code (between its submodules) makes NaN from negative values."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.log(self.inner(x))  # NaN wherever inner(x) < 0
        return self.out(h)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)
    )


class GptRun(NamedTuple):
    """What a training of the demo's model leaves behind."""

    losses: list[torch.Tensor]
    session: Any
    rng_state: torch.Tensor  # the global generator's state once the training is done
    weights: dict[str, torch.Tensor]  # the final state_dict


def run_gpt(session_factory=None, steps: int = 30, bad_step: int = -1, seed: int = 0) -> GptRun:
    """Train the demo's TinyGPT. ``session_factory(model, opt)`` attaches tensordbg (None: a
    bare run)."""
    torch.manual_seed(seed)
    model = TinyGPT(dim=32, heads=2, layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    session = session_factory(model, optimizer) if session_factory else None
    losses = [gpt_step(model, optimizer, t, session) for t in batches(steps, bad_step, seed=seed)]
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return GptRun(losses, session, torch.random.get_rng_state(), weights)


def train_gpt(session_factory=None, steps: int = 30, bad_step: int = -1, seed: int = 0):
    """:func:`run_gpt`, returning (losses, session)."""
    run = run_gpt(session_factory, steps, bad_step, seed)
    return run.losses, run.session


def gpt_step(model, optimizer, tokens, session=None) -> torch.Tensor:
    """One training step of the demo's model on a batch of tokens; returns the loss."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), ignore_index=0)
    if session is not None:
        session.observe("loss", loss)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().clone()


def hanging_rule(module: str) -> tuple[Any, threading.Event, threading.Event]:
    """A rule that hangs on ``module``'s output until ``release`` is set (then never again),
    and ``entered``, set when it starts waiting; with :func:`two_linears`."""
    from tensordbg.rules import Rule
    from tensordbg.statistics import FINITE

    release, entered = threading.Event(), threading.Event()

    class Slow(Rule):
        """Waits on the test: a rule that hangs."""

        kinds = frozenset({"output"})
        needs = (FINITE,)

        def check(self, t, state):
            if t.module == module and not release.is_set():
                entered.set()
                release.wait(30)
            return None

    return Slow(), release, entered


def two_linears() -> nn.Sequential:
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 4))
    model.add_module("fc2", nn.Linear(4, 2))
    return model
