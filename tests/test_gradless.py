"""Trainable parameters an optimizer steps that never get a gradient (engine/gradless.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tensordbg
from tensordbg.engine.gradless import WATCH_STEPS


class Checkpointed(nn.Module):
    """``use_reentrant=True`` with an input that needs no gradient: ``enc`` never gets one."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.enc, x, use_reentrant=self.reentrant))


def train(reentrant: bool, sync: str, steps: int = WATCH_STEPS) -> tuple[list[str], list]:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = tensordbg.attach(model, optimizer=opt, on_hit="record", server=False, sync=sync,
                               summary_at_exit=False)  # fmt: skip
    logged: list[str] = []
    session.bus.subscribe(lambda e, p: logged.append(p["message"]), events={"log"})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own "None of the inputs have requires_grad"
            for _ in range(steps):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        session.detach()
    return [m for m in logged if "had no gradient" in m], session.hits


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_an_encoder_that_never_gets_a_gradient_is_named_once(sync, capsys):
    """A checkpointed encoder with use_reentrant=True and no input needing a gradient never
    trained, and tensordbg said nothing in 50 steps (found on a real script)."""
    said, hits = train(reentrant=True, sync=sync, steps=WATCH_STEPS + 20)
    assert len(said) == 1 and "enc.weight, enc.bias" in said[0], said
    assert "head" not in said[0] and not hits
    assert capsys.readouterr().err.count("had no gradient") == 1
    assert not train(reentrant=True, sync=sync, steps=WATCH_STEPS - 1)[0]  # not before


def test_a_training_whose_parameters_all_learn_names_none():
    said, hits = train(reentrant=False, sync="deferred", steps=WATCH_STEPS + 5)
    assert not said and not hits


def test_a_module_left_out_of_the_optimizer_is_not_said_to_be_stepped(capsys):
    """A submodule the forward does not call and the optimizer does not hold: "2 trainable
    parameters the optimizer steps had no gradient: aux.weight, aux.bias ... Give the
    optimizer only what trains" was said of a script that did just that."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.aux, self.head = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([*model.body.parameters(), *model.head.parameters()], lr=0.01)
    session = tensordbg.attach(model, optimizer=opt, on_hit="record", server=False,
                               summary_at_exit=False)  # fmt: skip
    try:
        for _ in range(WATCH_STEPS + 2):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        session.detach()
    assert "had no gradient" not in capsys.readouterr().err
