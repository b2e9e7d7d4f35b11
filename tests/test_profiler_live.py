"""Profiling from the UI's side of the wire (a real server and client) and from the command line
(``tensordbg run --profile``)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tensordbg
from tensordbg.sources.checking import check
from tensordbg.sources.contract import REPLIES
from tensordbg.sources.live import LiveSource
from tensordbg.sources.schema import EVENTS
from tensordbg.transport.client import RemoteError
from tensordbg.transport.server import Server
from tensordbg.transport.sync_client import SyncClient


class Training:
    """A small training in its own thread (the training thread), stepping until stopped."""

    def __init__(self):
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.session = None
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def _train(self) -> None:
        self.session = tensordbg.attach(self.model, optimizer=self.opt, server=False,
                                        on_hit="record")  # fmt: skip
        self.ready.set()
        x, y = torch.ones(4, 8), torch.zeros(4, 1)
        while not self.stop.is_set():
            nn.functional.mse_loss(self.model(x), y).backward()
            self.opt.step()
            self.opt.zero_grad()
            time.sleep(0.01)
        self.session.detach()


def test_a_ui_profiles_the_running_training_and_reads_the_report_and_the_gpu():
    training = Training()
    session = training.session
    server = Server(LiveSource(session), run_id=session.run_id, rank=0)
    server.start()
    try:
        with SyncClient(server.info.path) as client:
            assert client.call("profile_report") is None
            assert "profile" in client.welcome["info"]["capabilities"]
            with pytest.raises(RemoteError, match="from 1 to 1000"):
                client.call("profile", steps=0)
            reply = client.call("profile", steps=2)
            check(reply, REPLIES["profile"], name="profile", strict=True)
            assert reply == {"pending": True, "steps": 2}
            states = []
            for event, payload in client.events(timeout=30):
                if event == "profile":
                    check(payload, EVENTS["profile"], name="profile event", strict=True)
                    states.append(payload["state"])
                    if payload["state"] != "running":
                        break
            assert states == ["running", "done"]
            report = client.call("profile_report")
            check(report, REPLIES["profile_report"], name="profile_report", strict=True)
            assert len(report["steps"]) == 2 and report["device"] == "cpu"
            assert report["trace"] and not any("traceEvents" in str(v) for v in report.values())
            assert not any(op["input_shapes"] for op in report["operators"])
            # The P dialog's "Record input shapes": the request carries it to torch.profiler.
            client.call("profile", steps=1, record_shapes=True)
            for event, payload in client.events(timeout=30):
                if event == "profile" and payload["state"] not in ("pending", "running"):
                    break
            shaped = client.call("profile_report")["operators"]
            assert any(op["input_shapes"] for op in shaped)
            gpu = client.call("gpu", since=0.0)
            check(gpu, REPLIES["gpu"], name="gpu", strict=True)
            if not gpu["available"]:
                assert gpu["reason"].startswith("NVML unavailable: ")
    finally:
        training.stop.set()
        training.thread.join(30)
        server.stop()
    assert not torch.autograd.profiler._is_profiler_enabled


SCRIPT = """
import sys, torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8),
                                   torch.randn(64, 1)), batch_size=4)
for step, (x, y) in enumerate(data):
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if step + 1 == int(sys.argv[1]):
        break
print("trained")
"""


def tensordbg_run(tmp_path: Path, profile: str, steps: str) -> subprocess.CompletedProcess:
    """``tensordbg run --profile PROFILE train.py STEPS``, with its temp directory in tmp_path."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "tensordbg.cli", "run", "--profile", profile, str(script),
               steps]  # fmt: skip
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env=env)  # fmt: skip


def test_tensordbg_run_profile_prints_the_summary_the_advice_and_the_trace(tmp_path: Path):
    done = tensordbg_run(tmp_path, "3", "10")
    assert done.returncode == 0, done.stderr
    assert "trained" in done.stdout
    err = done.stderr
    assert "tensordbg profile: 3 steps (2..4) on cpu" in err
    # Which operators lead is the machine's noise (addmm is 7th of 8 on an idle one): that
    # the model's operators are listed is what is certain.
    operators = err.split("top operators (self time):")[1].split("memory:")[0]
    assert "aten::" in operators
    assert "advice:" in err
    assert "USDT" not in err and "profiler_start" not in err  # Kineto's lines for itself
    trace = next(line.split()[1] for line in err.splitlines() if line.strip().startswith("trace:"))
    assert trace.startswith(str(tmp_path))
    with gzip.open(trace, "rt") as f:
        assert any(e.get("name") == "tensordbg: forward" for e in json.load(f)["traceEvents"])


def test_a_profile_asked_for_from_the_ui_and_cut_off_by_the_scripts_end_is_printed(
    tmp_path: Path,
):
    """Asked for as the UI's P asks for it (here by the script, at step 3: the session is
    tensordbg run's), and the script ends 2 steps later: the steps done are summarized and
    printed, as ``--profile``'s are, not lost with the UI's connection."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace(
        "    if step + 1 == int(sys.argv[1]):",
        "    if step == 3:\n"
        "        from tensordbg.api import attached_to\n"
        "        attached_to(model).profile(10)\n"
        "    if step + 1 == int(sys.argv[1]):",
    ))  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "tensordbg.cli", "run", str(script), "8"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "the training ended while profiling" in done.stderr, done.stderr
    assert "tensordbg profile: 3 steps (5..7) on cpu" in done.stderr, done.stderr


def test_a_profile_cut_off_by_the_end_of_a_plain_python_script_is_printed_at_exit(
    tmp_path: Path,
):
    """The same without ``tensordbg run``: the script attaches itself and ``python train.py``
    runs it. Before, the summary thread died with the interpreter and the report was lost."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace(
        "for step, (x, y)",
        "import tensordbg\n"
        "session = tensordbg.attach(model, optimizer=opt, server=False)\n"
        "for step, (x, y)",
    ).replace(
        "    if step + 1 == int(sys.argv[1]):",
        "    if step == 3:\n"
        "        session.profile(10)\n"
        "    if step + 1 == int(sys.argv[1]):",
    ))  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script), "8"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "trained" in done.stdout
    assert "tensordbg: the training ended while profiling" in done.stderr, done.stderr
    assert "tensordbg profile: 3 steps (5..7) on cpu" in done.stderr, done.stderr
    assert done.stderr.count("tensordbg profile:") == 1


@pytest.mark.parametrize("waits", [False, True])
def test_a_profile_only_session_nobody_waited_for_prints_its_report_at_exit(tmp_path, waits):
    """tensordbg.profile() in a script that never asks for the report printed nothing: the
    profile was made and lost. A script that waits prints it itself, once."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace(
        "for step, (x, y)",
        "import tensordbg\n"
        "session = tensordbg.profile(model, opt, steps=3, server=False)\n"
        "for step, (x, y)",
    ) + ("print(session.profiling.wait(60).text(), file=sys.stderr)\n" * waits))  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script), "8"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("tensordbg profile: 3 steps (1..3) on cpu") == 1, done.stderr
    assert "ended while profiling" not in done.stderr


READS = (
    "import time\nwhile not handle.done: time.sleep(0.05)\n"
    "print(handle.report.text(), file=sys.stderr)\n"
)


@pytest.mark.parametrize("reads", ["", READS])
def test_a_profile_a_detach_cut_short_is_printed_at_exit_unless_the_script_read_it(tmp_path, reads):
    """A profile still running when the script detached (the end of ``with attach(...)``) was
    lost: the detach took the session's exit hook with it, so the report was never printed
    and its trace never written."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace(
        "for step, (x, y)",
        "import tensordbg\n"
        "session = tensordbg.attach(model, optimizer=opt, on_hit='record', server=False)\n"
        "handle = session.profile(steps=5)\n"
        "for step, (x, y)",
    ).replace('print("trained")', 'session.detach()\nprint("trained")\n' + reads))  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script), "4"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = "tensordbg: detached while profiling; 3 of its 5 steps were profiled"
    assert (said in done.stderr) != bool(reads), done.stderr  # a script that read it printed it
    assert done.stderr.count("tensordbg profile: 3 steps (1..3) on cpu") == 1, done.stderr
    assert list(tmp_path.glob("tensordbg-*/*/trace-*.json.gz")), done.stderr


def test_tensordbg_run_profile_of_a_short_script_reports_the_steps_it_had(cli, tmp_path: Path):
    done = tensordbg_run(tmp_path, "10", "5")
    assert done.returncode == 0, done.stderr
    assert "tensordbg profile: 3 steps (2..4)" in done.stderr
    assert "3 of its 10 steps were profiled" in done.stderr
    code, _, err = cli("run", "--profile", "0", "x.py")
    assert code == 2 and "a number of steps from 1 to 1000" in err
    assert "Traceback" not in err
