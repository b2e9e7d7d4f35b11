"""A training that diverges, and tensordbg catching it. Read this first.

A small regression network trains well for a while; then a learning-rate schedule with a bug
(a warm-up that multiplies instead of adding) raises the learning rate a hundredfold. The
gradients grow, then explode, then overflow into Inf and NaN.

Run it:

    python examples/train_diverging.py              # pauses at the first hit; open the UI with
                                                    # `tensordbg tui` in another terminal
    python examples/train_diverging.py --record     # no pause: prints the hits at the end

tensordbg flags the explosion (ExplodingGradient: a gradient norm far above its running median)
steps before anything overflows, names the module whose gradient it is, and later names where
the first NaN was produced.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import tensordbg


def make_data(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """y = sin(3x) + noise, on x in [-2, 2]: an easy target."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g) * 4 - 2
    y = torch.sin(3 * x) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def learning_rate(step: int) -> float:
    # The bug: from step 40 the "warm-up" multiplies the base rate by 100 instead of ramping it.
    return 1e-2 if step < 40 else 1.0


def main(record: bool = False) -> tensordbg.Session:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 64), nn.Tanh(),
        nn.Linear(64, 64), nn.Tanh(),
        nn.Linear(64, 1),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    x, y = make_data()

    # One line: watch the model and its optimizer with the default rules (NaN, Overflow,
    # ExplodingGradient, VanishingGradient, WeightNotChanging). By default a hit pauses the
    # training right there; "record" only collects the hits in session.hits.
    session = tensordbg.attach(model, optimizer=optimizer, on_hit="record" if record else "pause")

    for step in range(120):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        loss = nn.functional.mse_loss(model(x), y)
        session.observe("loss", loss)  # optional: the loss joins the checks and the UI's curve
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0:
            print(f"step {step:3d}  loss {loss.item():.4g}")

    session.detach()  # removes every hook; `with tensordbg.attach(...) as session:` does it too
    return session


if __name__ == "__main__":
    session = main(record="--record" in sys.argv)
    # Each hit says which rule fired, on which tensor, in which module, at which step, and
    # whether that module produced the problem (origin) or only passed it on.
    for hit in session.hits[:10]:
        print(hit)
    print(f"{len(session.hits)} hits; the first at step {session.hits[0].step}" if session.hits
          else "no hits")  # fmt: skip
