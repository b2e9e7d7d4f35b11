"""Real-world training setups: mixed precision, Hugging Face models, torch.compile."""

from __future__ import annotations

import pytest
import torch
from models import mlp

from tensordbg.rules import NaN, Rule, default_rules


def _amp_steps(model, optimizer, scaler, session, overflow_steps, steps):
    for step in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if step in overflow_steps:
            loss = loss * float("inf")  # the scaled loss overflows: Inf gradients
        session.observe("loss", loss)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def test_a_step_the_grad_scaler_skips_is_recorded_as_skipped_not_as_a_hit(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    session = watch(model, optimizer=optimizer, on_hit="record", scaler=scaler,
                    rules=[NaN()])  # fmt: skip
    _amp_steps(model, optimizer, scaler, session, overflow_steps={3}, steps=6)
    assert session.skipped_steps == [3]
    assert [h for h in session.hits if h.phase == "backward"] == []
    assert session.step == 6  # a skipped step still counts as a training step


def test_overflow_steps_skipped_several_times_in_a_row_become_hits(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    session = watch(model, optimizer=optimizer, on_hit="record", scaler=scaler,
                    rules=[NaN()], max_skipped_steps=3)  # fmt: skip
    _amp_steps(model, optimizer, scaler, session, overflow_steps={2, 3, 4, 5}, steps=7)
    assert session.skipped_steps == [2, 3, 4, 5]
    backward = [h for h in session.hits if h.phase == "backward"]
    assert backward and {h.step for h in backward} == {4, 5}
    assert "skipped 3 steps in a row" in backward[0].message


def test_a_scaler_still_finding_its_scale_is_no_hit_until_the_scale_falls_below_one(watch):
    """Before its first step, a GradScaler halves its scale at each skip to find one that fits:
    ten skips from 65536 are how it starts, not hits. Skips that go on past a scale of 1 (a
    NaN that no scale removes) are hits again: from init_scale 8, at the 5th skip (scale 0.25)."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    session = watch(model, optimizer=optimizer, on_hit="record", scaler=scaler, rules=[NaN()])
    _amp_steps(model, optimizer, scaler, session, overflow_steps=set(range(10)), steps=12)
    assert session.skipped_steps == list(range(10))
    assert [h for h in session.hits if h.phase == "backward"] == []
    session.detach()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    session = watch(model, optimizer=optimizer, on_hit="record", scaler=scaler, rules=[NaN()])
    _amp_steps(model, optimizer, scaler, session, overflow_steps=set(range(6)), steps=6)
    backward = [h for h in session.hits if h.phase == "backward"]
    assert backward and {h.step for h in backward} == {4, 5}
    assert "skipped 5 steps in a row (its scale is now 0.25)" in backward[0].message


def test_gradient_statistics_are_unscaled(watch):
    from tensordbg.statistics import L2

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    norms = {}
    from tensordbg.rules import Rule

    class Norms(Rule):
        """Keeps the gradient norms it sees."""

        kinds = frozenset({"grad"})
        needs = (L2,)

        def check(self, t, state):
            norms[t.name] = t.get(L2)

    watch(model, optimizer=optimizer, on_hit="record", scaler=scaler, rules=[Norms()])
    x = torch.randn(8, 4)
    scaler.scale(model(x).pow(2).mean()).backward()
    scaled = {f"{n}.grad": p.grad.norm().item() for n, p in model.named_parameters()}
    for name, norm in norms.items():
        assert norm == pytest.approx(scaled[name] / 1024.0, rel=1e-5)


def test_a_hugging_face_model_built_from_a_config_trains_clean_and_is_debuggable(watch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names: set[str] = set()

    class Names(Rule):
        """Notes every tensor it sees."""

        def check(self, t, state):
            names.add(t.name)

    session = watch(model, optimizer=optimizer, on_hit="record", rules=[*default_rules(), Names()])
    for _ in range(12):
        ids = torch.randint(1, 100, (4, 16))
        out = model(input_ids=ids, labels=ids)
        session.observe("loss", out.loss)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert session.hits == []
    # ModelOutput is watched field by field; the logits are the head's own output.
    assert {"output.loss", "lm_head.output"} <= names
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    ids = torch.randint(1, 100, (4, 16))
    model(input_ids=ids, labels=ids)
    # The weight set by hand is the origin, found where the forward first meets it.
    [origin] = [h for h in session.hits if h.origin and h.phase == "forward"]
    assert (origin.tensor, origin.kind, origin.step) == (
        "transformer.h.1.mlp.c_fc.weight",
        "param",
        12,
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_attaching_before_torch_compile_works(watch, backend):
    torch._dynamo.reset()  # each backend compiles afresh
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record")
    compiled = torch.compile(model, backend=backend)
    for step in range(4):
        x = torch.randn(8, 4)
        if step == 2:
            x[0, 0] = float("nan")
        compiled(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not session.broken and session.step == 4
    first = session.hits[0]
    assert (first.kind, first.module, first.step, first.origin) == ("input", "", 2, True)
    # The NaN row meets each Linear's weight gradient; the gradients flowing back stay finite
    # (the loss's gradient is 1, and a ReLU passes none where its input is NaN), and so do the
    # bias gradients.
    backward = {h.tensor for h in session.hits if h.rule == "NaN" and h.phase == "backward"
                and h.step == 2}  # fmt: skip
    assert backward == {"0.weight.grad", "2.weight.grad", "4.weight.grad"}
