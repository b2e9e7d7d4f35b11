"""No false alarms on healthy real models: the default rules stay silent over dozens of steps of
the models people train (``zoo.py``), and still fire on the same models where a fault is planted.

Each family trains from a small config in a few seconds. A hit on a healthy training fails the
test with every hit listed: the rule, the tensor, the step and the rule's own sentence.
"""

from __future__ import annotations

import pytest
import torch
import zoo
from conftest import DEFERRED_ON_DEVICE

STEPS = 30


@pytest.fixture(autouse=True)
def one_thread():
    """Small models train faster on one thread than on two contended ones (the machine running
    the tests is shared); the training's numbers do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def listed(hits) -> str:
    return "\n".join(f"  step {h.step} {h.rule} on {h.tensor}: {h.message}" for h in hits)


def assert_no_hit(session) -> None:
    assert session.hits == [], f"{len(session.hits)} hits on a healthy training:\n" + listed(
        session.hits
    )


def assert_no_hit_but(session, rule: str) -> None:
    others = [h for h in session.hits if h.rule != rule]
    assert others == [], f"hits other than {rule}:\n" + listed(others)


def hits_of(session, rule: str) -> dict[str, int]:
    """The tensors ``rule`` hit, each with the step of its first hit."""
    first: dict[str, int] = {}
    for h in session.hits:
        if h.rule == rule:
            first.setdefault(h.tensor, h.step)
    return first


# --- healthy trainings ----------------------------------------------------------------------


# The default on the CPU, and the modes a CUDA model runs in (batched, the default there, and
# deferred, whose screens go to the phase's transfer), emulated on the CPU.
MODES = [(m, f) for m in ("auto", "batched", DEFERRED_ON_DEVICE) for f in zoo.FAMILIES]


@pytest.mark.parametrize(("sync", "family"), MODES)
def test_a_healthy_training_raises_no_hit_with_the_default_rules(watch, sync, family):
    run = zoo.FAMILIES[family]()
    session = watch(run.model, optimizer=run.optimizer, on_hit="record", sync=sync)
    losses = zoo.train(run, STEPS, session)
    assert session.step == STEPS
    assert all(torch.isfinite(torch.tensor(losses)))
    assert_no_hit(session)


def test_the_diverging_example_with_its_learning_rate_fixed_raises_no_hit(monkeypatch):
    import examples_path  # noqa: F401  (puts examples/ on sys.path)
    import train_diverging

    monkeypatch.setattr(train_diverging, "learning_rate", lambda step: 1e-2)
    session = train_diverging.main(record=True)
    assert session.step == 120
    assert_no_hit(session)


# --- the same models, with a fault planted: the rules still fire ------------------------------


def test_an_embedding_table_cut_off_from_the_loss_has_a_vanishing_gradient(watch):
    run = zoo.word_lm()
    run.model.encoder.register_forward_hook(lambda module, args, out: out * 0.0)
    session = watch(run.model, optimizer=run.optimizer, on_hit="record")
    zoo.train(run, 2, session)
    hit = next(h for h in session.hits if h.tensor == "encoder.weight.grad")
    # An exactly zero gradient on step 0 waits a step (a zero-initialised branch learns later).
    assert (hit.rule, hit.step, hit.value) == ("VanishingGradient", 1, 0.0)
    assert "receives no gradient at all" in hit.message
    assert "attention" not in hit.message  # advice about key biases is for attention only


def test_rows_of_an_embedding_that_get_a_vanishing_gradient_are_found_among_the_others(watch):
    """Sparse gradients are judged over their nonzero rows: a tiny gradient in the rows a step
    used is still a vanishing gradient (on its second step in a row: ``persist``)."""
    run = zoo.word_lm()
    run.model.encoder.register_forward_hook(lambda module, args, out: out * 1e-9)
    session = watch(run.model, optimizer=run.optimizer, on_hit="record")
    zoo.train(run, 3, session)
    hit = next(h for h in session.hits if h.tensor == "encoder.weight.grad")
    assert (hit.rule, hit.step) == ("VanishingGradient", 1) and 0 < hit.value < 1e-12
    assert "nonzero values" in hit.message


def test_a_dead_feed_forward_layer_in_bert_has_vanishing_gradients(watch):
    run = zoo.bert()
    dense = run.model.bert.encoder.layer[1].intermediate.dense
    with torch.no_grad():
        dense.bias.fill_(-100.0)  # GELU(-100) is 0 with a derivative of 0: nothing gets through
    session = watch(run.model, optimizer=run.optimizer, on_hit="record")
    zoo.train(run, 3, session)
    layer = "bert.encoder.layer.1"
    assert hits_of(session, "VanishingGradient") == {  # exactly zero: from step 1
        f"{layer}.intermediate.dense.bias.grad": 1,
        f"{layer}.intermediate.dense.weight.grad": 1,
        f"{layer}.output.dense.weight.grad": 1,  # its input is all zeros
    }


def test_a_layer_whose_learning_rate_is_zero_is_not_changing_but_its_key_bias_is_no_news(watch):
    """With a learning rate of 0 for one BERT layer, every parameter of that layer stays put;
    all are reported but the attention key bias, whose gradient softmax cancels: it has nothing
    to learn from in any layer."""
    run = zoo.bert()
    layer = run.model.bert.encoder.layer[0]
    frozen = {id(p) for p in layer.parameters()}
    others = [p for p in run.model.parameters() if id(p) not in frozen]
    run.optimizer = torch.optim.AdamW(
        [{"params": list(layer.parameters()), "lr": 0.0}, {"params": others}], lr=1e-3
    )
    session = watch(run.model, optimizer=run.optimizer, on_hit="record")
    # AdamW writes every parameter, so the engine tells "unchanged" exactly every other step:
    # three unchanged steps (SageMaker's streak) are seen within six.
    zoo.train(run, 6, session)
    expected = {
        f"bert.encoder.layer.0.{name}.update"
        for name, _ in layer.named_parameters()
        if name != "attention.self.key.bias"
    }
    assert set(hits_of(session, "WeightNotChanging")) == expected
    assert_no_hit_but(session, "WeightNotChanging")


@pytest.mark.parametrize("scheduled", [True, False], ids=["warm-up", "no-scheduler"])
def test_a_group_a_scheduler_holds_at_zero_before_warming_up_is_not_reported(watch, scheduled):
    """A LambdaLR that holds the body's group at 0 for its first steps, then raises it (a
    frozen-then-unfrozen warm-up): WeightNotChanging reported the body's weights on a healthy
    run (an LSTM's, found trying the product as a new user). The same rate of 0 with no
    scheduler to raise it is still a weight that cannot learn."""
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    body, head = list(model[0].parameters()), list(model[2].parameters())
    held = 0.0 if not scheduled else 1e-2  # the scheduler's base rate for the body
    optimizer = torch.optim.Adam([{"params": body, "lr": held}, {"params": head}], lr=1e-2)
    schedule = None
    if scheduled:
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, [lambda s: 0.0 if s < 6 else 1.0, lambda s: 1.0]
        )
    session = watch(model, optimizer=optimizer, on_hit="record")
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for _ in range(10):
        loss = nn.functional.cross_entropy(model(x), y)
        session.observe("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    if scheduled:
        assert_no_hit(session)
    else:
        assert set(hits_of(session, "WeightNotChanging")) == {"0.weight.update", "0.bias.update"}
        assert_no_hit_but(session, "WeightNotChanging")


def test_a_head_left_out_of_the_optimizer_is_not_changing(watch):
    run = zoo.resnet()
    head = {id(p) for p in run.model.fc.parameters()}
    body = [p for p in run.model.parameters() if id(p) not in head]
    run.optimizer = torch.optim.SGD(body, lr=0.01, momentum=0.9, weight_decay=1e-4)
    session = watch(run.model, optimizer=run.optimizer, on_hit="record")
    zoo.train(run, 4, session)
    assert hits_of(session, "WeightNotChanging") == {"fc.weight.update": 2, "fc.bias.update": 2}


def test_a_convolution_bias_before_batchnorm_that_no_unit_passes_on_is_reported(watch):
    """Healthy, the bias of a convolution that BatchNorm follows gets no gradient (up to
    rounding) while its weight learns: no hit (the ``resnet_conv_bias`` family). Behind ReLUs
    that never fire, weight and bias both get nothing: both are reported."""
    run = zoo.resnet(conv_bias=True)
    with torch.no_grad():
        run.model.bn1.bias.fill_(-100.0)  # every unit after the stem is below zero: all dead
    session = watch(run.model, optimizer=run.optimizer, on_hit="record")
    zoo.train(run, 3, session)
    stem = {"conv1.weight.grad": 1, "conv1.bias.grad": 1, "bn1.weight.grad": 1}  # exactly 0
    assert stem.items() <= hits_of(session, "VanishingGradient").items()


class EncoderGRU(torch.nn.Module):
    """A new user's healthy model: token embeddings (a padding row), frozen positions, a
    pre-norm TransformerEncoder with a padding mask, a GRU, a mean over the real tokens, and a
    head used every third step only."""

    def __init__(self, vocab: int = 200, dim: int = 32):
        super().__init__()
        nn = torch.nn
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Embedding(16, dim)
        self.pos.weight.requires_grad_(False)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.1, batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, 4)
        self.aux = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        pad = x == 0
        h = self.emb(x) + self.pos.weight[: x.shape[1]]
        h, _ = self.gru(self.enc(h, src_key_padding_mask=pad))
        h = h.masked_fill(pad[..., None], 0).sum(1) / (~pad).sum(1, keepdim=True)
        return self.head(h) + (self.aux(h) if use_aux else 0)


@pytest.mark.slow
def test_a_long_run_to_a_tiny_loss_under_a_cosine_schedule_raises_no_hit(watch):
    """1,500 steps of AdamW from 3e-3 with warm-up and a cosine schedule to 0, gradients
    clipped to 1, the loss down to 1e-3: 140 hits in a new user's run. Near the end, a batch
    with one example the model gets wrong sends every gradient x300-x700 for a step
    (ExplodingGradient fired at once past growth squared, and on two steps up in a row below
    the window's largest), and the schedule's last steps move no element of a LayerNorm
    weight (WeightNotChanging)."""
    import math

    steps = 1500
    torch.manual_seed(0)
    model = EncoderGRU()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)),
    )
    session = watch(model, optimizer=optimizer, on_hit="record")
    for step in range(steps):
        lengths = torch.randint(3, 16, (32,))
        x = torch.randint(1, 200, (32, 16))
        x[torch.arange(16)[None] >= lengths[:, None]] = 0
        loss = torch.nn.functional.cross_entropy(model(x, use_aux=step % 3 == 0), x[:, 0] % 4)
        session.observe("loss", loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    assert loss.item() < 0.05
    assert_no_hit(session)


@pytest.mark.parametrize("observed", [True, False], ids=["loss-observed", "no-loss"])
@pytest.mark.parametrize("sync", ["auto", "eager"])
def test_a_training_done_to_a_loss_of_zero_or_floats_floor_raises_no_hit(watch, sync, observed):
    """The sanity check of overfitting one batch reaches a loss of exactly 0 by step 25
    (3,910 VanishingGradient hits in a new user's run: every gradient is 0 or 1e-24, by design),
    and a linear autoencoder reaches float32's floor of 3e-15 (WeightNotChanging: Adam's steps
    on gradients of 1e-9 move no element, "though its gradient is not negligible"). With the
    loss observed, it says so; without (a script's own attach() and no observe: the same
    hits), every gradient at once at most 1e-7 of the largest any had does."""
    nn = torch.nn
    torch.manual_seed(0)
    x, y = torch.randn(32, 768), torch.randint(0, 10, (32,))
    model = nn.Sequential(nn.Linear(768, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    overfit = zoo.Training(model, optimizer, lambda _: nn.functional.cross_entropy(model(x), y))
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    assert zoo.train(overfit, 200, session if observed else None)[-1] == 0.0
    assert_no_hit(session)

    data = torch.randn(256, 4) @ torch.randn(4, 32) / 4  # rank 4: a linear map fits it
    coder = nn.Sequential(nn.Linear(32, 8), nn.Linear(8, 32))
    adam = torch.optim.Adam(coder.parameters(), lr=1e-2)
    fitted = zoo.Training(coder, adam, lambda _: nn.functional.mse_loss(coder(data), data))
    session = watch(coder, optimizer=adam, on_hit="record", sync=sync)
    assert zoo.train(fitted, 600, session if observed else None)[-1] < 1e-12
    assert_no_hit(session)


@pytest.mark.parametrize("sync", ["auto", "eager", "batched"])
def test_plain_sgd_converged_on_a_regression_with_no_loss_observed_raises_no_hit(watch, sync):
    """A linear regression without noise, plain SGD, mini-batches of 32, no loss observed: the
    bias's gradient falls from about 8 to 3e-7 and 0.1 x 3e-7 is under half a float32 step of
    its value, so no bit moves; WeightNotChanging said it was not learning "though its
    gradient is not negligible" (24 hits in 300 steps; 1 in eager checks, 25 in batched).
    Its own gradient fell to 1e-6 of the largest it had: it is done."""
    torch.manual_seed(0)
    truth, x = torch.randn(8, 1), torch.randn(256, 8)
    y = x @ truth + 3.0
    torch.randn(256, 1)  # the script drew its noise (times 0) here: the same initial weights
    model = torch.nn.Linear(8, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(step: int) -> torch.Tensor:
        rows = torch.arange(step * 32, (step + 1) * 32) % 256
        return ((model(x[rows]) - y[rows]) ** 2).mean()

    session = watch(model, optimizer=sgd, on_hit="record", sync=sync)
    assert zoo.train(zoo.Training(model, sgd, loss), 300)[-1] < 1e-10
    assert_no_hit(session)


@pytest.mark.slow
def test_a_resnet_trained_long_to_a_tiny_loss_raises_no_hit(watch):
    """2,000 steps of the ResNet (SGD with momentum, BatchNorm) to a loss of 1e-4: two hard
    batches in a row at steps 1255 and 1800 send the gradients 40-280x their median and above
    all of the last 50 steps, back the step after (21 ExplodingGradient hits). They never pass
    the norms of the first steps, when the loss was 1."""
    run = zoo.FAMILIES["resnet"]()
    session = watch(run.model, optimizer=run.optimizer, on_hit="record")
    losses = zoo.train(run, 2000, session)
    assert losses[-1] < 1e-3
    assert_no_hit(session)


# --- what scripts do between backward and the update -------------------------------------------


class _Residual(torch.nn.Module):
    """A residual branch whose last layer starts at zero (zero_init_residual, LoRA's B, a
    diffusion UNet's output convolution): its first layer's gradient is exactly 0 on step 0."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        torch.nn.init.zeros_(self.b.weight)
        torch.nn.init.zeros_(self.b.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.nn.functional.silu(self.a(x)))


class _Branched(torch.nn.Module):
    """A branch used one step in five (an expert without tokens, a conditional head)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 1)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + (self.b(x) if use_b else 0)


def _edits(name: str, model: torch.nn.Module) -> None:
    """The script's own edit of the gradients between backward and the optimizer's step."""
    if name == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    elif name == "clip_grad_value_":
        torch.nn.utils.clip_grad_value_(model.parameters(), 100.0)
    elif name == "divided by hand":
        for p in model.parameters():
            p.grad.div_(2.0)


EDITS = ["clip_grad_norm_", "clip_grad_value_", "divided by hand"]


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("sync", ["auto", "eager", "batched", DEFERRED_ON_DEVICE])
def test_gradients_edited_before_the_update_are_judged_once_a_step(watch, sync, edit):
    """Clipping or dividing the gradients in place after backward looked like a second
    backward pass: each step's gradients were judged twice, so a zero-initialised branch's
    exact 0 of step 0 was "receives no gradient at all" at step 1 (LoRA with the Trainer's
    clipping, a UNet: 4 and 28 hits), and one hard batch was an ExplodingGradient "2 steps in
    a row" (found by a new user's trial; default mode only)."""
    torch.manual_seed(0)
    nn, F = torch.nn, torch.nn.functional
    model = nn.Sequential(nn.Linear(8, 16), _Residual(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    w = torch.randn(8, 1)
    for step in range(60):
        x = torch.randn(64, 8)
        y = x @ w + (30.0 if step == 40 else 0.0)  # one hard batch
        loss = F.mse_loss(model(x), y)
        session.observe("loss", loss)
        optimizer.zero_grad()
        loss.backward()
        _edits(edit, model)
        optimizer.step()
    assert_no_hit(session)
    assert session.step == 60


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("sync", ["auto", "eager", "batched", DEFERRED_ON_DEVICE])
def test_a_parameter_a_step_does_not_reach_is_not_judged_on_that_step(watch, sync, set_to_none):
    """zero_grad(set_to_none=False) leaves an unused branch a zeroed gradient: the default
    mode took it for that step's ("receives no gradient at all, though it had one before": 56
    hits; 1,362 on a mixture of experts), and plain SGD, which leaves the branch where it is,
    made it "not changing though its gradient is not negligible" in every mode."""
    torch.manual_seed(0)
    model = _Branched()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    w = torch.randn(8, 1)
    for step in range(40):
        x = torch.randn(64, 8)
        loss = torch.nn.functional.mse_loss(model(x, step % 5 == 0), x @ w)
        optimizer.zero_grad(set_to_none=set_to_none)
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05
    assert_no_hit(session)
