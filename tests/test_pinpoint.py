"""The operation inside a module's forward that made a NaN or Inf, named by running that forward
again (tensordbg/engine/pinpoint.py), without changing any number of the training."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import tensordbg
from tensordbg.sources.live import LiveSource


class Attention(nn.Module):
    """A mask that hides a whole row makes softmax divide 0 by 0; dropout and BatchNorm give the
    re-run something to disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.2)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(x))  # draws from the random stream before the NaN
        scores = x @ x.transpose(-1, -2)
        scores = scores.masked_fill(mask, float("-inf"))  # -inf, on purpose
        weights = scores.softmax(-1)  # NaN where a row was all -inf
        return self.proj(weights @ x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.attn = Attention()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attn(self.inp(x), mask)


SOFTMAX_LINE = next(
    i for i, line in enumerate(inspect.getsource(Attention).splitlines())
    if "scores.softmax" in line
) + inspect.getsourcelines(Attention)[1]  # fmt: skip


def batch(bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    if bad:
        mask[0, 1, :] = True  # row 1 of sample 0 sees nothing
    return torch.randn(2, 4, 8), mask


def watched(model: nn.Module, **options) -> tensordbg.Session:
    """Hits recorded, no UI server, no summary at exit; detached when its ``with`` ends."""
    return tensordbg.attach(model, on_hit="record", server=False, summary_at_exit=False,
                            **options)  # fmt: skip


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_the_softmax_that_made_the_nan_is_named_with_its_line_in_every_mode(sync: str) -> None:
    torch.manual_seed(0)
    model = Model()
    with watched(model, sync=sync) as session, torch.no_grad():  # a phase per forward
        model(*batch())
        model(*batch(bad=True))
        origin = next(h for h in session.hits if h.origin)
        prov = LiveSource(session).provenance(origin.ref, origin.module, origin.call)
    assert origin.tensor == "attn.output"
    assert (
        f"Inside attn's forward the first NaN came from Tensor.softmax at test_pinpoint.py:"
        f"{SOFTMAX_LINE} (weights = scores.softmax(-1))." in origin.message
    )  # the masked_fill's -inf came first, but the hit is a NaN
    assert prov["source"]["line"] == SOFTMAX_LINE and prov["operation"]["op"] == "Tensor.softmax"


def test_an_inf_is_traced_to_the_operation_that_made_it() -> None:
    class Log(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shifted = x - x.max()
            return torch.log(shifted.clamp(min=0))  # log(0) = -inf

    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 2))
    with watched(model) as session:
        model(torch.randn(3, 4))
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "1.output"
    assert "the first Inf came from torch.log at test_pinpoint.py:" in origin.message


def test_a_nan_and_an_inf_in_one_output_each_name_the_operation_that_made_them() -> None:
    """One output holding a NaN and an Inf made on two lines: the NaN's hit named the NaN's
    operation, and Overflow's hit, the same step, named the NaN's too."""

    class Two(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inf = torch.log(torch.zeros_like(x[:, :1]))  # -inf
            nan = torch.sqrt(-torch.ones_like(x[:, :1]))  # NaN
            return torch.cat([x, inf, nan], 1)

    model = nn.Sequential(nn.Linear(4, 4), Two())
    with watched(model) as session:
        model(torch.randn(3, 4))
    said = {h.rule: h.message for h in session.hits if h.origin}
    assert "the first NaN came from torch.sqrt at test_pinpoint.py:" in said["NaN"]
    assert "the first Inf came from torch.log at test_pinpoint.py:" in said["Overflow"]


def run(pinpoint: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, str]:
    """Four training steps with an evaluation forward that makes a NaN at step 2."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watched(model, optimizer=opt) as session:
        session.pinpoint = pinpoint
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model(*batch(bad=True))  # in training mode: dropout draws, BatchNorm counts
            model(*batch()).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    message = next(h.message for h in session.hits if h.origin)
    return dict(model.state_dict()), torch.get_rng_state(), message


def test_running_the_forward_again_changes_no_number_of_the_training() -> None:
    named, rng, message = run(pinpoint=True)
    plain, plain_rng, plain_message = run(pinpoint=False)
    assert "the first NaN came from Tensor.softmax" in message
    assert "came from" not in plain_message
    # Weights, BatchNorm's running statistics and its batch count, and the random stream.
    assert named.keys() == plain.keys()
    for key, value in named.items():
        assert torch.equal(value, plain[key]), key
    assert torch.equal(rng, plain_rng)


def test_inputs_changed_in_place_since_the_call_are_not_run_again() -> None:
    class Parent(Model):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            out = self.attn(h, mask)
            h.mul_(2)  # the attention's input is not what it saw any more
            return out

    torch.manual_seed(0)
    model = Parent()
    with watched(model, sync="deferred") as session, torch.no_grad():
        model(*batch(bad=True))
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "attn.output" and "came from" not in origin.message


def test_in_a_job_of_several_ranks_a_forward_that_talks_to_them_is_not_run_again(tmp_path):
    """Run again on one rank, a forward with a collective in it (SyncBatchNorm's all-gather of
    batch statistics) would wait for the other ranks for ever: it is not run again."""
    import torch.distributed as dist

    class SyncBatchNorm(nn.Identity):  # named as torch's: only its name marks it
        pass

    class Synced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = SyncBatchNorm()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.norm(x) - x)  # log(0) = -inf

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), Synced(), nn.Linear(4, 2))
        with watched(model) as session:
            model(torch.randn(3, 4))
    finally:
        dist.destroy_process_group()
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "1.output" and "came from" not in origin.message


def test_an_operation_handed_a_value_that_was_bad_already_is_not_named() -> None:
    """A buffer that is NaN already (a running statistic gone bad) makes the product NaN; the
    product did not make the NaN, so no operation is named for it."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    model = nn.Sequential(nn.Linear(4, 4), Scaled())
    model[1].scale[0] = float("nan")
    with watched(model) as session, torch.no_grad():
        model(torch.randn(3, 4))
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "1.output" and "came from" not in origin.message


class DroppedScale(nn.Module):
    """Divides by a scale that dropout sets to 0 or 2: NaN (0/0) only when dropout drew 0."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.drop(torch.ones(()))
        return (x * 0) / scale  # 0/0 where dropout drew 0


def test_a_nan_that_depends_on_the_dropout_mask_is_named_with_the_masks_the_call_drew() -> None:
    """The re-run starts from the random streams' state at the call: without it, it would draw
    the next mask (here a 2, so no NaN) and name nothing."""
    model = nn.Sequential(nn.Linear(4, 4), DroppedScale())
    seed = next(s for s in range(100) if _draws(s) == [0.0, 2.0])  # this call 0, the next 2
    with watched(model) as session:
        torch.manual_seed(seed)
        model(torch.randn(3, 4).abs())
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "1.output"
    assert "Inside 1's forward the first NaN came from Tensor.div at" in origin.message


def _draws(seed: int) -> list[float]:
    """What Dropout(0.5) makes of a scalar one on two draws after torch.manual_seed(seed) and
    one 3x4 randn (the test's input)."""
    torch.manual_seed(seed)
    torch.randn(3, 4)
    drop = nn.Dropout(0.5)
    return [float(drop(torch.ones(()))) for _ in range(2)]


def test_a_nan_written_in_place_is_named_at_its_write() -> None:
    """``x[i] = nan`` and ``x.log_()`` make the NaN in their first argument and return nothing
    that shows it (or that argument, which looked "handed the bad value"): the hit said "made
    no NaN this time ... a counter, a global" (benchmarks/transport.py's planted NaN), then
    named nothing. The write is named, with its line; a write of a value that was bad already
    is not."""

    class Planted(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x * 2
            out[0, 0] = float("nan")  # the write
            return out

    class Logged(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x - 100
            out.log_()  # the write
            return out

    class Copied(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(x)
            out[0] = x[0]  # x is NaN already: nothing here made it
            return out

    for inner, op in ((Planted(), "Tensor.__setitem__"), (Logged(), "Tensor.log_")):
        model = nn.Sequential(nn.Linear(4, 4), inner)
        with watched(model) as session, torch.no_grad():
            model(torch.randn(3, 4))
        origin = next(h for h in session.hits if h.origin)
        assert origin.tensor == "1.output"
        assert f"the first NaN came from {op} at test_pinpoint.py:" in origin.message, origin
        assert "# the write" not in origin.message and "this time" not in origin.message
    model = nn.Sequential(Copied())
    with watched(model) as session, torch.no_grad():
        model(torch.full((3, 4), float("nan")))
    assert all("came from" not in h.message for h in session.hits)


def test_a_forward_that_makes_its_nan_only_once_says_so_instead_of_naming_nothing() -> None:
    """A NaN made on a counter's third call: the re-run is the fourth, which makes none.
    The hit says why no operation is named (found trying the UI as a new user: the line
    was silently missing)."""

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return torch.log(x - 10) if self.calls == 3 else x

    model = nn.Sequential(nn.Linear(4, 4), Counted())
    with watched(model) as session, torch.no_grad():
        for _ in range(3):
            model(torch.randn(3, 4))
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "1.output"
    assert "came from" not in origin.message and "made no NaN this time" in origin.message


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_a_nan_a_forward_hook_of_the_script_made_says_the_hook_may_have(sync: str) -> None:
    """A NaN written by the script's own forward hook (as the Hugging Face example plants its
    fault): the re-run, the module's forward without its hooks, makes none, and the hit
    blamed "a counter, a global, a draw" instead of the hook."""

    def plant(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[0, 0] = float("nan")
        return output

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].register_forward_hook(plant)
    with watched(model, sync=sync) as session:
        model(torch.randn(3, 4)).sum().backward()
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "1.output"
    assert "without the forward hooks on the module (" in origin.message, origin.message
    assert "plant" in origin.message and "a counter" not in origin.message


def _loss_origin(criterion, sync: str) -> tuple[tensordbg.Hit, int]:
    """Train 4 steps; at step 2 the loss is ``criterion(model output)``: the origin hit, and
    the line that observed it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    sources = []

    def shown(hit: tensordbg.Hit) -> None:  # as the UI asks while the training is paused
        sources.append(LiveSource(session).provenance(hit.ref, hit.module, hit.call)["source"])

    with tensordbg.attach(model, optimizer, on_hit=shown, sync=sync, server=False,
                          summary_at_exit=False) as session:  # fmt: skip
        for step in range(4):
            out = model(torch.randn(16, 4))
            loss = criterion(out) if step == 2 else out.pow(2).mean()
            line = inspect.currentframe().f_lineno + 1
            session.observe("loss", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    origin = next(h for h in session.hits if h.origin)
    assert (origin.tensor, origin.step) == ("loss", 2)
    assert sources[0]["line"] == line  # the line the Provenance tab shows
    return origin, line


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_the_operation_of_the_loss_code_that_made_its_nan_is_named_in_every_mode(sync: str):
    """A NaN made by the loss code, no module's: the hit said only "the code that computes it
    made it". What autograd saved names the operation and what it was given, and the line
    that observed the loss bounds where to look."""
    origin, line = _loss_origin(lambda out: torch.log(out - 100).mean(), sync)
    assert f"It was observed at test_pinpoint.py:{line}." in origin.message
    assert "the first operation given values it does not accept: log of 48 values <= 0" in (
        origin.message
    )
    origin, _ = _loss_origin(lambda out: (out.sum(1) / (out[:, 0] * 0)).mean(), sync)
    assert "a division by 0 (16 zeros in the divisor)" in origin.message
    origin, _ = _loss_origin(lambda out: torch.sqrt(out - 100).mean(), sync)
    assert "the first NaN autograd kept came from sqrt (its result" in origin.message
    # An overflow by a number (a bad temperature): the multiplication keeps nothing, and
    # log_softmax keeps only its result. Its inputs held Inf: not called finite.
    origin, _ = _loss_origin(
        lambda out: nn.functional.cross_entropy(out * 1e38 * 1e38, torch.zeros(len(out)).long()),
        sync,
    )
    assert "came from log_softmax (its result; autograd kept none of its inputs" in origin.message
    assert "inputs were finite" not in origin.message
    # A Python number as the divisor: autograd saves it as an integer tensor, once not read.
    origin, _ = _loss_origin(lambda out: nn.functional.mse_loss(out / 0 * 0, out * 0), sync)
    assert "does not accept: a division by 0 (one value, 0, as the divisor: a number, or" in (
        origin.message
    )
    # A count as the divisor (a mean over a mask that selects nothing) is not called a number.
    origin, _ = _loss_origin(lambda out: out.sum() / (out > 1e9).sum(), sync)
    assert "a number, or a one-element tensor such as a count that came to 0)" in origin.message


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_a_loss_observed_after_a_backward_pass_of_its_step_names_its_line_and_operation(sync):
    """A GAN's generator loss, or an auxiliary loss: one backward pass of the step has run when
    the next loss is computed, from outputs its phase let go of. Its NaN hit said only "the
    code that computes it made it" (found trying it as a new user): no line, no operation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with tensordbg.attach(model, optimizer, on_hit="record", sync=sync, server=False,
                          summary_at_exit=False) as session:  # fmt: skip
        for step in range(4):
            out = model(torch.randn(16, 4))
            out.pow(2).mean().backward(retain_graph=True)  # the first loss of the step
            loss = out.pow(2).mean() + 0.5
            if step == 2:
                loss = loss + torch.log(-loss)
            line = inspect.currentframe().f_lineno + 1
            session.observe("errG", loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    origin = next(h for h in session.hits if h.origin)
    assert (origin.tensor, origin.step) == ("errG", 2)
    assert f"It was observed at test_pinpoint.py:{line}." in origin.message
    assert "does not accept: log of 1 values <= 0" in origin.message


def test_loss_code_whose_operations_saved_nothing_to_show_names_none() -> None:
    """An overflow in a sum saves nothing autograd could show, and the model's own operations
    (a ReLU, whose zeros a log would reject) are not the loss code's: nothing is named."""
    origin, line = _loss_origin(lambda out: (out.exp() * 1e38).sum() * 1e10, "deferred")
    assert "Between the model's outputs and it" not in origin.message
    assert origin.message.endswith(f"It was observed at test_pinpoint.py:{line}.")


def test_a_call_that_made_a_nan_and_an_inf_keeps_the_first_named_in_its_provenance() -> None:
    """Its NaN hit named torch.log, its Inf hit the assignment a line below: the provenance
    (F5) showed the later one, as "first non-finite value", beside the NaN hit that named the
    earlier (found trying the UI in tmux)."""

    class Fault(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.log(x - 10)  # NaN
            y[0, 0] = float("inf")  # Inf
            return y

    model = nn.Sequential(nn.Linear(4, 4), Fault(), nn.Linear(4, 2))
    with watched(model, rules=[tensordbg.rules.NaN(), tensordbg.rules.Overflow()]) as session:
        model(torch.randn(3, 4))
        nan, inf = (next(h for h in session.hits if h.origin and h.rule == r)
                    for r in ("NaN", "Overflow"))  # fmt: skip
        assert "torch.log" in nan.message and "__setitem__" in inf.message
        prov = LiveSource(session).provenance(nan.ref, nan.module, nan.call)
    assert prov["operation"]["op"] == "torch.log" and prov["operation"]["value"] == "NaN"


@pytest.mark.parametrize("sync", ["eager", "deferred"])
def test_the_loss_codes_operation_is_named_when_only_a_submodule_is_called(sync: str) -> None:
    """The model attached is a wrapper whose submodule alone is called (a LightningModule's
    self.net(x)): the loss code's operation went unnamed, the walk knowing the model's own
    outputs only."""

    class Box(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    torch.manual_seed(0)
    box = Box()
    optimizer = torch.optim.SGD(box.parameters(), lr=1e-2)
    with watched(box, sync=sync) as session:
        loss = torch.log(box.net(torch.randn(16, 4)) - 100).mean()
        session.observe("loss", loss)
        loss.backward()
        optimizer.step()
    origin = next(h for h in session.hits if h.origin)
    assert origin.tensor == "loss"
    assert "the first operation given values it does not accept: log of 16 values <= 0" in (
        origin.message
    )


class InfThenLinear(nn.Module):
    """The model's own code divides by zero (an Inf); ``b``'s Linear then makes NaN of it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h / torch.zeros_like(h)  # an Inf, made here
        return self.b(h)


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_a_nan_a_submodule_made_of_the_forwards_own_inf_names_the_inf_s_line(sync: str) -> None:
    """The hit said the model's own code made the NaN and named F.linear "at line 7 (return
    s.b(h))", an operation inside b, which passed it on: the NaN came of the division's Inf."""
    torch.manual_seed(0)
    model = InfThenLinear()
    with watched(model, sync=sync) as session:
        model(torch.randn(3, 4))
        session.flush()  # batched checks judge at the phase's end
        origin = next(h for h in session.hits if h.origin)
        prov = LiveSource(session).provenance(origin.ref, origin.module, origin.call)
    line = next(i for i, text in enumerate(inspect.getsource(InfThenLinear).splitlines())
                if "zeros_like" in text) + inspect.getsourcelines(InfThenLinear)[1]  # fmt: skip
    assert origin.tensor == "output" and "F.linear" not in origin.message
    assert (f"Inside the model's forward an Inf came first, from Tensor.div at test_pinpoint.py:"
            f"{line} (h = h / torch.zeros_like(h)), and the NaN was made of it later"
            in origin.message), origin.message  # fmt: skip
    assert prov["operation"]["value"] == "Inf" and prov["source"]["line"] == line


class ConvBlock(nn.Module):
    """Its own code divides by zero after a BatchNorm, which autograd saved for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        h = h / (h.sum() * 0)
        return self.fc(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_running_a_forward_with_batchnorm_again_leaves_the_training_s_backward_working(sync):
    """The re-run wrote BatchNorm's running statistics back in place, past the version autograd
    had saved: the training's own backward then failed ("modified by an inplace operation")
    in every mode, where without tensordbg it ran on with a NaN loss."""
    torch.manual_seed(0)
    model = ConvBlock()
    bare = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = tensordbg.attach(model, optimizer=opt, on_hit="record", server=False, sync=sync,
                               summary_at_exit=False)  # fmt: skip
    try:
        x = torch.randn(4, 3, 8, 8)
        model(x).sum().backward()  # raised here
        opt.step()
        bare(x).sum().backward()
        origin = next(h for h in session.hits if h.origin)
        assert "Tensor.div" in origin.message and origin.module == "", origin.message
        for name, value in model.bn.named_buffers():  # the running statistics, as bare's
            assert torch.equal(value, dict(bare.bn.named_buffers())[name]), name
    finally:
        session.detach()


class CausalAttention(nn.Module):
    """Hand-written causal attention: a mask's -inf on purpose, then a temperature of 0."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        scores = q @ q.transpose(-1, -2)
        mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
        scores = scores.masked_fill(mask, float("-inf"))
        scores = scores / self.temperature
        return scores.softmax(-1) @ q


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_a_division_by_zero_after_a_causal_mask_is_named_not_the_softmax(sync: str) -> None:
    """The mask's -inf hid the division's +Inf: the softmax was named, as for a row the mask
    left all -inf, and a person went to check their padding."""
    torch.manual_seed(0)
    model = CausalAttention()
    model.temperature = 0.0
    origin = first_origin(model, sync, torch.randn(2, 5, 8))
    assert "an Inf came first, from Tensor.div" in origin.message, origin.message
    assert "scores = scores / self.temperature" in origin.message


def first_origin(model: nn.Module, sync: str, x: torch.Tensor):
    """The first origin hit of one forward and backward of ``x``, attached in mode ``sync``."""
    session = tensordbg.attach(model, on_hit="record", server=False, sync=sync,
                               summary_at_exit=False)  # fmt: skip
    try:
        model(x).sum().backward()
        session.flush()
        return next(h for h in session.hits if h.origin)
    finally:
        session.detach()


class LayerNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = self.ln(h)  # the line every mode names
        return self.fc2(h)


@pytest.mark.parametrize("sync", ["eager", "deferred", "batched"])
def test_an_operation_of_a_library_module_is_named_at_the_line_that_called_it_in_every_mode(sync):
    """A LayerNorm's Inf: eager named ``h = self.ln(h)``; deferred, re-running it after the
    forward, named the line that ran the model, and batched the line that called backward."""
    torch.manual_seed(0)
    model = LayerNormed()
    with torch.no_grad():
        model.ln.weight.fill_(3e38)
    origin = first_origin(model, sync, torch.randn(4, 8))
    assert "layer_norm at test_pinpoint.py:" in origin.message, origin.message
    assert "(h = self.ln(h))" in origin.message, origin.message
