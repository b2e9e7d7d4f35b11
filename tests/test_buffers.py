"""Buffers a forward writes (BatchNorm's running statistics) are read when it wrote them: a
batch whose variance overflows leaves the running variance Inf while every output stays finite,
and nothing else would ever show it (found trying the product as a new user on a ResNet: the
only hits blamed the learning rate)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEFERRED_ON_DEVICE
from torch import nn

from tensordbg.engine import buffers

MODES = ("auto", "eager", "batched", "deferred", DEFERRED_ON_DEVICE)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, 2))  # fmt: skip


def _train(model, session, opt, steps, batch_at=lambda step: None):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 3, 8, 8, generator=g)
        x = batch_at(step) if batch_at(step) is not None else x
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 2, (8,), generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("sync", MODES)
def test_a_batch_whose_variance_overflows_is_named_at_the_batchnorm_that_kept_it(watch, sync):
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record", sync=sync)
    constant = torch.full((8, 3, 8, 8), 1e20)  # its padded border makes a variance of ~1e39
    _train(model, session, opt, 8, lambda step: constant if step == 5 else None)
    assert torch.isinf(model[1].running_var).all()  # the fault is real, and stays
    found = [h for h in session.hits if h.kind == "buffer"]
    assert [(h.tensor, h.module, h.step, h.phase, h.origin) for h in found] == [
        ("1.running_var", "1", 5, "forward", True)  # once: steps 6 and 7 keep it, no news
    ]
    assert session.hits[0] is found[0]  # before the gradients it starved
    assert "This module's forward wrote it in training mode" in found[0].message
    assert "learning rate" not in found[0].message


def test_the_buffers_a_nan_batch_wrote_are_passed_on_from_the_batch_not_origins(watch):
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record")
    bad = torch.randn(8, 3, 8, 8)
    bad[0, 0, 0, 0] = float("nan")
    _train(model, session, opt, 2, lambda step: bad if step == 1 else None)
    origins = [h for h in session.hits if h.origin]
    assert origins and origins[0].tensor == "input[0]"
    written = {h.tensor: h.origin for h in session.hits if h.kind == "buffer"}
    assert written == {"1.running_mean": False, "1.running_var": False}
    message = next(h.message for h in session.hits if h.kind == "buffer")
    assert "first produced at input[0]" in message


def test_a_model_that_came_with_a_nan_buffer_is_told_so_at_its_first_training_forward(watch):
    model = _cnn()
    with torch.no_grad():
        model[1].running_mean[2] = float("nan")  # a checkpoint loaded so
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record")
    _train(model, session, opt, 1)
    hit = next(h for h in session.hits if h.kind == "buffer")
    assert (hit.tensor, hit.step, hit.origin) == ("1.running_mean", 0, True)
    assert "the model came with it" in hit.message


def test_an_evaluation_writes_no_buffer_and_reads_none(watch, monkeypatch):
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch(model, optimizer=opt, on_hit="record")
    _train(model, None, opt, 2)
    read = []
    norms = buffers.BufferWatch.norms
    monkeypatch.setattr(
        buffers.BufferWatch, "norms", lambda self, c: read.append(c) or norms(self, c)
    )
    model.eval()
    with torch.no_grad():
        model(torch.randn(8, 3, 8, 8))
    assert read == []
    model.train()
    model(torch.randn(8, 3, 8, 8)).sum().backward()
    assert [name for _, name, _ in read[0]] == ["1.running_mean", "1.running_var"]


def test_a_buffer_set_bad_by_hand_is_not_blamed_on_an_evaluation_that_only_read_it(watch):
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record")
    _train(model, session, opt, 2)
    with torch.no_grad():
        model[1].running_var.fill_(float("nan"))
    model.eval()
    with torch.no_grad():
        model(torch.randn(8, 3, 8, 8))
    assert not [h for h in session.hits if h.kind == "buffer"]
    hit = next(h for h in session.hits if h.origin)
    assert hit.module == "1"
    assert "its buffers 1.running_var hold NaN or Inf" in hit.message


class _Masked(nn.Module):
    """An additive causal mask kept as a buffer: -inf above the diagonal, by design, refreshed
    in place by each forward."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.zeros(5, 5))

    def forward(self, x):
        self.mask.copy_(torch.full((5, 5), float("-inf")).triu(1))
        scores = x @ x.transpose(-1, -2) + self.mask
        return self.proj(torch.softmax(scores, -1) @ x)


def test_an_attention_mask_s_minus_inf_written_by_a_forward_is_no_hit(watch):
    torch.manual_seed(0)
    model = _Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=opt, on_hit="record")
    for _ in range(3):
        model(torch.randn(2, 5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert not session.hits
