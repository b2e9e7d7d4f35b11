"""What the engine promises beyond finding hits, through its public surface only
(``tensordbg.attach``, the ``Session`` it returns, ``LiveSource`` and ``tensordbg.rules``): a
failed attach leaves nothing behind, rules edited from another thread while the training runs are
all applied, the number of hits kept is capped, and a subscriber's fault never stops the training.
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from conftest import DEADLINE, wait_until
from models import mlp

import tensordbg
from tensordbg.rules import NaN
from tensordbg.sources.live import LiveSource


def nan_batch() -> torch.Tensor:
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    return x


def train_step(model, optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def hooks_left(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Where a hook is still installed on the model, its parameters or the optimizer."""
    left = []
    for path, module in model.named_modules():
        for hooks in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                      "_backward_hooks"):  # fmt: skip
            if getattr(module, hooks):
                left.append(f"module {path!r} {hooks}")
    for name, param in model.named_parameters():
        for hooks in ("_post_accumulate_grad_hooks", "_backward_hooks"):
            if getattr(param, hooks, None):
                left.append(f"parameter {name} {hooks}")
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if getattr(optimizer, hooks):
            left.append(f"optimizer {hooks}")
    return left


# --- a hit at attach ---------------------------------------------------------------------------


def test_a_hit_at_attach_in_raise_mode_leaves_nothing_installed(private_runtime_dir):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")  # as a broken checkpoint would load it
    threads = set(threading.enumerate())
    with pytest.raises(tensordbg.WatchpointHit) as caught:
        tensordbg.attach(model, optimizer=optimizer, on_hit="raise").detach()
    hit = caught.value.hit
    assert (hit.rule, hit.tensor, hit.kind, hit.origin) == ("NaN", "2.weight", "param", True)
    # Nothing stays behind: no hook, no server thread, no connection file or socket.
    assert hooks_left(model, optimizer) == []
    wait_until(lambda: set(threading.enumerate()) <= threads, timeout=5)
    assert [p.name for p in private_runtime_dir.rglob("*") if not p.is_dir()] == []
    # The message says what was found, and that it was found at attach: fix it, attach again.
    message = str(caught.value)
    assert "2.weight" in message and "attach" in message, message
    with torch.no_grad():
        model[2].weight[0, 0] = 0.0
    with tensordbg.attach(model, optimizer=optimizer, on_hit="raise") as session:
        train_step(model, optimizer, torch.randn(3, 4))
    assert session.step == 1 and session.hits == []


def test_a_hit_at_attach_is_said_to_be_attachs_not_an_optimizer_phase_that_never_ran(watch):
    """Found by attach's check, a weight's Inf was listed "step 0 optimizer", as if a step's
    update had made it; no optimizer had run. Its phase is attach's, wherever it is shown, and a
    check asked for between steps says it is one."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model[2].weight[0, 0] = float("inf")
    session = watch(model, optimizer=optimizer, on_hit="record")
    [hit] = session.hits
    assert (hit.tensor, hit.step, hit.phase, hit.origin) == ("2.weight", 0, "attach", True)
    assert "step 0 attach (origin)" in str(hit)
    assert "step 0 attach: [Overflow] 2.weight" in session.summary()
    with torch.no_grad():
        model[2].weight[0, 0] = 0.0
    train_step(model, optimizer, torch.randn(3, 4))
    with torch.no_grad():
        model[0].weight[1, 1] = float("nan")
    session.check_parameters()
    [checked] = session.hits[1:]
    assert (checked.tensor, checked.step, checked.phase) == ("0.weight", 1, "check")
    assert "when it attached" not in checked.message  # said of attach's check only
    assert "session.check_parameters() found it between steps" in checked.message
    # Another phase's name would tell the person that an update made what the check found.
    with pytest.raises(ValueError, match="phase must be 'attach' or 'check', not 'optimizer'"):
        session.check_parameters("optimizer")
    assert len(session.hits) == 2 and session.phase == "check"


def test_on_hit_skip_does_not_skip_step_0_for_a_weight_found_bad_at_attach(watch):
    """A hit of attach's check (its phase is no longer the optimizer's) is recorded as a
    parameter's hit after an update is: skipping step 0's update would not mend the weight."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model[2].weight[0, 0] = float("inf")
    session = watch(model, optimizer=optimizer, on_hit="skip")
    assert [h.phase for h in session.hits] == ["attach"]
    with torch.no_grad():
        model[2].weight[0, 0] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, optimizer, torch.randn(3, 4))
    assert session.skipped_steps == []
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


# --- rules edited while the training runs ------------------------------------------------------


def test_rule_edits_from_another_thread_while_training_are_all_applied(watch):
    """A UI edits rules from the server's thread at any moment. Each edit takes effect at the
    next boundary of the training (disabling NaN mid-step: no NaN hit from the next step on), and
    none is lost however many arrive while the training runs."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record")
    source = LiveSource(session)
    rule_id = {rule["name"]: rule["id"] for rule in source.rules()["rules"]}
    failed: list[BaseException] = []

    def edit_many() -> None:
        """Edits thresholds and adds rules, faster than any person would."""
        for i in range(300):
            source.set_rule(rule_id["ExplodingGradient"], params={"max_norm": 1e6 + i})
            source.set_rule(rule_id["VanishingGradient"], params={"threshold": 1e-7 / (1 + i)})
            if i < 100:
                source.add_rule("AllZero", match=f"no.such.tensor.{i}")
            time.sleep(0.001)  # let the training thread in between edits

    def on_another_thread(edit) -> threading.Thread:
        def run() -> None:
            try:
                edit()
            except BaseException as e:
                failed.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    toggles = {3: False, 6: True}  # step -> NaN enabled, set in the middle of that step's forward

    def mid_forward(module, args, output) -> None:
        if session.step in toggles:
            enabled = toggles.pop(session.step)
            toggle = on_another_thread(lambda: source.set_rule(rule_id["NaN"], enabled=enabled))
            toggle.join(DEADLINE)

    model[2].register_forward_hook(mid_forward)
    editor = on_another_thread(edit_many)
    deadline = time.monotonic() + DEADLINE
    while session.step < 10 or (editor.is_alive() and time.monotonic() < deadline):
        train_step(model, optimizer, nan_batch())  # NaN hits in every step while NaN is on
    editor.join(DEADLINE)
    assert not editor.is_alive() and failed == []
    train_step(model, optimizer, nan_batch())  # a boundary after the last edit
    nan_steps = {h.step for h in session.hits if h.rule == "NaN"}
    assert {0, 1, 2} <= nan_steps and {7, 8, 9} <= nan_steps
    assert not nan_steps & {4, 5}  # disabled during step 3, enabled again during step 6
    rules = {active.rule.name: active for active in session.rules}
    assert rules["ExplodingGradient"].rule.params()["max_norm"] == 1e6 + 299
    assert rules["VanishingGradient"].rule.params()["threshold"] == 1e-7 / 300
    added = [active.rule.match for active in session.rules if active.rule.name == "AllZero"]
    assert sorted(added) == sorted((f"no.such.tensor.{i}",) for i in range(100))


# --- the hit cap ------------------------------------------------------------------------------


def test_past_max_hits_only_hits_at_their_origin_are_kept_and_the_training_goes_on(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record", rules=[NaN()])
    session.max_hits = 20
    logs: list[dict] = []
    session.subscribe(lambda event, payload: logs.append(payload) if event == "log" else None)
    for _ in range(6):  # a training that stays NaN: a NaN batch, the origin, every step
        train_step(model, optimizer, nan_batch())
    assert session.step == 6 and not session.broken
    assert len(session.hits) > session.max_hits
    past_the_cap = session.hits[session.max_hits :]
    assert all(h.origin for h in past_the_cap)
    assert [h.step for h in past_the_cap if h.tensor == "input[0]"][-3:] == [3, 4, 5]
    warnings_logged = [p["message"] for p in logs if p["level"] == "warning"]
    assert len(warnings_logged) == 1 and "max_hits" in warnings_logged[0]


# --- subscribers -------------------------------------------------------------------------------


def test_a_subscriber_that_raises_is_disabled_with_one_warning_and_the_training_goes_on(watch):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = watch(model, optimizer=optimizer, on_hit="record")
    broken_calls: list[str] = []
    events: list[str] = []

    def broken(event: str, payload: dict) -> None:
        broken_calls.append(event)
        raise ValueError("bad subscriber")

    session.subscribe(broken)
    session.subscribe(lambda event, payload: events.append(event))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # hits and a status after every step: many events
            train_step(model, optimizer, nan_batch())
    assert session.step == 3 and not session.broken
    assert len(broken_calls) == 1  # called once, then disabled
    assert "hit" in events and "status" in events  # the other subscriber is still served
    about_it = [w for w in caught if "bad subscriber" in str(w.message)]
    assert [w.category for w in about_it] == [RuntimeWarning]


def test_help_of_attach_says_what_every_option_does_and_completion_offers_the_api():
    """The README sends people to help(tensordbg.attach) for its options: run_id and rank
    were missing from it, and dir(tensordbg) offered neither attach, load nor profile (they
    load on first use), found trying it as a new user."""
    import inspect

    import tensordbg

    doc = inspect.getdoc(tensordbg.attach)
    for name in inspect.signature(tensordbg.attach).parameters:
        assert f"\n    {name}:" in doc or f"\n{name}:" in doc, name
    assert {"attach", "load", "profile", "Session", "rules"} <= set(dir(tensordbg))
    assert "__version__" in dir(tensordbg)


def test_a_summary_with_no_hit_at_its_origin_still_shows_where_the_first_came_from(watch):
    """Rank 0 of a job whose NaN rank 1 made ended with "tensordbg (rank 0): 192 hits, 0 at
    their origin." alone, though each of its hits said "It came from rank 1 ..." (found trying
    two ranks as a new user): with no origin here, the summary shows the first hit."""
    model = mlp()
    session = watch(model, on_hit="record")
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    for hit in session.hits:  # as the ranks make them: passed on, from another rank
        hit.origin = False
    session.hits[0].message += " It came from rank 1 (NaN at mid.1.output)."
    lines = session.summary().splitlines()
    assert lines[0].endswith("hits, 0 at their origin.")
    assert lines[1].startswith(f"  step 0 forward: [NaN] {session.hits[0].tensor}")
    assert lines[2].endswith("It came from rank 1 (NaN at mid.1.output).")
