"""No error quits the UI: a malformed reply or event, a bug in a widget, a worker that raises.
Each is shown in the Log tab and in a notification, and its traceback goes to a private crash file
whose path the command prints on exit. A recorded run, which cannot be driven, says so when a
control key is pressed.

Like test_tui, each test runs the real app headless against the numpy-only FakeSource.
"""

from __future__ import annotations

import asyncio
import re
import stat
from pathlib import Path
from typing import Any

import pytest
from fake_source import FakeSource
from test_tui import SIZE, open_tensor, paused_on_the_two_hits, text_of, until
from textual.pilot import Pilot
from textual.widgets import Static

from tensordbg.sources.contract import READ_ONLY, Stats
from tensordbg.transport.client import LocalClient
from tensordbg.tui import launch
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components import histogram_view
from tensordbg.tui.components.connection_banner import ConnectionBanner
from tensordbg.tui.components.stats_compare import StatsCompare
from tensordbg.tui.components.tensor_grid import TensorGrid
from tensordbg.tui.errors import CrashFile

TUI = Path(__file__).parents[1] / "tui"


def log_text(app: TensorDbgApp) -> str:
    """What the Log tab shows, its wrapped lines joined again (it draws what it is given once
    it has a size: once it is shown)."""
    return " ".join(" ".join(strip.text.split()) for strip in app.main.event_log.lines)


def notifications(app: TensorDbgApp) -> list[str]:
    return [str(toast.render()) for toast in app.screen.query("Toast")]


def notified(app: TensorDbgApp, text: str) -> bool:
    return any(text in shown for shown in notifications(app))


async def in_the_log(pilot: Pilot, text: str) -> None:
    app = pilot.app
    app.main.show_tab("log")
    await until(pilot, lambda: text in log_text(app))


def crash_text(app: TensorDbgApp) -> str:
    path = app.crash_file.path
    assert path is not None, "no crash file was written"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return path.read_text()


class MalformedStats(FakeSource):
    """A source whose statistics reply lacks its summary line and spells its shape as text."""

    def stats(self, ref: int, text: str = "") -> Stats:
        reply: dict[str, Any] = dict(super().stats(ref, text))
        del reply["line"]
        reply["shape"] = "8x4"
        return reply  # type: ignore[return-value]


def test_a_malformed_reply_is_reported_and_the_ui_goes_on(private_runtime_dir: Path) -> None:
    """Without the schema check, the missing line was a KeyError in the Tensor tab's worker,
    which quit the UI with a traceback."""
    source = MalformedStats()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await paused_on_the_two_hits(pilot)
            await pilot.press("enter")  # open the origin hit's tensor
            error = app.query_one("#slice-error", Static)
            await until(pilot, lambda: "reply to 'stats' is malformed" in text_of(error))
            assert "stats: missing 'line'" in text_of(error)

            await in_the_log(pilot, "error in the reply to 'stats'")
            assert "SchemaError: stats: missing 'line'" in log_text(app)
            await until(pilot, lambda: notified(app, "the reply to 'stats'"))
            crash = crash_text(app)
            assert app.crash_file.path.parent == private_runtime_dir
            assert "in the reply to 'stats'" in crash and "Traceback" in crash
            assert "request: stats {'ref': 3, 'text': ''}" in crash
            assert "'summary':" in crash  # the reply itself, to read
            assert "session: run fake0001 of fake.py" in crash
            assert re.search(r"tensordbg \S+, textual \S+, Python \S+", crash)

            # The app goes on: the rest of the tensor came, and the keys work.
            await until(pilot, lambda: "net.2.output" in str(app.query_one("Tree").root.label))
            await pilot.press("f2", "c")
            await until(pilot, lambda: app.state == "running")
            assert source.controls == [("continue", 1)]
        assert app.crash_file.count == 1
        assert app.crash_file.exit_message() == (
            f"tensordbg: details of 1 error in {app.crash_file.path}"
        )

    asyncio.run(flow())


def test_a_bug_in_a_widget_is_reported_and_the_ui_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyError deep in a widget, in an async worker and in a thread worker (the histogram is
    drawn in a thread): both are reported; neither quits the UI."""

    def broken_show(self: StatsCompare, stats: Any) -> None:
        raise KeyError("summary")

    def broken_draw(hist: Any, height: int = 8) -> Any:
        raise ZeroDivisionError("no bins to draw")

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(FakeSource()))
        app.NOTIFICATION_TIMEOUT = 60  # under load the second comes after the first's 5 s
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await paused_on_the_two_hits(pilot)
            with monkeypatch.context() as patch:
                patch.setattr(StatsCompare, "show", broken_show)
                await open_tensor(pilot, 2, "net.1.output", TensorGrid)
                await in_the_log(pilot, "error in TensorInspector.load: KeyError: 'summary'")
            monkeypatch.setattr(histogram_view, "draw", broken_draw)
            await open_tensor(pilot, 3, "net.2.output", TensorGrid)  # on to the histogram
            await in_the_log(pilot, "HistogramView.show")
            assert "ZeroDivisionError: no bins to draw" in log_text(app)
            await until(pilot, lambda: len(notifications(app)) >= 2)
            crash = crash_text(app)
            assert "in broken_show" in crash and "KeyError: 'summary'" in crash
            assert "in broken_draw" in crash and "error 2 at" in crash
            assert app.is_running and app.state == "paused"
        assert app.crash_file.count == 2

    asyncio.run(flow())


def test_a_malformed_event_is_reported_and_the_connection_stays() -> None:
    source = FakeSource()

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            hits = await paused_on_the_two_hits(pilot)
            source.emit("hit", {"id": 9, "rule": "NaN"})  # no tensor, no step...
            await in_the_log(pilot, "error in the 'hit' event")
            assert "missing 'tensor'" in log_text(app)
            assert "payload: {'id': 9, 'rule': 'NaN'}" in crash_text(app)
            # Still connected: the next (good) hit is listed.
            source.emit("hit", dict(source.hits()[0], id=10, step=4))
            await until(pilot, lambda: hits.row_count == 3)
            assert not app.query_one(ConnectionBanner).has_class("-visible")
            assert app.state == "paused"

    asyncio.run(flow())


@pytest.mark.parametrize("ends_training", [False, True], ids=["training", "demo"])
def test_ctrl_c_says_what_quitting_does_to_the_training(ends_training: bool) -> None:
    """Ctrl-C does not quit a Textual app; the note it gets says that q detaches and quits and
    that the training goes on unwatched (Textual's own said only "ctrl+q to quit"); in
    tensordbg demo, whose training ends with its UI, that q quits and the training stops."""
    source = FakeSource()
    said = "the training stops with the UI" if ends_training else "goes on, unwatched."

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source), ends_training=ends_training)
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await paused_on_the_two_hits(pilot)
            await pilot.press("ctrl+c")
            await until(pilot, lambda: notified(app, said))
            assert app.is_running and source.controls == []  # nothing was asked of it

    asyncio.run(flow())


class Greeting:
    """A LocalClient whose hello reply can be spoilt."""

    def __init__(self, source: FakeSource, spoilt: bool) -> None:
        self._inner = LocalClient(source)
        self.welcome = self._inner.welcome
        if spoilt:
            self.welcome = {**self.welcome, "info": {**self.welcome["info"], "step": "three"}}

    async def call(self, method: str, **params: Any) -> Any:
        return await self._inner.call(method, **params)

    def events(self) -> Any:
        return self._inner.events()

    async def close(self) -> None:
        await self._inner.close()


def test_a_malformed_hello_reply_is_a_failed_connection_and_the_next_one_is_tried() -> None:
    source = FakeSource()
    clients: list[Greeting] = []

    async def connect(path: str | None) -> Greeting:
        clients.append(Greeting(source, spoilt=not clients))
        return clients[-1]

    async def flow() -> None:
        app = TensorDbgApp(connect, reconnect_delay=0.02)
        async with app.run_test(size=SIZE) as pilot:
            await paused_on_the_two_hits(pilot)
            assert len(clients) == 2
            await in_the_log(pilot, "hello.info.step: expected int, got 'three'")
            assert "cannot connect: the training's reply to 'hello' is malformed" in log_text(app)

    asyncio.run(flow())


def test_a_recorded_run_cannot_be_driven_and_its_keys_say_why() -> None:
    """A source that serves no control (a dump replayed): c and the rules' keys do nothing but
    say why, the palette does not offer them, and q quits without a detach to send."""
    source = FakeSource(capabilities=READ_ONLY)
    why = "this session is a recorded run, not a running training: it cannot drive the training"

    async def flow() -> None:
        app = TensorDbgApp(LocalClient(source))
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await paused_on_the_two_hits(pilot)
            session = text_of(app.query_one("#run-session", Static))
            assert "read-only: a recorded run cannot be continued, stepped or paused" in session
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert not {"Continue", "Next hit", "Step", "Recheck"} & set(titles)

            await pilot.press("c")
            await until(pilot, lambda: notified(app, why))
            assert app.state == "paused" and source.controls == []

            panel = app.main.rule_panel
            await until(pilot, lambda: panel.current is not None)
            app.main.show_tab("rules")
            await pilot.pause()
            await pilot.press("space")
            await until(pilot, lambda: notified(app, "it cannot change a rule"))
            assert source._rules[0]["enabled"] is True
            await in_the_log(pilot, why)
            assert app.crash_file.count == 0  # refusals are no errors

            await pilot.press("q")
            await until(pilot, lambda: not app.is_running)
        assert source.controls == []
        assert app.crash_file.exit_message() is None

    asyncio.run(flow())


# --- the crash file and the command ------------------------------------------------------------


def raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as e:
        return e


def test_the_crash_file_is_private_and_holds_each_error_with_its_traceback(tmp_path: Path) -> None:
    crash = CrashFile(tmp_path)
    assert crash.exit_message() is None and crash.path is None  # nothing made before an error
    first = crash.write(raised(KeyError("line")), "TensorInspector.load", "request: stats")
    second = crash.write(raised(ValueError("bad")), "the 'hit' event")
    assert first == second == crash.path and crash.path.parent == tmp_path
    assert stat.S_IMODE(crash.path.stat().st_mode) == 0o600
    text = crash.path.read_text()
    assert text.startswith("tensordbg UI errors, ")
    assert "error 1 at" in text and "in TensorInspector.load\nrequest: stats\nTraceback" in text
    assert "KeyError: 'line'" in text and "ValueError: bad" in text
    assert crash.exit_message() == f"tensordbg: details of 2 errors in {crash.path}"


def test_a_crash_file_that_cannot_go_to_its_directory_goes_to_the_temporary_one(
    tmp_path: Path,
) -> None:
    crash = CrashFile(tmp_path / "missing")
    path = crash.write(raised(KeyError("x")), "somewhere")
    try:
        assert path is not None and path.name.startswith("tensordbg-ui-errors-")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        if path is not None:
            path.unlink()


def test_the_command_says_where_the_details_are_on_exit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    app = TensorDbgApp(LocalClient(FakeSource()))
    app.crash_file.write(raised(KeyError("line")), "TensorInspector.load")
    monkeypatch.setattr(launch, "session_app", lambda *args, **kwargs: app)
    monkeypatch.setattr(app, "run", lambda: 0)
    assert launch.run_tui() == 0
    assert capsys.readouterr().err == f"tensordbg: details of 1 error in {app.crash_file.path}\n"


def test_every_worker_of_the_ui_reports_its_errors() -> None:
    """Workers are started through tensordbg.tui.errors.work, never Textual's own."""
    for path in TUI.rglob("*.py"):
        if path.name == "errors.py":
            continue
        source = path.read_text()
        assert not re.search(r"from textual import [^\n]*\bwork\b", source), path
        assert "textual.work" not in source and "run_worker(" not in source, path
