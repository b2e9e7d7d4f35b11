"""The live source: what the UI can ask of a paused training, answered by the training itself."""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest
import torch
from conftest import wait_until
from paused import PausedTraining, Planted

import tensordbg
from tensordbg.sources.contract import SourceError, dispatch
from tensordbg.sources.live import LiveSource


@pytest.fixture
def paused():
    with PausedTraining() as training:
        training.wait_paused()
        yield training, LiveSource(training.session)


class _Early(torch.nn.Module):
    """The NaN arises in ``bad``'s own code; ``head.mlp`` (a Sequential inside a ModuleDict,
    which is never called itself) and ``out`` run after it."""

    def __init__(self):
        super().__init__()
        self.bad = torch.nn.Linear(8, 32)
        mlp = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
        self.head, self.out = torch.nn.ModuleDict({"mlp": mlp}), torch.nn.Linear(32, 4)
        self.bad.register_forward_hook(lambda m, i, o: o / torch.zeros_like(o) if m.poison else o)
        self.bad.poison = False

    @property
    def poison(self) -> bool:
        return self.bad.poison

    @poison.setter
    def poison(self, value: bool) -> None:
        self.bad.poison = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head["mlp"](self.bad(x)))


def _modules_paused_at_the_hit(sync: str) -> dict[str, dict]:
    """The Modules tab's rows, by path, of _Early paused at its hit."""
    training = PausedTraining(sync=sync)
    training.model = _Early()
    training.optimizer = torch.optim.SGD(training.model.parameters(), lr=0.01)
    with training:
        training.wait_paused()
        return {m["path"]: m for m in LiveSource(training.session).modules()}


def test_paused_at_a_forward_hit_every_module_shows_its_output_or_says_why_not():
    """Deferred checks pause at the first hit in execution order, before judging the modules
    after it: the Modules tab still shows their outputs (the phase's records), and a module
    without one says why instead of a blank."""
    modules = _modules_paused_at_the_hit("deferred")
    for after in (
        "bad",
        "head.mlp.0",
        "head.mlp.1",
        "out",
    ):  # run after the hit, judged after the pause
        assert "min" in modules[after]["stats"]["output"], after
    assert modules["head.mlp"]["note"] == "a container: see its children"
    # A ModuleDict has no forward: a container too, never "not called this step".
    assert modules["head"]["note"] == "a container: see its children"
    assert "note" not in modules["out"]


def test_paused_inside_the_model_its_row_says_so_rather_than_not_called():
    """Eager checks pause in the hook of the module that made the value: the model's own call
    has not returned, and its row said "not called"."""
    modules = _modules_paused_at_the_hit("eager")
    assert modules[""]["note"] == "paused inside it"
    assert modules["head"]["note"] == "a container: see its children"  # a ModuleDict
    assert "note" not in modules["bad"]


def test_the_source_excerpt_shows_the_lines_as_they_are_in_the_file(tmp_path):
    """Blank lines around the user's line are shown where they are, not skipped: the line
    numbers in the margin count every line of the file."""
    from tensordbg.sources.provenance import _lines

    code = tmp_path / "train.py"
    code.write_text("a = 1\n\nb = model(x)\n\n\nc = 3\n")
    excerpt = _lines(str(code), 3, "<module>")["context"]
    assert excerpt == [[1, "a = 1"], [2, ""], [3, "b = model(x)"], [4, ""], [5, ""], [6, "c = 3"]]


def test_the_session_info_says_where_it_is_paused(paused):
    _, source = paused
    info = source.info()
    assert (info["state"], info["step"], info["phase"]) == ("paused", 3, "forward")
    assert info["paused_at"]["origin"] and info["paused_at"]["module"] == ""
    assert info["pause_reason"] == f"NaN hit: {info['paused_at']['message']}"
    # h / 0 is +-Inf everywhere; the out layer sums Infs of both signs into all 16x4 values.
    assert info["paused_at"]["message"].startswith("output holds 64 NaN among 64 values.")
    assert info["history"]["step"] == [0, 1, 2] and None not in info["history"]["loss"]


def test_hits_and_the_module_tree_mark_where_the_problem_is(paused):
    _, source = paused
    hits = source.hits()
    assert hits[0]["tensor"] == "out.output" and not hits[0]["origin"]
    assert any(h["origin"] and h["module"] == "" for h in hits)
    modules = {m["path"]: m for m in source.modules()}
    assert modules["out"]["hits"] >= 1 and modules["inp"]["hits"] == 0
    assert modules["mid"]["stats"]["output"]["shape"] == [16, 32]
    assert modules["mid"]["type"] == "Linear" and modules["mid"]["params"] == 32 * 32 + 32


def test_statistics_and_slices_of_the_hit_tensor_come_from_the_training(paused):
    training, source = paused
    hit = source.info()["paused_at"]
    tensor = training.session.record(hit["ref"]).tensor.detach()
    stats = source.stats(hit["ref"])
    assert stats["summary"]["nan"] == int(torch.isnan(tensor).sum())
    assert stats["summary"]["nan"] + stats["summary"]["posinf"] + stats["summary"]["neginf"] > 0
    one_row = source.stats(hit["ref"], "[2, :]")
    assert one_row["shape"] == [4] and one_row["index"] == "[2, :]"
    reply = source.slice(hit["ref"], "[1:5]", window=[[0, 2], [1, 3]])
    assert (reply["rows"], reply["cols"], reply["shape"]) == (4, 4, [4, 4])
    assert reply["window"] == [[0, 2], [1, 3]]
    np.testing.assert_array_equal(reply["data"].to_numpy(), tensor[1:3, 1:3].numpy())


def test_bad_slice_text_gets_a_clear_refusal(paused):
    _, source = paused
    ref = source.info()["paused_at"]["ref"]
    for text, words in [("[0, 1, 2]", "does not fit"), ("[__import__('os')]", "not allowed"),
                        ("[1:", "cannot read")]:  # fmt: skip
        with pytest.raises(SourceError, match=words):
            source.stats(ref, text)
    with pytest.raises(
        SourceError, match=r"^this tensor is from a phase that has ended: values are kept only"
    ):
        source.slice(10**6)


def test_a_histogram_is_computed_in_the_training_over_finite_values(paused):
    training, source = paused
    ref = source.tensors()[0]["ref"]  # the batch: finite
    tensor = training.session.record(ref).held().detach()
    h = source.histogram(ref, bins=10)
    assert sum(h["counts"]) == tensor.numel() and len(h["edges"]) == 11
    hit = source.info()["paused_at"]["ref"]
    h = source.histogram(hit, bins=8)
    tensor = training.session.record(hit).held().detach()
    assert sum(h["counts"]) == int(torch.isfinite(tensor).sum())
    assert h["nan"] == int(torch.isnan(tensor).sum())


def test_provenance_names_the_producer_its_inputs_and_the_users_line(paused):
    _, source = paused
    out = next(t for t in source.tensors() if t["name"] == "out.output")
    prov = source.provenance(out["ref"])
    assert prov["producer"] == {"module": "out", "type": "Linear", "call": 0}
    [inp] = prov["inputs"]
    assert inp["name"] == "out.input[0]" and inp["nonfinite"] is True
    # The root's own code made it (h / 0): not "out" (the UI said "<- out"), and not a module.
    assert (inp["module"], inp["made_by"]) == ("", "code")
    first = next(t for t in source.tensors() if t["name"] == "inp.output")
    [batch] = source.provenance(first["ref"])["inputs"]
    assert (batch["name"], batch["made_by"]) == ("input[0]", "the batch")
    line = inspect.getsource(Planted.forward).splitlines()
    expected = next(i for i, text in enumerate(line) if "return self.out(h)" in text)
    start = inspect.getsourcelines(Planted.forward)[1]
    assert prov["source"]["line"] == start + expected
    assert prov["source"]["function"] == "forward"
    assert any("self.out(h)" in text for _, text in prov["source"]["context"])
    assert prov["stack"][-1][0].endswith("paused.py")


def test_rules_can_be_listed_edited_added_and_rechecked_without_rerunning(paused):
    training, source = paused
    listing = source.rules()
    assert [r["name"] for r in listing["rules"]][:2] == ["NaN", "Overflow"]
    assert "TensorRange" in {a["name"] for a in listing["available"]}
    vanishing = next(r for r in listing["rules"] if r["name"] == "VanishingGradient")
    edited = source.set_rule(vanishing["id"], params={"threshold": 1.0})
    assert edited["params"]["threshold"] == 1.0
    with pytest.raises(SourceError, match="no threshold"):
        source.set_rule(vanishing["id"], params={"nonsense": 1})
    # Adding one says what is wrong as --rule does: the rules there are, the keywords it takes.
    with pytest.raises(SourceError, match="no rule named 'Nope'; the rules are: AllZero, "):
        source.add_rule("Nope")
    with pytest.raises(SourceError, match="TensorRange has no maxgt=; it takes min_lt, max_gt"):
        source.add_rule("TensorRange", params={"maxgt": 0.0})
    added = source.add_rule("TensorRange", match="inp.output", params={"max_gt": 0.0})
    assert added["match"] == ["inp.output"]
    before = len(training.session.hits)
    found = source.recheck()
    assert [h["tensor"] for h in found["hits"]] == ["inp.output"]
    assert (found["at"], found["unjudged"]) == ("step 3, forward", 0)
    assert len(training.session.hits) == before + 1
    assert source.set_rule(added["id"], enabled=False)["enabled"] is False


@pytest.mark.parametrize("sync", ["eager", "batched", "deferred"])
def test_a_recheck_says_which_tensors_its_new_rule_could_not_judge(sync):
    """A rule added while paused wants statistics nobody measured; a tensor no longer held
    cannot be measured now. The recheck said "no new hit", a claim about tensors it never
    judged: it counts them and says why."""
    with PausedTraining(sync=sync, retain_bytes=0) as training:
        training.wait_paused()
        source = LiveSource(training.session)
        source.add_rule("TensorRange", match="*.output", params={"max_gt": 0.0})
        found = source.recheck()
        judged = {h["tensor"] for h in found["hits"]}
        assert "mid.output" not in judged and {"inp.output", "act.output"} <= judged
        assert found["unjudged"] == 1 and found["why"].startswith("mid.output: ")
        assert training.session.recheck_unjudged == (1, found["why"])
        training.session.detach()


def test_stepping_runs_n_steps_then_pauses_again(paused):
    training, source = paused
    source.control("step", 2)
    training.wait(lambda: training.session.step == 5 and
                  training.session.controller.state == "paused")  # fmt: skip
    assert training.session.controller.reason == "stepped"
    # Paused between two steps: not in the optimizer phase of the last one, as it said.
    info = source.info()
    assert (info["step"], info["phase"], info["pause_reason"]) == (5, "", "stepped")
    assert training.session.status()["phase"] == ""


def test_paused_between_steps_the_modules_say_the_step_has_not_begun():
    """After ``s`` the training waits before its next step: with deferred checks (no clean
    output read) every row of the Modules tab said "not called this step", as if the model
    had not run (found trying it as a new user)."""
    with PausedTraining(steps=400, bad_step=-1, sync="deferred") as training:
        training.wait(lambda: training.session is not None and training.session.step > 2)
        source = LiveSource(training.session)
        source.control("pause", 1)
        training.wait_paused()
        step = training.session.step
        source.control("step", 1)  # s: to the end of this step
        training.wait(lambda: training.session.step == step + 1
                      and training.session.controller.state == "paused")  # fmt: skip
        assert training.session.where == ""  # between two steps
        notes = [m.get("note") for m in source.modules() if m["path"]]
        assert "not called yet: paused before this step began" in notes
        assert "not called this step" not in notes


def test_while_the_training_runs_the_modules_say_so_not_that_nothing_was_called():
    """Running in the default mode, every row of the Modules tab said "not called this step",
    refresh after refresh, while each step called every module (found by a new user)."""
    with PausedTraining(steps=400, bad_step=-1, sync="deferred") as training:
        training.wait(lambda: training.session is not None and training.session.step > 2)
        source = LiveSource(training.session)
        notes = {m.get("note") for m in source.modules() if m["path"]}
        assert notes == {"running: its statistics are read when the training pauses"}


def test_tensors_are_refused_while_the_training_runs_and_detach_lets_it_finish():
    with PausedTraining(steps=40, bad_step=-1, on_hit="record") as training:
        source = LiveSource(training.session)
        training.wait(lambda: len(training.session.history) > 1)
        with pytest.raises(SourceError, match="pause"):
            source.stats(0)
        assert source.control("detach")["state"] == "detached"
        training.finished.wait(30)
        assert training.session.detached and training.error is None


def test_bfloat16_tensors_travel_as_raw_words_with_their_dtype():
    with PausedTraining(dtype=torch.bfloat16) as training:
        training.wait_paused()
        source = LiveSource(training.session)
        t = next(t for t in source.tensors() if t["name"] == "out.output")
        reply = dispatch(source, "slice", {"ref": t["ref"]})
        assert reply["dtype"] == "bfloat16" and reply["data"].data.dtype == np.uint16
        expected = training.session.record(t["ref"]).tensor.detach().float().numpy()
        np.testing.assert_array_equal(reply["data"].to_numpy().astype(np.float32), expected)


def test_pausing_step_after_step_compares_a_tensor_with_its_previous_step():
    from tensordbg.rules import NaN, TensorRange

    every_step = TensorRange(match="out.output", abs_mean_gt=0.0)  # fires each step
    with PausedTraining(bad_step=-1, rules=[NaN(), every_step]) as training:
        training.wait_paused()
        source = LiveSource(training.session)
        first = source.stats(source.info()["paused_at"]["ref"])
        source.control("next")  # to the next hit: the same tensor, one step later
        training.wait(lambda: training.session.step == 1 and
                      training.session.controller.state == "paused")  # fmt: skip
        second = source.stats(source.info()["paused_at"]["ref"])
        assert second["name"] == first["name"] == "out.output"
        assert second["previous"]["step"] == first["step"] == 0 and second["step"] == 1
        assert second["previous"]["summary"] == first["summary"]


@pytest.mark.parametrize("sync", ["deferred", "eager"])
def test_the_step_before_a_forward_hit_is_compared_or_the_reason_it_cannot_be_is_given(sync):
    """Paused at a NaN made at step 3: eager checks measured the tensor at step 2, deferred
    checks did not (a clean step's activations are not read); the panel said only "no
    statistics of this tensor from the previous step", which looked like a fault."""
    with PausedTraining(sync=sync) as training:
        training.wait_paused()
        source = LiveSource(training.session)
        stats = source.stats(source.info()["paused_at"]["ref"])
        assert stats["step"] == 3
        if sync == "eager":
            assert stats["previous"]["step"] == 2 and "previous_why" not in stats
        else:
            assert stats["previous"] is None
            assert (
                "deferred checks (the CPU's default) measure a clean step's activations only"
                in stats["previous_why"]
                and "sync='eager'" in stats["previous_why"]
            )
        sliced = source.stats(source.info()["paused_at"]["ref"], "[0]")
        assert sliced["previous"] is None and "previous_why" not in sliced  # a slice: none


def test_a_tensor_a_module_returned_as_its_own_output_is_listed_under_it_too(paused):
    _, source = paused
    out = next(t for t in source.tensors() if t["name"] == "out.output")
    assert out["module"] == "out" and out["passed_up"] == [""]  # the model returned it
    inp = next(t for t in source.tensors() if t["name"] == "inp.output")
    assert inp["passed_up"] == []


def test_a_parameter_gradients_provenance_is_its_modules_backward_at_one_user_line():
    """The gradient of a Linear inside a Sequential: made by that Linear's backward, consumed by
    the optimizer (no module call), called from one line of the user's code (shown once, though
    the Sequential and the Linear were both called from it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tensordbg.attach(model, optimizer=optimizer, on_hit="record") as session:
        loss = model(torch.randn(3, 4)).pow(2).mean()  # the user's line
        line = inspect.currentframe().f_lineno - 1
        loss.backward()
        source = LiveSource(session)
        grad = next(t for t in source.tensors() if t["name"] == "2.weight.grad")
        prov = source.provenance(grad["ref"])
    assert prov["producer"] == {"module": "2", "type": "Linear", "call": 0}
    assert prov["consumers"] == []
    assert prov["stack"] == [[__file__, line, inspect.currentframe().f_code.co_name]]
    assert prov["source"]["line"] == line


def test_continue_leaves_the_rule_it_paused_on_for_that_phase_and_next_stops_at_each_hit():
    """A rule that fires on several tensors of one phase (as ExplodingGradient does on every
    parameter when gradients blow up) pauses once there under c, which goes on to the next new
    problem; n stops at each hit. Every hit is recorded either way."""
    from tensordbg.rules import NaN, TensorRange

    gradients = TensorRange(match="*.weight.grad", abs_mean_gt=0.0)  # every weight, every step
    with PausedTraining(bad_step=2, rules=[gradients, NaN()]) as training:
        training.wait_paused()
        session, control = training.session, training.session.controller
        first = control.paused_at
        assert (first.tensor, first.step, first.phase) == ("out.weight.grad", 0, "backward")

        control.resume("next")  # n: the next hit, in the same phase
        training.wait(lambda: control.state == "paused" and control.paused_at is not first)
        second = control.paused_at
        assert (second.tensor, second.step) == ("mid.weight.grad", 0)

        control.resume("continue")  # c: not inp.weight.grad of this phase: the NaN of step 2
        training.wait(lambda: control.state == "paused" and control.paused_at is not second)
        third = control.paused_at
        assert (third.rule, third.step, third.module) == ("NaN", 2, "")
        step0 = [(h.tensor, h.origin) for h in session.hits if h.step == 0]
        assert step0 == [(f"{m}.weight.grad", True) for m in ("out", "mid", "inp")]


def test_a_rule_that_hangs_is_named_to_the_ui_while_the_training_waits_on_it():
    import threading

    from models import hanging_rule, two_linears

    slow, release, entered = hanging_rule("fc2")
    model = two_linears()
    session = tensordbg.attach(model, rules=[slow], server=False, on_hit="record", sync="eager")
    source = LiveSource(session)
    assert source.info()["running_rule"] is None
    worker = threading.Thread(target=lambda: model(torch.randn(3, 4)).sum().backward())
    worker.start()
    try:
        assert entered.wait(30)
        running = source.info()["running_rule"]
        assert running["rule"] == "Slow" and running["tensor"] == "fc2.output"
        assert running["seconds"] >= 0
    finally:
        release.set()
        worker.join(30)
        session.detach()
    assert source.info()["running_rule"] is None


def test_the_module_tree_gives_each_output_its_range_while_paused(paused):
    """Deferred mode screens a clean activation only as finite; paused, the Modules tab shows
    the range of every output still kept, so a blow-up is visible there."""
    training, source = paused
    assert training.session.mode == "deferred"
    modules = {m["path"]: m for m in source.modules()}
    mid, act = modules["mid"]["stats"]["output"], modules["act"]["stats"]["output"]
    assert mid["step"] == act["step"] == 3
    assert mid["min"] < 0 < mid["max"] and mid["numel"] == 16 * 32
    assert -0.2 < act["min"] < 0 < act["max"]  # GELU's outputs stay above -0.17


@pytest.mark.parametrize("sync", ["auto", "eager", "batched"])
def test_an_update_without_values_says_why_truthfully(watch, sync):
    """Opening head.weight.update said it "was not kept (the phase's tensors passed
    retain_bytes=256 MiB)" for a 433-parameter model (found by a new user): an update is
    measured, never kept, whatever the budget."""
    from tensordbg.rules import WeightNotChanging

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[1].parameters(), "lr": 0.0}], lr=0.1)  # fmt: skip
    said = []

    def open_it(hit):
        try:
            LiveSource(session).stats(hit.ref)
        except SourceError as e:
            said.append(str(e))

    session = watch(model, optimizer=opt, on_hit=open_it, rules=[WeightNotChanging()],
                    sync=sync)  # fmt: skip
    for _ in range(4):  # unchanged at steps 1, 2 and 3 (step 0 is its first)
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    assert said and all("retain_bytes" not in s for s in said), said
    assert "1.weight.update was not kept (an update, the weights after the step against " \
           "before, is measured, never kept: open 1.weight" in said[0]  # fmt: skip


@pytest.mark.parametrize("sync", ["eager", "batched", "deferred"])
def test_a_tensor_of_a_phase_that_ended_before_the_pause_says_so(sync):
    """A rank paused at the job's safe point after its backward phase ended lists that phase's
    gradients, let go when the phase ended; opening one said "the phase's tensors passed
    retain_bytes=256 MiB" of a 252-parameter model."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    session = tensordbg.attach(model, server=False, sync=sync, on_hit="record")
    try:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        session.flush()
        grad = next(r for r in session.phases.records if r.stats.name == "0.weight.grad")
        assert session.phases.released
        if sync == "eager":  # held weakly: .grad still holds it, and it can be opened
            assert grad.tensor is None and grad.held() is model[0].weight.grad
            return
        assert grad.held() is None
        why = session.why_not_kept(grad)
        assert why.startswith("its phase, step 0's backward, ended before the training paused")
        assert "retain_bytes" not in why
    finally:
        session.detach()


def test_a_parameter_the_update_wrote_comes_from_the_optimizers_step_line():
    """Provenance of a weight the update made NaN named its module's forward call and line
    ("produced by emb Linear, call 0"), though the hit said the update wrote it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = tensordbg.attach(model, optimizer=opt, server=False, on_hit="record")
    try:
        loss = model(torch.randn(3, 4)).sum() * float("nan")
        loss.backward()
        opt.step()  # the update writes NaN into every parameter: this line
        line = inspect.currentframe().f_lineno - 1
        session.flush()
        weight = next(r for r in session.phases.records
                      if r.stats.name == "0.weight" and r.stats.phase == "optimizer")  # fmt: skip
        prov = LiveSource(session).provenance(weight.stats.ref)
        assert prov["producer"] == {"module": "optimizer", "type": "SGD.step", "call": 0}
        assert prov["consumers"] == [] and prov["source"]["line"] == line
        assert prov["stack"] == [[__file__, line, inspect.currentframe().f_code.co_name]]
    finally:
        session.detach()


class _OwnCodeBlock(torch.nn.Module):
    """Its own code makes the NaN between fc1 and fc2: the hit names ``1.output``, stored as
    ``1.fc2.output``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h / torch.zeros_like(h) * 0)


def test_a_module_whose_own_code_was_the_origin_shows_that_output_after_its_phase():
    """A rank paused after the forward phase ended (at the job's safe point) listed the origin's
    module as "not read (deferred checks read outputs at a problem)": the hit's statistics are
    its output's."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _OwnCodeBlock())
    session = tensordbg.attach(model, server=False, on_hit="record", sync="deferred")
    try:
        loss = model(torch.randn(3, 4)).pow(2).mean()
        loss.backward()  # the forward phase has ended; the step has not
        assert [h.tensor for h in session.hits if h.origin] == ["1.output"]
        row = next(r for r in LiveSource(session).modules() if r["path"] == "1")
        assert row["stats"]["output"]["nan"] == 12 and "note" not in row, row
    finally:
        session.detach()


def test_paused_in_the_forward_the_modules_not_reached_yet_say_so():
    """After a pause in the forward (a hit, or p), the modules the step had not reached yet
    said "not called this step": they are called later in it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 2))  # fmt: skip
    model[1].register_forward_hook(lambda m, i, o: o * float("nan"))  # its output: a hit
    session = tensordbg.attach(model, server=False, on_hit="pause", sync="eager")
    notes = {}

    def look():
        wait_until(lambda: session.controller.state == "paused")
        notes.update({m["path"]: m.get("note") for m in LiveSource(session).modules()})
        session.detach()

    helper = threading.Thread(target=look)
    helper.start()
    model(torch.randn(3, 4))
    helper.join(30)
    assert notes["2"] == "not called yet: paused in this step's forward before it", notes


def test_paused_in_a_later_micro_batch_a_module_not_reached_says_which_call_it_shows():
    """Gradient accumulation, paused in the third micro-batch's forward at 1: the Modules tab
    showed 2's statistics from the second micro-batch, unmarked, as if they were this one's
    (after c they turned out to be NaN). They say which call of the step they are from."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 2))  # fmt: skip
    calls = [0]

    def third_is_bad(module, args, out):
        calls[0] += 1
        return out * float("nan") if calls[0] == 3 else out

    model[1].register_forward_hook(third_is_bad)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # the three calls are one step
    session = tensordbg.attach(model, optimizer=opt, server=False, on_hit="pause", sync="eager")
    stats = {}

    def look():
        wait_until(lambda: session.controller.state == "paused")
        stats.update({m["path"]: m["stats"].get("output") for m in LiveSource(session).modules()})
        session.detach()

    helper = threading.Thread(target=look)
    helper.start()
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
    opt.step()
    helper.join(30)
    assert stats["2"]["call"] == 1, stats["2"]
    from tensordbg.tui.components.module_table import ModuleTable

    assert ModuleTable()._brief(stats["2"]).startswith("#1: n=6 ")


def test_a_ui_that_connects_to_a_paused_training_is_said_on_its_terminal(capsys):
    """The pause line said "inspect it: tensordbg tui ..." when a UI waiting with --wait
    connected a moment later: the terminal never said one had come, and the line stood as if
    nobody were there."""
    with PausedTraining() as training:
        training.wait_paused()
        source = LiveSource(training.session)
        source.on_clients(1)
        source.on_clients(2)  # the second UI is not said again
        source.on_clients(0)
        said = [line for line in capsys.readouterr().err.splitlines() if "a UI connected" in line]
        assert said == [f"tensordbg: a UI connected ({training.session.at}); continue with c "
                        "there"], said  # fmt: skip


def test_a_weight_set_by_hand_has_no_producer_nor_a_forward_line():
    """Provenance of a weight set to Inf between steps said "produced by 0 Linear, call 0" and
    pointed at the line that called the model: no call made its value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = tensordbg.attach(model, optimizer=opt, server=False, on_hit="record", sync="eager")
    try:
        with torch.no_grad():
            model[0].weight[1, 1] = float("inf")
        model(torch.randn(3, 4))
        hit = next(h for h in session.hits if h.origin)
        assert (hit.tensor, hit.kind) == ("0.weight", "param")
        prov = LiveSource(session).provenance(hit.ref)
        assert prov["producer"] is None and prov["source"] is None and prov["stack"] == []
        assert [c["module"] for c in prov["consumers"]] == ["0"]
    finally:
        session.detach()
