"""On a CUDA device: batched and deferred checks synchronize once per phase, never once per
tensor.

Skipped where there is no CUDA device (CI has none); run them on a GPU machine with
``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from models import gpt_step

from tensordbg.demo import TinyGPT, batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PHASES_PER_STEP = 3  # forward (with the observed loss), backward, optimizer step


def _steps(model, optimizer, session, steps, bad_step=-1):
    for tokens in batches(steps, bad_step):
        gpt_step(model, optimizer, tokens.cuda(), session)


def _synchronizations(fn) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("sync", ["batched", "deferred"])
def test_checks_add_at_most_one_synchronization_per_phase(watch, sync):
    steps = 4
    torch.manual_seed(0)
    bare = TinyGPT().cuda()
    watched = TinyGPT().cuda()
    watched.load_state_dict(bare.state_dict())
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-3)
    watched_opt = torch.optim.AdamW(watched.parameters(), lr=1e-3)
    session = watch(watched, optimizer=watched_opt, on_hit="record", sync=sync)
    _steps(bare, bare_opt, None, 1)  # warm-up outside the count
    _steps(watched, watched_opt, session, 1)
    torch.cuda.synchronize()
    baseline = _synchronizations(lambda: _steps(bare, bare_opt, None, steps))
    attached = _synchronizations(lambda: _steps(watched, watched_opt, session, steps))
    assert attached - baseline <= PHASES_PER_STEP * steps, (baseline, attached)
    assert session.hits == []


def test_a_fault_on_the_gpu_is_named_at_its_origin_with_batched_checks(watch):
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = watch(model, optimizer=optimizer, on_hit="record")
    assert session.mode == "batched"  # the default on CUDA
    _steps(model, optimizer, session, 8, bad_step=5)
    first = next(h for h in session.hits if h.origin)
    assert (first.module, first.kind, first.step) == ("blocks.0.attn", "output", 5)
