"""Every Source keeps the contract of ``tensordbg.sources.contract``: its replies and events match
their schemas, a ref it does not know gets a sentence, and it serves exactly what it declares.

The suite runs once per scene of :data:`SCENES`: a real training paused on its planted NaN, the
tests' FakeSource, and the FakeSource standing for a recorded run (it serves READ_ONLY). A new
source (a ReplaySource over a dump) joins with one line there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import pytest
from fake_source import FakeSource
from paused import PausedTraining

from tensordbg.sources.contract import (
    EVENTS,
    EVERY_REQUEST,
    METHODS,
    NEEDED,
    READ_ONLY,
    REPLIES,
    Control,
    Hit,
    Info,
    SchemaError,
    SourceError,
    Stats,
    Summary,
    Welcome,
    capabilities_of,
    check,
    conforms,
    dispatch,
    refusal,
)
from tensordbg.sources.live import LiveSource
from tensordbg.sources.replay import ReplaySource
from tensordbg.transport.server import welcome
from tensordbg.transport.wire import roundtrip


class Scene(NamedTuple):
    source: Any
    step: Callable[[], None] | None
    """Run one training step to the next pause, the source pushing its events; None for a source
    that cannot be driven."""


@contextmanager
def fake() -> Iterator[Scene]:
    source = FakeSource()

    def step() -> None:
        dispatch(source, "control", {"action": "step"})
        source.pause_on_hit()  # the next step runs into another NaN

    yield Scene(source, step)


@contextmanager
def fake_recording() -> Iterator[Scene]:
    yield Scene(FakeSource(capabilities=READ_ONLY), None)


@contextmanager
def live() -> Iterator[Scene]:
    with PausedTraining() as training:
        training.wait_paused()
        session = training.session
        source = LiveSource(session)

        def step() -> None:
            before = session.step
            dispatch(source, "control", {"action": "step"})
            training.wait(lambda: session.step > before and session.controller.state == "paused")

        yield Scene(source, step)


@contextmanager
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    from dumps import write_dump

    from tensordbg.dump import load

    yield Scene(ReplaySource(load(write_dump(tmp_path_factory.mktemp("dump") / "run"))), None)


SCENES: dict[str, Callable[..., Any]] = {
    "live": live,
    "fake": fake,
    "fake recording": fake_recording,
    "replay": replay,
}


@pytest.fixture(scope="module", params=list(SCENES))
def scene(request: pytest.FixtureRequest) -> Iterator[Scene]:
    """One paused scene for all the tests of this module: they derive what they ask from what
    the source says now, so a step taken by one does not upset the next."""
    make = SCENES[request.param]
    needs_dir = request.param == "replay"
    with make(request.getfixturevalue("tmp_path_factory")) if needs_dir else make() as scene:
        yield scene


def typical_requests(source: Any) -> dict[str, dict[str, Any]]:
    """One request of each kind that a paused session answers, its parameters taken from the
    source's own replies (a retained tensor, a rule), none of them changing what it judges."""
    info = source.info()
    ref = info["paused_at"]["ref"] if info["paused_at"] else source.tensors()[0]["ref"]
    rules = source.rules()
    rule = rules["rules"][0]
    return {
        "info": {},
        "modules": {},
        "hits": {"since": 0},
        "tensors": {},
        "stats": {"ref": ref, "text": "[0]"},
        "slice": {"ref": ref, "window": [[0, 2], [0, 2]]},
        "find": {"ref": ref, "after": 0},
        "histogram": {"ref": ref, "bins": 8},
        "provenance": {"ref": ref},
        "rules": {},
        "set_rule": {"id": rule["id"], "enabled": rule["enabled"]},
        "add_rule": {"name": rules["available"][0]["name"], "match": "no.such.tensor"},
        "recheck": {},
        "control": {"action": "pause"},  # paused already: nothing moves
        "goto": {"move": 0},  # a recording: stays on the step it shows
        "profile": {"steps": 2},
        "profile_report": {},
        "gpu": {"since": 0.0},
    }


def test_every_request_a_source_serves_gets_a_reply_of_its_schema(scene: Scene) -> None:
    source = scene.source
    serves = capabilities_of(source)
    requests = typical_requests(source)
    assert set(requests) == set(METHODS)
    for method in METHODS:
        if method in serves:
            reply = roundtrip(dispatch(source, method, requests[method]))  # as a client sees it
            check(reply, REPLIES[method], name=method, strict=True)


def test_the_hello_reply_and_the_pushed_events_match_their_schemas(scene: Scene) -> None:
    check(roundtrip(welcome(scene.source)), Welcome, name="hello", strict=True)
    if scene.step is None:
        return
    pushed: list[tuple[str, Any]] = []
    unsubscribe = scene.source.subscribe(lambda event, payload: pushed.append((event, payload)))
    try:
        scene.step()
    finally:
        unsubscribe()
    assert "state" in {event for event, _ in pushed}
    for event, payload in pushed:
        check(roundtrip(payload), EVENTS[event], name=f"{event} event", strict=True)


def test_a_ref_or_rule_the_source_does_not_know_gets_a_sentence(scene: Scene) -> None:
    source = scene.source
    serves = capabilities_of(source)
    unknown = {
        "stats": {"ref": 10**9},
        "slice": {"ref": 10**9},
        "histogram": {"ref": 10**9},
        "provenance": {"ref": 10**9},
        "set_rule": {"id": 10**6, "enabled": False},
    }
    for method, params in unknown.items():
        if method not in serves:
            continue
        with pytest.raises(SourceError) as refused:
            dispatch(source, method, params)
        assert str(refused.value) and "Traceback" not in str(refused.value), method


def test_a_source_serves_what_it_declares_and_refuses_the_rest_unasked(
    scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = scene.source
    serves = capabilities_of(source)
    assert NEEDED <= serves <= set(METHODS)
    assert dispatch(source, "info", {})["capabilities"] == sorted(serves)
    requests = typical_requests(source)
    for method in set(METHODS) - serves:
        # The refusal comes before the source is asked anything.
        monkeypatch.setattr(source, method, lambda m=method, **_: pytest.fail(f"{m} was run"),
                            raising=False)  # fmt: skip
        with pytest.raises(SourceError) as refused:
            dispatch(source, method, requests[method])
        assert str(refused.value) == refusal(method, serves)


def test_a_request_outside_the_contract_is_refused(scene: Scene) -> None:
    for method, params in [("__class__", {}), ("stats", {"ref": "3"}), ("hits", {"all": 1})]:
        with pytest.raises(SourceError):
            dispatch(scene.source, method, params)


def test_a_recorded_run_says_it_cannot_be_driven() -> None:
    source = FakeSource(capabilities=READ_ONLY)
    with pytest.raises(SourceError) as refused:
        dispatch(source, "control", {"action": "continue"})
    assert str(refused.value) == (
        "this session is a recorded run, not a running training: it cannot drive the training "
        "(continue, run to the next hit, step, pause, skip an update or detach)"
    )
    assert source.controls == [] and source.state == "paused"
    assert refusal("add_rule", READ_ONLY).endswith("it cannot add a rule")
    readable = {"info", "modules", "hits", "tensors", "stats", "slice", "find", "histogram",
                "provenance"}  # fmt: skip
    assert readable | {"rules", "profile_report"} == READ_ONLY


def test_a_capabilities_declaration_names_requests_of_the_contract() -> None:
    odd = FakeSource(capabilities=frozenset({"info", "hits", "teleport"}))
    with pytest.raises(TypeError, match="teleport"):
        dispatch(odd, "info", {})
    silent = FakeSource(capabilities=frozenset({"info", "stats"}))  # no hits: no hello reply
    with pytest.raises(TypeError, match="info and hits"):
        dispatch(silent, "info", {})

    class Undeclared:  # a source from before capabilities serves everything
        pass

    assert capabilities_of(Undeclared()) == EVERY_REQUEST


# --- the checker -----------------------------------------------------------------------------


def test_the_checker_says_which_field_is_wrong_and_how() -> None:
    def problem(value: Any, schema: Any) -> str:
        with pytest.raises(SchemaError) as error:
            check(value, schema, name="reply")
        return str(error.value)

    assert problem({"state": "paused"}, Control) == "reply: missing 'step'"
    assert problem({"state": "paused", "step": "3"}, Control) == (
        "reply.step: expected int, got '3'"
    )
    assert problem({"state": "paused", "step": True}, Control) == (
        "reply.step: expected int, got True"  # a bool is no number on the wire
    )
    assert problem({"state": "asleep", "step": 3}, Control) == (
        "reply.state: expected 'running' or 'paused' or 'detached' or 'finished' or 'replay', "
        "got 'asleep'"
    )
    stats = FakeSource().stats(3)
    stats["summary"]["numel"] = 32.5
    assert problem(stats, Stats) == "reply.summary.numel: expected int, got 32.5"
    stats = FakeSource().stats(3)
    stats["summary"]["nan"] = "2"
    assert problem(stats, Stats) == "reply.summary.nan: expected float, got '2'"
    stats = FakeSource().stats(3)
    stats["previous"] = {"step": 2}
    assert problem(stats, Stats) == "reply.previous: missing 'summary'"
    hits = FakeSource().hits()
    hits[1]["threshold"] = "high"
    assert problem(hits, list[Hit]) == "reply[1].threshold: expected float or None, got 'high'"
    assert problem(None, Info) == "reply: expected an object (Info), got None"

    assert conforms({"state": "paused", "step": 3, "reason": "hit"}, EVENTS["state"])
    assert conforms({"state": "paused", "step": 3}, EVENTS["state"])  # reason is optional
    assert conforms({"step": 2.5}, Summary) is False  # a step is counted
    assert conforms({"min": 1, "max": 2.0}, Summary)  # an int is a float


def test_only_a_strict_check_refuses_keys_the_schema_does_not_name() -> None:
    reply = {"state": "paused", "step": 3, "eta": 12.0}
    check(reply, Control)  # a newer source may say more: the UI ignores it
    with pytest.raises(SchemaError, match="'eta' is not in the schema of Control"):
        check(reply, Control, strict=True)
    # A summary holds whatever statistics the rules computed, by name.
    check({"numel": 4, "zero_frac": 0.25}, Summary, strict=True)


def test_a_tensors_provenance_names_its_step(scene: Scene) -> None:
    """After `s` the Provenance tab still showed the hit's tensor of the step before, and did
    not say so: the header read "PAUSED at step 13" over step 12's provenance (found trying the
    product as a new user). Every source names the step (the tab shows it)."""
    source = scene.source
    paused = source.info()["paused_at"]
    if paused is None or "provenance" not in capabilities_of(source):
        pytest.skip("this source is not paused at a hit")
    prov = roundtrip(dispatch(source, "provenance", {"ref": paused["ref"]}))
    assert prov["step"] == paused["step"]
