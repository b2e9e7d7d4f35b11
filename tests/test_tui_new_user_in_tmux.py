"""What a new user's trial of the UI in tmux found (a training that goes NaN in mid.norm at step
5, two UIs on it, a replay of its dump, a training on TCP): each test is one finding."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import zmq
from fake_source import FakeSource
from test_tui import SIZE, paused_on_the_two_hits, shown, text_of, until
from test_tui_errors import in_the_log, log_text, notified
from test_tui_newcomer import screen_text
from textual.widgets import Input, Static

from tensordbg.transport.client import LocalClient
from tensordbg.transport.server import Server
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.launch import run_tui, session_app
from tensordbg.tui.remote import step_phrase
from tensordbg.tui.screens.profile_steps import ProfileStepsScreen

SMALL = (80, 24)


def _counting_connections(source: FakeSource) -> tuple[list[str | None], Any]:
    """A connect function to ``source`` and the list of the paths it was asked for: how often
    the UI tried to (re)connect."""
    connections: list[str | None] = []

    async def connect(path: str | None) -> LocalClient:
        connections.append(path)
        return LocalClient(source)

    return connections, connect


def test_a_detach_mid_step_is_named_by_its_step_and_phase() -> None:
    """Finding 1, the words: detached in step 3's forward pass, the UI said "after step 2"; the
    training had printed "detached (step 3, forward)". Between two steps the step is the next
    one, which never began, and "after step N-1" stays right."""
    assert step_phrase("detached", 3, "forward") == "at step 3 (forward)"
    assert step_phrase("detached", 3, "") == "after step 2"
    assert step_phrase("finished", 29) == "after step 28"
    assert step_phrase("paused", 3, "forward") == "at step 3"  # the Run tab adds the phase


def test_a_second_ui_says_another_one_detached_the_training_and_where() -> None:
    """Finding 1: two UIs on a training paused at step 3 forward; q in the other one. This UI's
    title said "DETACHED after step 2", its Log "state: detached after step 2", and no banner
    said why (FINISHED had one). It names the step and phase, says the training goes on
    unwatched and what detaches it, and does not try to reconnect to a session that is gone."""
    source = FakeSource()
    connections, connect = _counting_connections(source)

    async def flow() -> None:
        app = TensorDbgApp(connect, reconnect_delay=0.02)
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            source.state = "detached"  # the engine says it twice, the phase the second time
            source.emit("state", {"state": "detached", "step": 3, "reason": "", "skippable": True})
            source.emit("state", {"state": "detached", "step": 3, "phase": "forward"})
            await until(pilot, lambda: app.state == "detached")
            assert app.main.title == "DETACHED at step 3 (forward)"
            banner = app.main.banner
            await until(pilot, lambda: "was detached" in text_of(banner))
            assert text_of(banner).startswith(
                "tensordbg was detached at step 3 (forward) (by a UI's q or by "
                "session.detach() in the script): the training goes on, unwatched"
            )
            assert text_of(banner).endswith("Press q to quit.")
            state = text_of(app.query_one("#run-state", Static))
            assert "DETACHED" in state and "at step 3 (forward)" in state
            await in_the_log(pilot, "state: detached at step 3 (forward)")
            assert "after step 2" not in log_text(app)
            await pilot.pause(0.3)
            assert connections == [None]  # nothing left to reconnect to
            assert "Reconnecting" not in text_of(banner)

    asyncio.run(flow())


def test_after_a_training_finished_the_ui_does_not_claim_to_reconnect() -> None:
    """Finding 9: after a training on TCP ended, the banner said "The training has finished and
    closed the connection ... Reconnecting in the background...". A training that said it
    finished has nothing to reconnect to: the banner says it finished, and no attempt follows."""
    source = FakeSource()
    connections, connect = _counting_connections(source)

    async def flow() -> None:
        app = TensorDbgApp(connect, reconnect_delay=0.02)
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            source.state = "finished"
            source.emit("state", {"state": "finished", "step": 30, "phase": ""})
            banner = app.main.banner
            await until(pilot, lambda: "has finished" in text_of(banner))
            assert text_of(banner) == ("The training has finished after step 29. The last state "
                                       "stays on screen. Press q to quit.")  # fmt: skip
            await pilot.pause(0.3)
            assert connections == [None]
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running)

    asyncio.run(flow())


def test_esc_and_a_change_of_tab_drop_the_count_and_k_skips_one_update() -> None:
    """Finding 3: 5, Esc, F3 still showed "count 5", and s then ran five steps; 5 then k logged
    "control skip (n=5)" where one update was skipped. Esc and a change of tab drop the count,
    and a count is sent only with s, the key it repeats."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            await pilot.press("5")
            assert "count 5" in app.main.title
            await pilot.press("escape")
            assert "count" not in app.main.title
            await pilot.press("f3")
            await pilot.press("4")
            assert "count 4" in app.main.title
            await pilot.press("f2")  # another tab: the count was for this one's keys
            assert "count" not in app.main.title
            await pilot.press("5", "k")
            await until(pilot, lambda: source.controls)
            assert source.controls == [("skip", 1)]
            assert "count" not in app.main.title
            await pilot.press("s")
            await until(pilot, lambda: len(source.controls) == 2)
            assert source.controls[1] == ("step", 1)  # the 5 went with k

    asyncio.run(flow())


@pytest.fixture
def replay_app(tmp_path: Path) -> TensorDbgApp:
    from dumps import write_dump

    from tensordbg.dump import load
    from tensordbg.sources.replay import ReplaySource

    app = TensorDbgApp(LocalClient(ReplaySource(load(write_dump(tmp_path / "run")))))
    app.NOTIFICATION_TIMEOUT = 60  # a notice must not expire before a loaded CI reads it
    return app


@pytest.mark.parametrize(("key", "said"), [("i", "change a rule"), ("P", "profile the training")])
def test_i_and_p_in_a_replay_say_why_they_do_nothing(
    replay_app: TensorDbgApp, key: str, said: str
) -> None:
    """Finding 4: in a replay i and P did nothing, without a word, where c, s, k and Space on
    the Rules tab say "Not in this session..."; they say so too."""
    app = replay_app

    async def flow() -> None:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: app.state == "replay" and app.main.hit_table.row_count)
            await pilot.press(key)
            why = f"this session is a recorded run, not a running training: it cannot {said}"
            await until(pilot, lambda: notified(app, why))
            assert notified(app, "Not in this session")
            assert not isinstance(app.screen, ProfileStepsScreen)

    asyncio.run(flow())


def test_the_profile_dialog_keeps_what_was_typed_and_refuses_it_quoted() -> None:
    """Finding 5: the number of steps lost what was typed ("1e3" became 13, and was profiled;
    the tester's 0 and 99999999 left the field empty, refused as ''). What is typed stays, and
    a number out of range is refused with its text."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            await paused_on_the_two_hits(pilot)
            await pilot.press("P")
            await shown(pilot, ProfileStepsScreen)
            box = app.screen.query_one(Input)
            for typed in ("0", "99999999", "-3", "1e3", "five"):
                box.value = ""
                await pilot.press(*typed, "enter")
                assert box.value == typed
                error = text_of(app.screen.query_one(".dialog-error", Static))
                assert error == ("The number of steps is a whole number from 1 to 1000, not "
                                 f"{typed!r}.")  # fmt: skip
            assert source.profiles == []

    asyncio.run(flow())


def test_the_hits_filter_says_it_matches_messages_too() -> None:
    """Finding 6: /norm showed rows whose names lack "norm" (found in their messages), and the
    filter did not say it looks there: the placeholder went with the first key typed. The box
    says what it matches while it shows."""
    source = FakeSource()
    source._hits[1]["message"] = "output holds 2 NaN; the norm layer before it made them."

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            hits = await paused_on_the_two_hits(pilot)
            await pilot.press("slash", "n", "o", "r", "m")
            await until(pilot, lambda: hits.row_count == 1)
            assert "rule, tensor, module, step, phase or message" in screen_text(app)

    asyncio.run(flow())


def held_gradient_hit(source: FakeSource) -> dict[str, Any]:
    """A gradient hit at its backward pause, as batched mode sends it: its summary has the
    shape and dtype only, its message the count."""
    hit = dict(source._hits[1], id=2, step=4, phase="backward", kind="grad_output",
               tensor="head.grad_output", module="head", ref=3,
               message="head.grad_output holds 2 NaN among 32 values.",
               summary={"shape": [8, 4], "dtype": "float32"})  # fmt: skip
    source._hits.append(hit)
    source.paused_at, source.step = hit, 4
    return hit


def test_a_gradient_hit_at_its_pause_shows_the_counts_its_summary_lacks() -> None:
    """Finding 7: the detail of head.grad_output at its backward pause showed "tensor[16,4]
    float32" beside a message saying 4 NaN (opening it showed NaN×4!). The tensor is held at
    the pause: its counts are read. A hit of an earlier phase says why it has none."""
    source = FakeSource()
    info = source.info
    source.info = lambda: {**info(), "phase": "backward"}  # type: ignore[method-assign]
    held_gradient_hit(source)

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE) as pilot:
            table, detail = app.main.hit_table, app.main.hit_detail
            await until(pilot, lambda: table.row_count == 3 and table.current["id"] == 2)
            await until(pilot, lambda: "NaN×2!" in text_of(detail))
            assert "tensor[8,4] float32 n=32" in text_of(detail)
            # An earlier phase's hit (the pause is in step 4's backward pass): not held.
            source._hits[0]["summary"] = {"shape": [8, 4], "dtype": "float32"}
            table.set_hits(source.hits())
            table.select_hit(0)
            await until(pilot, lambda: "no counts were kept with the hit" in text_of(detail))

    asyncio.run(flow())


def test_at_80_by_24_the_hit_detail_keeps_its_summary_and_the_enter_key() -> None:
    """Finding 11: at 80x24 the detail of a hit with a long message lost its "tensor[...]" line
    and "Enter opens the tensor." under the message: they come before it now, and the pane
    scrolls for the rest of the message."""
    source = FakeSource()
    hit = source._hits[0]
    hit["message"] = (
        "mid.norm.output holds 64 NaN among 1024 values. A NaN usually comes from 0/0, log or "
        "sqrt of a negative or zero value, or an overflow just before. It was produced here: "
        "this module's inputs and parameters were clean. Inside mid.norm's forward the first "
        "NaN came from Tensor.div at train.py:18 (return x / x.sum(dim=-1, keepdim=True))."
    )
    hit["summary"] = {**hit["summary"], "shape": [8, 4], "dtype": "float32"}

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            await paused_on_the_two_hits(pilot)
            await until(pilot, lambda: "mid.norm.output holds" in text_of(app.main.hit_detail))
            await pilot.pause(0.1)
            shown = screen_text(app)
            assert "tensor[8,4] float32" in shown and "Enter opens" in shown  # and wraps

    asyncio.run(flow())


def test_at_80_columns_a_row_two_rules_share_leaves_the_message_room() -> None:
    """Finding 11: in a replay at 80 columns the message column shrank to "m…" beside a rule
    column "ExplodingGradient, NaN" 22 cells wide: the rule column gives up cells for it."""
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SMALL) as pilot:
            hits = await paused_on_the_two_hits(pilot)
            grad = dict(source.hits()[0], step=5, phase="optimizer", origin=False,
                        tensor="mid.norm.grad_output",
                        message="mid.norm.grad_output holds 64 NaN among 1024 values.")  # fmt: skip
            source.emit("hit", dict(grad, id=2, rule="ExplodingGradient"))
            source.emit("hit", dict(grad, id=3, rule="NaN"))
            await until(pilot, lambda: hits.known == 4)
            await pilot.pause(0.1)
            rows = [strip.text for strip in hits.render_lines(hits.region.reset_offset)]
            row = next(line for line in rows if "mid.norm.grad_output" in line)
            assert "↳ passed on  mid.norm.grad_out" in row, row  # 18 cells of it, not "m…"

    asyncio.run(flow())


def wrong_key_file(path: Path, tmp_path: Path) -> Path:
    """A copy of a TCP session's connection file whose client keys are not the ones its
    training accepts."""
    data = json.loads(path.read_text())
    public, secret = zmq.curve_keypair()
    data.update(client_public_key=public.decode(), client_secret_key=secret.decode())
    wrong = tmp_path / "wrong-key.json"
    wrong.write_text(json.dumps(data))
    wrong.chmod(0o600)
    return wrong


def test_a_training_that_refuses_the_client_key_is_said_at_once_and_stays_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 8: with a connection file whose client keys a TCP training refuses, the UI
    showed no reason: "Connecting to the training…" came back a second after each failure,
    for the 5 s of the next attempt. The failure stays, and says what the silence may mean: the
    key, or the address."""
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(tmp_path / "rt"))
    server = Server(FakeSource(), run_id="key1", rank=0, remote=True)
    info = server.start()
    assert info.path is not None
    app = session_app(str(wrong_key_file(info.path, tmp_path)))
    assert app is not None

    async def flow() -> None:
        async with app.run_test(size=SIZE) as pilot:
            banner = app.main.banner
            await until(pilot, lambda: "Connecting to the training" in text_of(banner), 2)
            await until(pilot, lambda: "did not answer within 5 s" in text_of(banner), 15)
            said = text_of(banner)
            assert said.startswith("Cannot connect yet: session key1-0 at tcp://127.0.0.1:")
            assert "refuses this connection file's client key" in said
            assert "address out of reach (tcp://127.0.0.1:" in said
            await pilot.pause(2.0)  # the next attempt is under way: the failure stays said
            assert text_of(banner) == said
            assert app.state == "connecting"

    try:
        asyncio.run(flow())
    finally:
        server.stop()


def test_a_negative_wait_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Finding 10: `tensordbg tui --wait -1` was taken, and said "within -1 s"."""
    from tensordbg.cli import main

    assert main(["tui", "--wait", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "tensordbg tui: --wait is a number of seconds, 0 or more, not -1\n"
    assert run_tui(wait=float("nan")) == 2
