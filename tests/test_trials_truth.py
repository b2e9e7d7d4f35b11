"""What new users' trials found untrue, each in the set-up that showed it: tied weights, a
model compiled before it was watched, a loss with no terms, a NaN the loss code made from an
Inf, and a dumped step that saw what its checks then ignored."""

from __future__ import annotations

import pytest
import torch
from conftest import DEFERRED_ON_DEVICE
from torch import nn

MODES = ("eager", "batched", "deferred", DEFERRED_ON_DEVICE)


class TiedLM(nn.Module):
    """A language model whose head is its embedding (GPT-2's lm_head and wte)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(ids))))


@pytest.mark.parametrize("sync", MODES)
def test_a_tied_weight_set_to_nan_by_hand_is_named_itself_where_the_head_meets_it(watch, sync):
    """Row 19 of a tied embedding set to NaN between steps: no token looks it up, but the head
    multiplies by every row. The head's output was named the origin, "its inputs and
    parameters were clean" (its weight is the embedding's, watched under that name), and
    eager checks never named the weight."""
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                model.emb.weight[19, 0] = float("nan")
        ids = torch.randint(0, 10, (4, 5))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        session.observe("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    first = [(h.step, h.phase, h.tensor) for h in session.hits if h.origin][:1]
    assert first == [(2, "forward", "emb.weight")]
    [head] = [h for h in session.hits if h.step == 2 and h.tensor == "head.output"]
    assert not head.origin
    assert "passed on from this module's own parameters emb.weight" in head.message
    assert "were clean" not in head.message
