"""Several ranks: a 2-rank DDP job under ``torchrun`` (gloo, CPU), one session per rank.

Each test launches ``tests/ranks_job.py`` (a tiny DDP training) with ``torchrun --standalone
--nproc-per-node 2`` and reads what each rank wrote. The launcher picks a free port itself
(``--standalone``), and every job is killed, with its whole process group, if it outlives
its deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensordbg
from tensordbg.sources.replay import ReplaySource
from tensordbg.transport.connection import find_sessions
from tensordbg.transport.sync_client import SyncClient

pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("ranks_job.py")
DEADLINE = 90.0


class Job:
    """A running ``torchrun`` job of ``ranks_job.py``."""

    def __init__(self, scenario: str, out: Path):
        self.out = out
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(JOB), scenario, str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip

    def wait(self, timeout: float = DEADLINE) -> str:
        try:
            output, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            output, _ = self.process.communicate()
            raise AssertionError(f"the job did not end within {timeout} s:\n{output}") from None
        for result in sorted(self.out.glob("rank*.json")):
            left = json.loads(result.read_text())["threads_left"]
            assert not left, f"{result.stem}: threads still running after detach: {left}"
        return output

    def rank(self, n: int) -> dict:
        return json.loads((self.out / f"rank{n}.json").read_text())

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[type[Job]]:
    jobs: list[Job] = []

    def start(scenario: str) -> Job:
        jobs.append(Job(scenario, tmp_path))
        return jobs[-1]

    yield start  # type: ignore[misc]
    for j in jobs:
        j.kill()


def test_a_nan_on_rank_1_only_is_a_hit_on_rank_1_at_its_module_and_step(job):
    j = job("nan")
    output = j.wait()
    assert j.process.returncode == 0, output
    rank0, rank1 = j.rank(0), j.rank(1)
    # One job, one session per rank, named by torchrun's run id and the launcher's RANK.
    assert rank0["run_id"] == rank1["run_id"] and rank0["run_id"]
    assert (rank0["session_rank"], rank1["session_rank"]) == (0, 1)
    origin = next(h for h in rank1["hits"] if h["origin"])
    assert (origin["rule"], origin["module"], origin["kind"], origin["step"], origin["rank"]) == (
        "NaN", "1", "output", 3, 1,
    )  # fmt: skip
    # Rank 0's own forward and backward were clean; DDP's all-reduce then carried rank 1's NaN
    # into its gradients and weights: those hits are passed on, naming rank 1, not new origins.
    assert rank0["hits"] and all(h["rank"] == 0 and not h["origin"] for h in rank0["hits"])
    # Its gradients are judged as the all-reduce left them, before the update lands.
    first = rank0["hits"][0]
    assert (first["step"], first["kind"], first["phase"]) == (3, "grad", "backward")
    assert "It came from rank 1 (NaN at 1.output)" in first["message"]
    # Its statistics are the all-reduced gradient's; the step before holds rank 0's own: the
    # "previous step" column compared the two as one quantity.
    assert rank0["compared"] and rank0["compared"][0]["previous"] is None, rank0["compared"]
    assert "as the all-reduce left it" in rank0["compared"][0]["why"]
    assert not [h for h in rank0["hits"] if "The gradient was clean" in h["message"]]
    # Rank 1 ran its module's forward again alone (no collective in it) and named the product.
    assert (
        "Inside 1's forward the first NaN came from Tensor.mul at ranks_job.py" in origin["message"]
    )
    # Both ranks' weights are NaN alike: RankDivergence does not call that a drift.
    assert not [h for r in (rank0, rank1) for h in r["hits"] if h["rule"] == "RankDivergence"]
    # Named as in the user's model, without DistributedDataParallel's "module." prefix.
    assert rank0["params"] == ["0.bias", "0.weight", "1.lin.bias", "1.lin.weight", "3.bias",
                               "3.weight"]  # fmt: skip
    # tensordbg ran no collective of its own (DDP's are not Python-level calls).
    assert rank0["collectives"] == {} and rank1["collectives"] == {}


def test_skip_on_one_rank_s_nan_skips_that_update_on_every_rank(job):
    """on_hit="skip": rank 1 skips the update its NaN would make, and rank 0, whose gradients
    the all-reduce made NaN, skips the same step: the replicas stay alike and finite."""
    j = job("skip")
    output = j.wait()
    assert j.process.returncode == 0, output
    rank0, rank1 = j.rank(0), j.rank(1)
    assert rank0["skipped"] == rank1["skipped"] == [3]
    assert rank0["finite"] and rank1["finite"]


def test_rank_divergence_reports_the_rank_whose_weights_drifted(job):
    j = job("drift")
    output = j.wait()
    assert j.process.returncode == 0, output
    rank0, rank1 = j.rank(0), j.rank(1)
    drift = [h for h in rank1["hits"] if h["rule"] == "RankDivergence"]
    assert drift and drift[0]["tensor"] == "3.weight" and drift[0]["rank"] == 1
    assert "differs between ranks" in drift[0]["message"]
    # Checked every 2 steps on the fingerprints of the check before: planted at step 4 (before
    # its update), published at step 6, compared at step 8.
    assert drift[0]["step"] in (4, 6)
    assert {h["tensor"] for h in drift} == {"3.weight"}
    assert not [h for h in rank0["hits"] if h["rule"] == "RankDivergence"]


def test_raise_on_one_rank_ends_the_whole_job_with_one_line_from_the_others(job):
    j = job("raise")
    output = j.wait(timeout=60)
    ended = time.time()
    assert j.process.returncode != 0
    assert "WatchpointHit" in output  # rank 1's own error
    assert "tensordbg: rank 1 stopped the job: NaN at step 3 in 1.output; rank 0 stops too" in (
        output
    )
    # Rank 0's all-reduce fails as rank 1's process goes: that ends it with the line, not
    # with gloo's traceback.
    assert "Connection closed by peer" not in output
    # From rank 1's raise to the end of the whole job (both ranks and the launcher).
    assert ended - float((j.out / "raised").read_text()) < 30


def _sessions_of(j, runtime_dir: Path, deadline: float) -> list:
    """The two ranks' sessions of a job, by rank, once both are served."""
    sessions: list = []
    while len(sessions) < 2:
        assert time.monotonic() < deadline and j.process.poll() is None, "no sessions"
        sessions = sorted(find_sessions(runtime_dir), key=lambda s: s.rank)
        time.sleep(0.2)
    return sessions


def test_every_rank_pauses_together_and_continue_resumes_them_all(job, private_runtime_dir):
    j = job("pause")
    deadline = time.monotonic() + DEADLINE
    sessions = _sessions_of(j, private_runtime_dir, deadline)
    assert sessions[0].run_id == sessions[1].run_id
    assert [s.name for s in sessions] == [f"{sessions[0].run_id}-0", f"{sessions[0].run_id}-1"]
    clients = [SyncClient(str(s.path)) for s in sessions]
    try:
        infos: list = []
        while not infos or any(i["state"] != "paused" for i in infos):
            assert time.monotonic() < deadline, f"not all paused: {infos}"
            time.sleep(0.2)
            infos = [c.call("info") for c in clients]
        # Both at the optimizer step of step 3, where no rank waits inside an all-reduce, and
        # each says so (it said "backward": that phase had ended).
        assert [(i["step"], i["phase"]) for i in infos] == [(3, "optimizer"), (3, "optimizer")]
        assert infos[1]["paused_at"]["rule"] == "NaN" and infos[1]["paused_at"]["rank"] == 1
        assert "rank 1 paused the job" in infos[0]["pause_reason"]
        clients[0].call("control", action="continue")  # continue on rank 0 resumes rank 1 too
        output = j.wait()
    finally:
        for c in clients:
            c.close()
    assert j.process.returncode == 0, output
    assert j.rank(0)["paused_steps"] == [3] and j.rank(1)["paused_steps"] == [3]
    # A healthy DDP training otherwise: its weights stay identical on both ranks.
    assert not [h for n in (0, 1) for h in j.rank(n)["hits"] if h["rule"] == "RankDivergence"]


def test_detaching_one_rank_while_the_job_is_paused_is_clean(job, private_runtime_dir):
    """q on rank 0's UI while both ranks were paused at the step's safe point: rank 0 said
    "internal error ... optimizers[0]: IndexError" (its hook went on after detaching). The
    detach resumes rank 1 too (a resumed rank writes the pause it leaves): the test's own
    continue to rank 1 raced with rank 1 ending the job, and lost in a loaded CI."""
    j = job("pause")
    deadline = time.monotonic() + DEADLINE
    sessions = _sessions_of(j, private_runtime_dir, deadline)
    clients = [SyncClient(str(s.path)) for s in sessions]
    try:
        while any(c.call("info")["state"] != "paused" for c in clients):
            assert time.monotonic() < deadline, "not all paused"
            time.sleep(0.2)
        clients[0].call("control", action="detach")  # q on rank 0: the job goes on
        output = j.wait()
    finally:
        for c in clients:
            c.close()
    assert j.process.returncode == 0, output
    assert "internal error" not in output and "detached (step 3, optimizer)" in output


def test_a_multi_rank_dump_holds_every_rank_and_replays_checks_and_diffs(job):
    j = job("dump")
    output = j.wait()
    assert j.process.returncode == 0, output
    dump_dir = j.out / "dump"
    dump = tensordbg.load(dump_dir)
    # One run directory, a part per rank, every step of both (dump_every=1).
    assert dump.ranks == [0, 1] and all(dump.steps(r) == list(range(6)) for r in (0, 1))
    origin = next(h for h in dump.hits if h.origin)
    assert (origin.rank, origin.step, origin.tensor) == (1, 3, "1.output")
    # dump_tensors=["3.weight"]: its value on every step, the step's update included.
    weight = dump.tensor("3.weight", rank=1)
    assert weight.steps() == list(range(6))
    assert np.isfinite(weight.value(2)).all() and np.isnan(weight.value(3)).all()
    assert {e.name: e.trainable for e in dump.tensors(0, rank=0)}["3.weight"] is True

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tensordbg.cli", *args], capture_output=True,
                              text=True, timeout=DEADLINE)  # fmt: skip

    checked = cli("check", str(dump_dir), "--json")
    assert checked.returncode == 1, checked.stderr
    report = json.loads(checked.stdout)
    assert report["ranks"] == [0, 1]
    first = {r: min((f["step"], f["order"]) for f in report["findings"] if f["rank"] == r)
             for r in (0, 1)}  # fmt: skip
    assert first[0][0] == 3 and first[1][0] == 3
    origin_finding = next(f for f in report["findings"] if f["rank"] == 1 and f["step"] == 3)
    assert origin_finding["tensor"] == "1.output" and origin_finding["origin"] is True
    assert [f["tensor"] for f in report["findings"] if f["origin"]] == ["1.output"]
    table = cli("check", str(dump_dir)).stdout
    # Its first row, though rank 0's rows of later steps come first in execution order.
    assert table.startswith("step 3 rank 1 forward   NaN                1.output  <- origin")
    assert "it arose at 1.output, step 3 of rank 1 (NaN)" in table
    # Both ranks got the same data: they part where rank 1's own module made the NaN.
    parted = cli("diff", str(dump_dir), str(dump_dir), "--ranks", "0,1")
    assert parted.returncode == 1, parted.stderr
    said = "The runs part at step 3, forward, 1.output: dumped only in B, where it is not finite"
    assert said in parted.stdout, parted.stdout
    same = cli("diff", str(dump_dir), str(dump_dir), "--ranks", "1,1")
    assert same.returncode == 0 and "The runs agree" in same.stdout, same.stdout
    # The replay UI serves either rank, and says which of how many; it opens at the origin's.
    for rank in (0, 1):
        source = ReplaySource(dump, rank=rank)
        assert (source.info()["rank"], source.info()["world_size"]) == (rank, 2)
    assert ReplaySource(dump).info()["rank"] == 1  # rank 0's hits there are passed on


def test_a_dump_of_the_steps_with_hits_holds_the_gradients_the_all_reduce_made_nan(job):
    """With on_hit="dump", rank 0's hits on the gradients the all-reduce brought NaN were
    recorded, but the dump held neither their statistics nor their values: they were judged
    after the backward phase ended, and the optimizer's phase dropped them (check found 6 of
    rank 0's 18 hits; replay said the gradient "was not dumped")."""
    j = job("hitdump")
    output = j.wait()
    assert j.process.returncode == 0, output
    dump = tensordbg.load(j.out / "dump")
    grads = {e.name: e for e in dump.tensors(3, rank=0) if e.kind == "grad"}
    assert grads["3.weight.grad"].stats["finite"] == 0.0 and grads["3.weight.grad"].has_value
    assert np.isnan(dump.tensor("3.weight.grad", rank=0).value(3)).any()
    command = [sys.executable, "-m", "tensordbg.cli", "check", str(j.out / "dump"), "--json"]
    checked = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE)
    found = {f["tensor"] for f in json.loads(checked.stdout)["findings"]
             if f["rank"] == 0 and f["step"] == 3}  # fmt: skip
    assert "3.weight.grad" in found, found


def test_a_nan_the_all_reduce_brings_to_a_second_optimizer_s_gradients_is_found_before_it_steps(
    job,
):
    """Two optimizers: rank 1's gradient of ``3.weight`` (the second optimizer's) is NaN at step
    3. Rank 0's own gradients were clean; the all-reduce made that one NaN. It is found before
    the second optimizer applies it, as the gradient it is, and the phase lists it once."""
    j = job("two")
    output = j.wait()
    assert j.process.returncode == 0, output
    rank0, rank1 = j.rank(0), j.rank(1)
    origin = next(h for h in rank1["hits"] if h["origin"])
    assert (origin["tensor"], origin["step"], origin["rank"]) == ("3.weight.grad", 3, 1)
    first = rank0["hits"][0]
    assert (first["tensor"], first["step"], first["kind"], first["origin"]) == (
        "3.weight.grad", 3, "grad", False,
    )  # fmt: skip
    assert "the gradient all-reduce brought it from another rank" in first["message"]
    # The weight the update then made NaN is no origin, and nothing says its gradient was clean.
    assert not [h for h in rank0["hits"] if h["origin"] or "gradient was clean" in h["message"]]
    # The gradient is one tensor of its phase, not the rank's own beside the reduced one.
    assert rank0["named_at_hits"][0].count("3.weight.grad") == 1


def test_each_rank_s_summary_says_which_rank_it_is(capsys) -> None:
    """Under torchrun every rank printed "tensordbg: 217 hits, 1 at their origin." at its exit,
    interleaved with the others': which rank said which could not be told."""
    from types import SimpleNamespace

    from tensordbg.engine.hits import print_summary

    def session(rank, ranks):
        text = "tensordbg: 2 hits, 1 at their origin.\n  step 3"
        return SimpleNamespace(hitlog=SimpleNamespace(summarized=False), rank=rank, ranks=ranks,
                               summary=lambda: text)  # fmt: skip

    print_summary(session(1, ranks=object()))
    print_summary(session(0, ranks=None))  # one process: as before
    assert capsys.readouterr().err.splitlines() == [
        "tensordbg (rank 1): 2 hits, 1 at their origin.", "  step 3",
        "tensordbg: 2 hits, 1 at their origin.", "  step 3",
    ]  # fmt: skip
