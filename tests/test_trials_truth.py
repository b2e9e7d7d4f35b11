"""What new users' trials found untrue, each in the set-up that showed it: tied weights, a
model compiled before it was watched, a loss with no terms, a NaN the loss code made from an
Inf, and a dumped step that saw what its checks then ignored."""

from __future__ import annotations

import pytest
import torch
from conftest import DEFERRED_ON_DEVICE
from torch import nn

from tensordbg.rules import ExplodingGradient

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


class Compiled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x)))
        if self.bad:  # log(0) = -inf; tanh(-inf) = -1: a finite forward, a NaN backward
            h = torch.log(h.abs())
        return self.c(torch.tanh(h))


def _compiled_steps(model, steps, bad_at, session=None):
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="eager")
    for step in range(steps):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        if step == bad_at:
            model.bad = True
            with torch.no_grad():
                model.b.weight[5].zero_()
                model.b.bias[5] = 0.0
        loss = (compiled(x) - y).pow(2).mean()
        if session is not None:
            session.observe("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_a_class_compiled_before_attach_is_compiled_again_with_the_hooks(watch, sync, capsys):
    """A bare compiled run of the class first (a baseline, a notebook cell run again): the
    attached model reused its compiled code, which calls no hook added since, so tensordbg
    saw no submodule call and named a.weight.grad the origin, "the gradient of its output was
    clean". That code is dropped at attach (said once), and the model's own code is named."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    _compiled_steps(Compiled(), steps=2, bad_at=1)  # its code with the fault, compiled too
    torch.manual_seed(0)
    model = Compiled()
    session = watch(model, on_hit="record", sync=sync)
    assert "torch.compile had compiled Compiled.forward" in capsys.readouterr().err
    _compiled_steps(model, steps=4, bad_at=3, session=session)
    first = [(h.step, h.tensor, h.module) for h in session.hits if h.origin][:1]
    assert first == [(3, "b.grad_output", "")]
    assert not any(h.origin and h.tensor.startswith("a.") for h in session.hits)


@pytest.mark.parametrize("sync", MODES)
def test_zero_gradients_of_a_loss_with_no_terms_are_passed_on_from_that_loss(watch, sync):
    """A batch whose every label is ignored: the loss is 0/0, NaN, rightly the origin; its
    gradients are zeros. Each weight's gradient was a VanishingGradient origin of its own,
    "the units it feeds have died or saturated since, as a learning rate far too large makes
    them": nothing had died (28 such origins in one step of a small GPT-2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    for step in range(8):
        ids = torch.randint(1, 50, (4, 12))
        labels = ids.clone()
        if step == 5:
            labels[:] = -100
        logits = model(ids).flatten(0, 1)
        loss = nn.functional.cross_entropy(logits, labels.flatten(), ignore_index=-100)
        session.observe("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [(h.step, h.tensor) for h in session.hits if h.origin] == [(5, "loss")]
    vanished = [h for h in session.hits if h.rule == "VanishingGradient"]
    assert vanished and all(h.step == 5 for h in vanished)
    for hit in vanished:
        assert "This step's loss is not finite" in hit.message
        assert "died" not in hit.message and "learning rate" not in hit.message


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_an_inf_a_sigmoid_hides_on_a_dumped_step_is_found_live_and_by_check(
    watch, sync, tmp_path, capsys
):
    """A dumped step reads every activation, so deferred checks saw the Inf a Sigmoid hid
    (its mean) and raised nothing, while ``check`` of the dump said NaN, from the index's
    "not finite" alone. Seen, it is judged, as eager checks judge it: an Overflow, live and
    offline."""
    from tensordbg.cli import main

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight[0] = 1.0  # its unit 0 sums the input
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync,
                    dump_dir=tmp_path / "run", dump_every=1)  # fmt: skip
    for step in range(3):
        x = torch.randn(16, 4)
        if step == 1:
            x[0] = 3e38  # +Inf in 0.output; the Sigmoid maps it to 1
        loss = model(x).pow(2).mean()
        session.observe("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [(h.step, h.tensor, h.rule) for h in session.hits] == [(1, "0.output", "Overflow")]
    session.detach()
    capsys.readouterr()
    assert main(["check", str(tmp_path / "run")]) == 1
    said = capsys.readouterr().out
    assert "step 1 forward   Overflow           0.output  <- origin" in said
    assert "by Overflow (1)" in said


@pytest.mark.parametrize("sync", ["eager", "deferred"])
@pytest.mark.parametrize("stateful", [True, False])
def test_a_weight_set_to_inf_between_steps_is_said_to_be_set_then_not_a_learning_rate(
    watch, sync, stateful
):
    """Trial 25: a weight set to Inf between steps, met by the next forward, led with the
    Overflow rule's advice ("too high a learning rate") and said "the optimizer step ... made
    it". Adam's state for it is finite, so its last update added finite values: it was set
    after that update, and the advice about how an update overflows is left out. Plain SGD
    keeps no state and its gradient is gone by then (zero_grad): nothing says so, nor is
    it claimed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    make = torch.optim.AdamW if stateful else torch.optim.SGD
    optimizer = make(model.parameters(), lr=1e-3)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for step in range(5):
        if step == 3:
            with torch.no_grad():
                model[2].weight[1, 3] = float("inf")
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        session.observe("loss", loss)
        loss.backward()
        optimizer.step()
    [hit] = [h for h in session.hits if h.origin]
    assert (hit.step, hit.phase, hit.tensor) == (3, "forward", "2.weight")
    said = "it was set so after that update, between steps (by hand, or loaded so)"
    assert (said in hit.message) is stateful
    assert ("learning rate" in hit.message) is not stateful


@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_a_weight_set_to_inf_behind_a_tanh_is_not_blamed_on_the_update_in_deferred_checks(
    watch, eps
):
    """A weight set to Inf between steps, its Linear's output hidden by a Tanh: deferred
    checks read it first after the update, and said "produced by optimizer Adam.step" at the
    line calling step() (eager checks name it in the forward). Its gradient and Adam's state
    are finite and eps > 0, so the update added finite values: it was so before the step.
    With eps = 0 the update can make a NaN itself (0/0): then the optimizer stays a suspect."""
    from tensordbg.sources.live import LiveSource

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=eps)
    producers = []  # the Provenance tab's, asked while the phase is open (as paused)

    def provenance(hit):
        if hit.origin:
            producers.append(LiveSource(session).provenance(hit.ref)["producer"])

    session = watch(model, optimizer=optimizer, on_hit=provenance, sync="deferred")
    for step in range(8):
        x = torch.randn(32, 8)
        if step == 4:
            with torch.no_grad():
                model[0].weight[2, 3] = float("inf")
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        session.observe("loss", loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    [hit] = [h for h in session.hits if h.origin]
    assert (hit.step, hit.tensor, hit.phase) == (4, "0.weight", "optimizer")
    [producer] = producers
    if eps:
        assert "it was so before this step (set between steps by hand" in hit.message
        assert "the optimizer step or the code around it made it" not in hit.message
        assert producer is None
    else:
        assert "the optimizer step or the code around it made it" in hit.message
        assert producer["module"] == "optimizer"


class CarriedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(30, 16), nn.LSTM(16, 24, batch_first=True)
        self.out = nn.Linear(24, 30)

    def forward(self, ids, state):
        y, state = self.lstm(self.emb(ids), state)
        return self.out(y), state


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_a_carried_state_the_loop_broke_is_not_said_to_come_with_the_batch(watch, sync):
    """The loop's own code made the LSTM state it hands back in NaN: the hit named it
    (input[1][0]) and advised "It came in with the batch: look at the data"."""
    torch.manual_seed(0)
    model = CarriedLM()
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    state = None
    for step in range(8):
        ids = torch.randint(0, 30, (4, 9))
        out, state = model(ids[:, :-1], state)
        if step == 5:
            state = (state[0] * float("nan"), state[1])  # a bug corrupts the carried state
        state = tuple(t.detach() for t in state)
        loss = nn.functional.cross_entropy(out.reshape(-1, 30), ids[:, 1:].reshape(-1))
        session.observe("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    first = next(h for h in session.hits if h.origin)
    assert (first.step, first.tensor) == (6, "input[1][0]")
    assert "the batch" not in first.message
    assert "a state it carries from step to step" in first.message


class Several(nn.Module):
    """A module of four outputs, the last one alone used by the loss."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        h = self.fc(x)
        return h * 3, h.sum(), h.mean(0), h + 1


def test_the_model_tree_says_which_output_each_column_is_of(watch):
    """A module's output column showed its output[0] (n=20, mean 3) beside the gradient of its
    output[3] (n=1), nothing saying they were different tensors."""
    from tensordbg.sources.live import LiveSource
    from tensordbg.tui.components.module_table import ModuleTable

    torch.manual_seed(0)
    model = nn.Sequential(Several())
    session = watch(model, on_hit="record", sync="eager")
    model(torch.randn(4, 4))[3].pow(2).sum().backward()
    [row] = [m for m in LiveSource(session).modules() if m["path"] == "0"]
    assert row["stats"]["output"]["tensor"] == "0.output[0]"
    assert row["stats"]["grad_output"]["tensor"] == "0.grad_output[3]"
    table = ModuleTable()
    table.set_modules([row])
    cells = table._cells_of(row)
    assert cells[-2].startswith("[0] ") and cells[-1].startswith("[3] "), cells
    single = {**row, "stats": {"output": {**row["stats"]["output"], "tensor": "0.output"}}}
    assert not table._cells_of(single)[-2].startswith("[")


class TwoFaults(nn.Module):
    def forward(self, h):
        a = h * 1.0
        a[0, 0] = float("nan")
        b = h * 2.0
        b[1, 1] = float("inf")  # its own Inf, never in a
        return a, b


class Sibling(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bad, self.fc2 = nn.Linear(8, 8), TwoFaults(), nn.Linear(8, 1)

    def forward(self, x):
        a, b = self.bad(self.fc1(x))
        return self.fc2(a) + self.fc2(b)


@pytest.mark.parametrize("sync", MODES)
def test_outputs_beside_the_origin_are_said_to_come_of_the_same_call(watch, sync):
    """A call's second output, with an Inf of its own, was "passed on from upstream (first
    produced at bad.output[0])": nothing upstream made it. The call is the origin once; its
    other outputs are its work too."""
    torch.manual_seed(0)
    model = Sibling()
    session = watch(model, on_hit="record", sync=sync)
    model(torch.randn(4, 8)).sum().backward()
    session.flush()
    hits = {h.tensor: h for h in session.hits if h.phase == "forward"}
    assert hits["bad.output[0]"].origin and not hits["bad.output[1]"].origin
    said = hits["bad.output[1]"].message
    assert "produced by the same call as bad.output[0], the origin" in said
    assert "upstream" not in said


@pytest.mark.parametrize("sync", MODES)
def test_a_weight_found_bad_at_attach_is_said_to_have_come_with_the_model(watch, sync):
    """attach's own check found a NaN weight before any step and said "Its gradient and the
    optimizer's state for it are finite, so the update added only finite values ... this
    step's forward hid it": no step, forward or update had run. Nor did an update make it."""
    from tensordbg.sources.live import LiveSource

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[2].weight[0, 1] = float("nan")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    [hit] = [h for h in session.hits if h.origin]
    assert (hit.step, hit.tensor) == (0, "2.weight")
    assert "tensordbg found it when it attached, before the first step" in hit.message
    for untrue in ("update", "gradient", "forward"):
        assert untrue not in hit.message.split(". ", 2)[-1], hit.message
    assert LiveSource(session).provenance(hit.ref)["producer"] is None


@pytest.mark.parametrize("sync", MODES)
def test_a_weight_set_bad_after_attach_before_any_step_is_not_blamed_on_an_update(watch, sync):
    """A LoRA B set to Inf after attach and before the first step was said to be made by "the
    optimizer step or the code around it (learning rate, eps, a manual edit)": no optimizer
    step had run (found trying the product as a new user)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    with torch.no_grad():
        model[2].weight[0, 1] = float("inf")
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    [hit] = [h for h in session.hits if h.origin]
    assert (hit.step, hit.tensor, hit.phase) == (0, "2.weight", "forward"), hit
    assert "no optimizer step ran since: the code between attach and this forward" in hit.message
    assert "optimizer step or the code around it" not in hit.message


@pytest.mark.parametrize("sync", MODES)
def test_a_nan_loss_of_a_decoder_apart_is_not_said_to_come_of_the_loss_code(watch, sync):
    """An encoder watched, its decoder trained by the same optimizer but not watched (PyTorch's
    seq2seq tutorial's layout): an Inf set in the decoder's weight made the loss NaN, and the
    hit said "The model's outputs were clean: the code that computes it made it"."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
    dec = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-3)
    session = watch(enc, optimizer=optimizer, on_hit="record", sync=sync)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                dec[2].weight[1, 4] = float("inf")
        x = torch.randn(16, 8)
        loss = nn.functional.cross_entropy(dec(enc(x)), (x[:, 0] > 0).long())
        session.observe("loss", loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    [hit] = [h for h in session.hits if h.origin]
    assert (hit.step, hit.tensor) == (2, "loss")
    assert "the code that computes it made it" not in hit.message
    assert "its optimizer also steps 4 parameters tensordbg does not watch" in hit.message
    assert "1 of them, of shape (2, 32), holds NaN or Inf" in hit.message


@pytest.mark.parametrize("sync", MODES)
def test_a_loss_of_a_model_rebuilt_for_a_resume_is_said_to_be_unwatched(watch, sync):
    """A resume into a freshly built model and optimizer (load_state_dict): the watched model
    is no longer called, the losses go on. A NaN made in the new model was "step 20 backward:
    loss#10 ... The model's outputs were clean: the code that computes it made it", and
    nothing said the rest of the run was unwatched."""
    logged = []

    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    torch.manual_seed(0)
    model, optimizer = make()
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync)
    session.bus.subscribe(lambda e, p: logged.append(p["message"]), events={"log"})
    for step in range(12):
        if step == 4:
            state = model.state_dict(), optimizer.state_dict()
            model, optimizer = make()
            model.load_state_dict(state[0])
            optimizer.load_state_dict(state[1])
        if step == 8:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        x = torch.randn(16, 8)
        loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        session.observe("loss", loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    said = [m for m in logged if "with no call of the watched model" in m]
    assert len(said) == 1 and said[0].startswith("step 4: loss was observed 3 times"), logged
    origins = [h for h in session.hits if h.origin]
    assert origins and all("The watched model was not called for it" in h.message
                           and "the code that computes it made it" not in h.message
                           and "were finite" not in h.message for h in origins)  # fmt: skip


def test_two_losses_of_one_forward_under_one_name_are_the_models(watch):
    """Observing one name twice a forward (a script's two heads) is not a model apart."""
    logged = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    session = watch(model, optimizer=optimizer, on_hit="record")
    session.bus.subscribe(lambda e, p: logged.append(p["message"]), events={"log"})
    for _ in range(6):
        out = model(torch.randn(4, 8))
        first, second = out[:, :2].pow(2).mean(), out[:, 2:].log().mean()  # NaN: log < 0
        session.observe("loss", first)
        session.observe("loss", second)
        (first + second).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not [m for m in logged if "with no call of the watched model" in m]
    hit = next(h for h in session.hits if h.origin and h.kind == "observed")
    assert "the code that computes it made it" in hit.message


@pytest.mark.parametrize("sync", MODES)
def test_gradients_accumulated_over_micro_batches_count_each_step_once(watch, sync):
    """Four micro-batches a step: ExplodingGradient counted each backward pass as a step ("over
    the 49 steps before it grew" at step 41, "for 2 steps in a row", then 3, in one step: two
    origins of one tensor; found trying the product as a new user)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    session = watch(model, optimizer=optimizer, on_hit="record", sync=sync,
                    rules=[ExplodingGradient()])  # fmt: skip
    for step in range(34):
        for _ in range(4):
            loss = model(torch.randn(16, 8)).pow(2).mean() / 4 * (1e4 if step >= 30 else 1.0)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    origins = [h for h in session.hits if h.origin]
    assert {h.tensor for h in origins} == {"0.weight.grad", "0.bias.grad", "2.weight.grad",
                                           "2.bias.grad"}, origins  # fmt: skip
    assert all(h.step == 31 for h in origins), origins
    assert all("over the 30 steps before it grew" in h.message for h in origins), origins
    assert all("for 2 steps in a row" in h.message for h in origins), origins
    each = [(h.step, h.tensor) for h in session.hits]
    assert len(each) == len(set(each)), each  # one a step, however many passes
