"""What a third new-user trial of the UI found (in tmux, at 80x24 and 120x40), each driven as that
person did: a session that ended while it was listed, a torchrun job's header and ranks, a
refused edit, and the paused training's keys and toasts.

Like test_tui, each test runs the real app headless against the numpy-only FakeSource.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

from fake_source import FakeSource
from test_ranks_tui import FakeRank, Host, rows
from test_tui import open_tensor, text_of, type_slice, until
from test_tui_first_use import StrictSource, edit_rule, run
from test_tui_newcomer import screen_text
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static, Tree

from tensordbg.sources.contract import SourceError
from tensordbg.transport.client import ConnectionLost, LocalClient
from tensordbg.transport.connection import ConnectionInfo, write_connection_file
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.stats_compare import StatsCompare
from tensordbg.tui.components.tensor_grid import TensorGrid
from tensordbg.tui.launch import session_app
from tensordbg.tui.screens.ranks import RanksScreen


def listed_session(runtime: Path, run_id: str) -> Path:
    """A session of this process in the session list: its connection file."""
    info = ConnectionInfo(run_id=run_id, rank=0, pid=os.getpid(), host=socket.gethostname(),
                          script="train.py", started=time.time(), endpoint="ipc:///nowhere",
                          transport="ipc", key="ab" * 32)  # fmt: skip
    return write_connection_file(info, runtime)


def test_a_session_that_ended_while_it_was_listed_is_said_to_have_ended_and_the_ui_quits(
    private_runtime_dir: Path,
) -> None:
    """Enter on a training that ended after the list was shown gave "Cannot connect yet: cannot
    read connection file ...: pass the .json file a training wrote. Retrying…" for ever, and a
    header saying CONNECTING: the person passed no file. As for a training named on the command
    line that has exited: one line that says so, and exit code 2."""
    files = {run: listed_session(private_runtime_dir, run) for run in ("old1", "new2")}
    app = session_app()
    assert app is not None

    async def flow() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: type(app.screen).__name__ == "SessionPicker")
            files["new2"].unlink()  # the newest, listed first, ends now
            await pilot.press("enter")
            await until(pilot, lambda: not app.is_running)

    asyncio.run(flow())
    assert app.return_code == 2
    assert app.farewell == (
        f"tensordbg tui: the session of run new2 (pid {os.getpid()}) has ended: its training "
        "exited or goes on unwatched"
    )


class ExplodingSource(StrictSource):
    """Its rule 1 is ExplodingGradient with its real description, refusing a negative bound."""

    def __init__(self) -> None:
        super().__init__()
        from tensordbg.rules import ExplodingGradient

        self._rules[1] |= {"name": "ExplodingGradient", "doc": ExplodingGradient.__doc__,
                           "params": {"max_norm": 1e6, "growth": 20.0, "window": 50,
                                      "warmup": 10, "persist": 2}}  # fmt: skip

    def set_rule(
        self, id: int, enabled: bool | None = None, params: dict[str, Any] | None = None
    ) -> Any:
        raise SourceError("ExplodingGradient: max_norm must be a positive number, not -5.0")


def test_at_80x24_a_refused_edit_is_said_whole() -> None:
    """The refusal wrapped onto a second line that the dialog's buttons covered: "The training
    refused this: ExplodingGradient: max_norm must be a" and no way to read the rest (the body
    was laid out two rows taller than the room between the title and the buttons)."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        dialog = await edit_rule(app, pilot, row=1)
        max_norm = dialog.query(Input).first()
        max_norm.value = "-5.0"
        max_norm.focus()
        error = dialog.query_one(".dialog-error", Static)
        await pilot.press("enter")
        await until(pilot, lambda: "refused" in text_of(error))
        await pilot.pause(0.3)
        shown = " ".join(" ".join(screen_text(app).split("█")).split())
        said = "The training refused this: ExplodingGradient: max_norm must be a positive number"
        assert f"{said}, not -5.0" in shown, screen_text(app)

    run(ExplodingSource(), check, size=(80, 24))


# --- a torchrun job: the header, R and F9 ---------------------------------------------------------

UUID = "d0d9e81b-dbe4-48ae-a4c3-708ce5e7a9f1"  # torchrun's default run id


class UuidRank(FakeRank):
    """A rank of a 2-rank job whose run id is torchrun's default, a uuid."""

    def info(self) -> Any:
        return {**super().info(), "run_id": UUID, "script": "ddp.py"}


def test_at_80_columns_the_header_keeps_the_rank_of_a_long_run_id_and_r_says_which_rank(
    server_factory,
) -> None:
    """At 80 columns the header ended "run d0d9e81b-dbe4-48ae-a4c3-708ce…": the rank was cut
    off, and R changed the whole screen to the other rank's with no sign of it."""
    start = server_factory(run_id=UUID, script="ddp.py")  # stopped after the test
    for r in (0, 1):
        start(UuidRank(r), rank=r)
    app = session_app()
    assert app is not None

    async def flow() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.info.get("rank") == 0 and app.state == "running",
                        timeout=20)  # fmt: skip
            header = screen_text(app).splitlines()[0]
            assert "RUNNING at step 3 — rank 0 · ddp.py · run d0d9e81b…" in header, header
            await pilot.press("R")
            await until(pilot, lambda: app.info.get("rank") == 1 and app.state == "paused",
                        timeout=20)  # fmt: skip
            await until(pilot, lambda: "rank 1" in screen_text(app).splitlines()[0])
            said = [str(n.message) for n in app._notifications]
            assert said == ["Now inspecting rank 1 of 2 (it was rank 0)."], said
            app.exit()

    asyncio.run(flow())


def test_r_and_f9_on_a_training_of_one_rank_say_that_it_has_one() -> None:
    """R and F9 did nothing and said nothing on a training of one process."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        for key in ("R", "f9"):
            app.clear_notifications()
            await pilot.press(key)
            await until(pilot, lambda: bool(list(app._notifications)))
            assert [str(n.message) for n in app._notifications] == [
                "This training runs on one rank: R and F9 show the ranks of a job of several "
                "(torchrun)."
            ], key

    run(FakeSource(), check)


class EndingClient(LocalClient):
    """A rank's client whose session ends when the test says so: every request fails then."""

    ended = False

    async def call(self, method: str, /, **params: Any) -> Any:
        if self.ended:
            raise ConnectionLost("the training closed the connection")
        return await super().call(method, **params)


def test_the_ranks_of_a_job_that_ended_keep_what_was_read_and_say_that_they_ended() -> None:
    """F9 left open while the job ended showed "0 * gone" and "1 gone" under "why it is
    paused", the steps and hits read until then blanked, and Enter on rank 1 did nothing."""

    async def flow() -> None:
        clients = {r: EndingClient(FakeRank(r)) for r in (0, 1)}
        app = Host(RanksScreen("job7", clients, current=0, every=0.1))
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.ranks_screen
            table = screen.query_one("#ranks-table", DataTable)
            await until(pilot, lambda: table.row_count == 2 and rows(table)[1][1] == "paused")
            for client in clients.values():
                client.ended = True
            await until(pilot, lambda: rows(table)[1][1] == "ended")
            assert [r[:4] for r in rows(table)] == [["0 *", "ended", "3", "0"],
                                                    ["1", "ended", "3", "2"]]  # fmt: skip
            assert rows(table)[1][4] == "its session closed (last read: paused)"
            headings = [str(c.label) for c in table.columns.values()]
            assert headings[-1] == "why it is paused, or how it ended"
            title = str(screen.query_one("#ranks-title", Static).content)
            assert title == "run job7 has ended: its 2 ranks as last read"
            table.focus()
            table.move_cursor(row=1)
            await pilot.press("enter")
            await until(pilot, lambda: bool(list(app._notifications)))
            assert app.chosen == [] and app.screen is screen  # it stays, and says why
            assert [str(n.message) for n in app._notifications] == [
                "Rank 1's session has ended with the training: it cannot be inspected, only "
                "what this list read of it is left."
            ]

    asyncio.run(flow())


# --- small ones at 80x24 --------------------------------------------------------------------------


def test_at_80x24_a_provenance_line_cut_by_the_right_edge_ends_in_an_ellipsis() -> None:
    """An input's summary was cut to "tensor[16,31,64] floa", which reads as whole; → scrolls
    to the rest."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await open_tensor(pilot, 3, "net.2.output", TensorGrid)
        await pilot.press("f5")
        tree = app.query_one("#provenance-tree", Tree)
        await until(pilot, lambda: "inputs (1)" in screen_text(app))
        summary = str(tree.root.children[1].children[0].label)  # net.1.output's line, whole
        line = next(x for x in screen_text(app).splitlines() if "net.1.output" in x).rstrip()
        assert line.endswith("…"), line
        shown = line[line.index("✓") :].removesuffix("…")
        assert summary.startswith(shown) and len(shown) < len(summary)
        tree.focus()
        await pilot.press("end", "right", "right", "right")
        await until(pilot, lambda: tree.scroll_x > 0)
        assert any("x∈[0, 3.07]" in x for x in screen_text(app).splitlines())  # the rest

    run(FakeSource(), check, size=(80, 24))


def test_the_skip_toast_goes_when_the_training_goes_on() -> None:
    """After k then c, "The update of step 3 will be skipped ... c continues." stayed for
    seconds beside a header that already said the training was at its next pause."""

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        await pilot.press("k")
        await until(pilot, lambda: any(n.title == "Skip" for n in app._notifications))
        await pilot.press("c")
        await until(pilot, lambda: app.state == "running")
        await pilot.pause(0.1)
        assert not any(n.title == "Skip" for n in app._notifications)

    run(FakeSource(), check)


def test_a_slice_says_why_it_has_no_previous_step_to_compare_with() -> None:
    """A slice's "compared with the previous step" was a column of dashes that said "no
    statistics of this tensor from the previous step", which the whole tensor had: a source
    keeps the previous step's statistics of whole tensors only."""

    class WholeOnly(FakeSource):
        def stats(self, ref: int, text: str = "") -> Any:
            reply = super().stats(ref, text)
            return reply | {"previous": reply["previous"] if not reply["index"] else None}

    async def check(app: TensorDbgApp, pilot: Pilot) -> None:
        compare = await open_tensor(pilot, 3, "net.2.output", StatsCompare)
        await until(pilot, lambda: compare.content and compare.content.title is None)
        await type_slice(pilot, "[1]")
        await pilot.press("enter")
        await until(pilot, lambda: compare.content.title is not None)
        assert compare.content.title == (
            "the previous step's statistics are of the whole tensor, not of a slice: clear "
            "the slice (Enter on an empty box) to compare them"
        )

    run(WholeOnly(), check)

    async def seen(app: TensorDbgApp, pilot: Pilot) -> None:  # at 80x24 it was cut off
        # The slice's histogram shows first (it has values where the comparison has dashes);
        # the comparison and its sentence are where the side column scrolls to.
        compare = await open_tensor(pilot, 3, "net.2.output", StatsCompare)
        await type_slice(pilot, "[1]")
        await pilot.press("enter")
        await until(pilot, lambda: compare.content.title is not None)
        await pilot.pause()
        assert "histogram of the finite values" in screen_text(app)
        app.query_one("#tensor-side").scroll_end(animate=False)
        await pilot.pause()
        assert "to compare them" in " ".join(screen_text(app).split())

    run(WholeOnly(), seen, size=(80, 24))
