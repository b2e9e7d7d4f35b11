"""Shared test configuration and fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Every test gets its own directory for connection files: tests never see each other's
    sessions, nor the sessions of the person running them."""
    runtime = tmp_path_factory.mktemp("runtime")
    os.chmod(runtime, 0o700)
    monkeypatch.setenv("TENSORDBG_RUNTIME_DIR", str(runtime))


@pytest.fixture
def watch():
    """``watch(model, ...)`` is ``tensordbg.attach`` without the UI server, detached after the
    test whatever happens."""
    import tensordbg

    sessions = []

    def attach(model, **kwargs):
        kwargs.setdefault("server", False)
        session = tensordbg.attach(model, **kwargs)
        sessions.append(session)
        return session

    yield attach
    for session in sessions:
        session.detach()
