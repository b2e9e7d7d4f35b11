"""Shared test configuration, fixtures and helpers.

Test modules import the helpers (``from conftest import DEADLINE, wait_until``): pytest puts this
directory on ``sys.path``, as it does for ``fake_source``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

DEADLINE = 15.0
"""Seconds any awaited condition may take on a loaded machine."""


def wait_until(condition: Callable[[], object], timeout: float = DEADLINE) -> None:
    """Poll ``condition`` until it is true; AssertionError once ``timeout`` seconds have passed.

    >>> wait_until(lambda: server.clients == 1)
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.01)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> Callable[..., tuple[int, str, str]]:  # fmt: skip
    """``cli(*args)`` runs the command line in this process, in ``tmp_path``, and gives its exit
    code, stdout and stderr: for a mistake that must be said before any script runs or any UI
    opens, without starting an interpreter (and importing torch) for each. Tests that run a
    script go through ``python -m tensordbg.cli``, as a person does.

    >>> code, out, err = cli("run", "--interval", "0", "train.py")
    """
    from tensordbg.cli import main

    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(autouse=True)
def private_runtime_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Every test gets its own directory for connection files (this one, mode 0700): tests never
    see each other's sessions, nor the sessions of the person running them."""
    runtime = tmp_path_factory.mktemp("runtime")
    os.chmod(runtime, 0o700)
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(runtime))
    return runtime


@pytest.fixture
def server_factory() -> Iterator[Callable[..., Callable[..., Any]]]:
    """``server_factory(**defaults)`` gives ``start(source, **options)``, which starts a
    :class:`~Server` of ``source`` with the defaults, ``options`` winning, and
    returns it; every server started is stopped after the test.

    >>> start = server_factory(run_id="run1", rank=0)
    >>> server = start(FakeSource(), client_timeout=1.0)
    """
    from tensordbg.transport.server import Server

    servers: list[Server] = []

    def factory(**defaults: Any) -> Callable[..., Server]:
        def start(source: Any, **options: Any) -> Server:
            server = Server(source, **{**defaults, **options})
            servers.append(server)
            server.start()
            return server

        return start

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture
def watch():
    """``watch(model, ...)`` is ``tensordbg.attach`` without the UI server, detached after the
    test whatever happens."""
    import tensordbg

    sessions = []

    def attach(model, **kwargs):
        kwargs.setdefault("server", False)
        if kwargs.get("sync") == DEFERRED_ON_DEVICE:
            session = _deferred_on_device(model, kwargs)
        else:
            session = tensordbg.attach(model, **kwargs)
        sessions.append(session)
        return session

    yield attach
    for session in sessions:
        session.detach()


# Deferred checks as they run on a CUDA model (what they screen goes to the phase's transfer),
# on the CPU: the origin suites run in this mode too, where no GPU is.
DEFERRED_ON_DEVICE = "deferred-on-device"


def _deferred_on_device(model, kwargs):
    import tensordbg
    from tensordbg.engine import modes, session

    choose = session.choose
    session.choose = lambda sync, device: modes.Deferred(on_device=True)
    try:
        return tensordbg.attach(model, **{**kwargs, "sync": "deferred"})
    finally:
        session.choose = choose


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Detach what a test left attached (a training thread a test gave up on, say), so that no
    summary of its hits is printed after pytest's own last line."""
    import sys

    engine = sys.modules.get("tensordbg.engine.session")
    if engine is not None:
        for watched in list(engine._attached.values()):
            watched.summary_at_exit = False
            watched.detach()
    zygote = sys.modules.get("zygote")  # this worker's preloaded interpreter (zygote.py)
    if zygote is not None:
        zygote.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked slow first, in their order, then the others in theirs: with several
    workers a long test that starts last (test_zoo's, last by name) leaves the others idle
    while it ends the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
