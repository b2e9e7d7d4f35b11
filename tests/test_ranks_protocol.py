"""The multi-rank protocol in one process: two ranks' links over one in-memory store.

What the ``torchrun`` tests (test_ranks.py) show end to end, shown here step by step and fast:
where a rank's pause request lands, that every rank pauses at the same safe point, that one
``continue`` resumes them all, that a raise on one rank stops the others with one line, and
how a job's ranks agree on their run id.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import wait_until

import tensordbg
from tensordbg.distributed import RankIdentity, RankLink, job_run_id, unwrap
from tensordbg.engine.control import PauseController
from tensordbg.engine.handles import HandleGroup
from tensordbg.hit import Hit
from tensordbg.rules import RankDivergence


class FakeRank:
    """What a RankLink needs of a session: a step, a phase, a controller and _block."""

    def __init__(self, rank: int, store: dist.Store):
        self.step, self.phase = 0, "forward"
        self.handles = HandleGroup()
        self.controller = PauseController(training_thread=threading.current_thread())
        self.blocked: list[tuple[int, str, Hit | None]] = []
        identity = RankIdentity("job7", rank, rank, 2)
        self.ranks = RankLink(self, store, identity, poll=0.02)

    def _block(self, reason: str, hit: Hit | None) -> None:
        if self.ranks.defer(reason, hit):
            return
        self.blocked.append((self.step, reason, hit))
        self.controller.block(reason, hit)


def nan_hit(step: int) -> Hit:
    return Hit("NaN", "body.1.output", "body.1", "output", step, "forward", True, 1.0, None,
               "body.1.output holds 3 NaN")  # fmt: skip


@pytest.fixture
def ranks():
    store = dist.HashStore()
    pair = [FakeRank(0, store), FakeRank(1, store)]
    yield pair
    for r in pair:
        r.controller.detach()
        r.handles.close()


def run_in_thread(fn):
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_a_hit_in_forward_pauses_every_rank_at_that_steps_optimizer_step(ranks):
    rank0, rank1 = ranks
    rank0.step = rank1.step = 3
    rank1._block("NaN hit", nan_hit(3))  # in forward: rank 1 does not stop here
    assert rank1.blocked == []
    # Both reach the optimizer pre-hook of step 3 (the safe point) and stop there.
    rank1.controller.training_thread = t1 = run_in_thread(rank1.ranks.safe_point)
    rank0.controller.training_thread = t0 = run_in_thread(rank0.ranks.safe_point)
    wait_until(lambda: rank0.controller.state == rank1.controller.state == "paused", 5)
    assert rank1.blocked[0][2].rule == "NaN"  # the hitting rank shows its hit
    assert "rank 1 paused the job: NaN hit" in rank0.blocked[0][1]
    rank0.controller.resume()  # `c` on rank 0's UI
    t0.join(5), t1.join(5)
    assert not t0.is_alive() and not t1.is_alive()  # rank 1 went on too
    # The next safe points do not pause again.
    rank0.step = rank1.step = 4
    rank0.ranks.safe_point(), rank1.ranks.safe_point()
    assert len(rank0.blocked) == len(rank1.blocked) == 1


def test_a_hit_after_the_backward_pauses_at_the_next_step(ranks):
    rank0, rank1 = ranks
    rank0.step = rank1.step = 5
    rank1.phase = "backward"  # its all-reduce may already be done: rank 0 can be past step 5
    rank1._block("ExplodingGradient hit", None)
    rank0.ranks.safe_point(), rank1.ranks.safe_point()
    assert rank0.blocked == rank1.blocked == []
    assert rank0.ranks.request.target == 6


def test_a_raise_on_one_rank_stops_the_others_with_one_line(ranks, capsys):
    rank0, rank1 = ranks
    rank1.ranks.abort(nan_hit(3))
    with pytest.raises(SystemExit):
        rank0.ranks.safe_point()
    err = capsys.readouterr().err
    assert err.strip() == ("tensordbg: rank 1 stopped the job: NaN at step 0 in body.1.output; "
                           "rank 0 stops too (on_hit='raise')")  # fmt: skip
    rank1.ranks.safe_point()  # the raising rank itself goes on up its own WatchpointHit


def test_a_hook_left_for_an_error_caught_later_leaves_the_next_errors_alone(ranks, capsys):
    """A link closed while an error was on its way up keeps its excepthook for that error; the
    error was caught after all, and a later one, unrelated, reaches the top: it is not this
    hook's (no read of the store, which may be gone and block for its timeout)."""
    rank0, rank1 = ranks
    rank1.ranks.abort(nan_hit(3))  # rank 1 raised: rank 0's next collective fails
    try:
        raise RuntimeError("Connection closed by peer")
    except RuntimeError as failed:
        rank0.ranks.close()  # a trainer's teardown, with the error on its way up
        caught = failed
    real, reads = rank0.ranks.store, []

    class Counted:
        def get(self, key: str) -> bytes:
            reads.append(key)
            return real.get(key)

    rank0.ranks.store = Counted()
    assert not rank0.ranks._stopped_by_another_rank(ValueError("the user's own, later"))
    assert reads == []
    # The error it stayed for, even wrapped by a framework, still ends the rank with one line.
    assert rank0.ranks._stopped_by_another_rank(_raised_from(caught))
    assert reads and "rank 1 stopped the job" in capsys.readouterr().err


def _raised_from(cause: BaseException) -> BaseException:
    try:
        raise RuntimeError("the framework's own") from cause
    except RuntimeError as e:
        return e


def test_a_detach_waits_for_the_watcher_to_leave_the_store(ranks):
    """A daemon thread inside a store call (C++, the GIL released) when the interpreter exits
    is stopped there, and the process aborts: "terminate called without an active exception",
    exit status -6, for a rank whose training had ended well. Closing the link ends its
    watcher before it returns, so no thread of ours is in the store at exit."""
    for rank in ranks:
        watcher = rank.ranks._watcher
        assert watcher.is_alive()
        rank.ranks.close()
        assert not watcher.is_alive()


def test_polling_the_store_at_a_safe_point_costs_one_small_read(ranks):
    rank0, _ = ranks
    start = time.perf_counter()
    for _ in range(1000):
        rank0.ranks.safe_point()
    per_step = (time.perf_counter() - start) / 1000
    assert per_step < 1e-3  # about 5 us on an in-memory store, 0.1 ms over TCP


def test_a_jobs_ranks_agree_on_its_run_id():
    assert job_run_id({"TORCHELASTIC_RUN_ID": "af9aee17-0f25"}) == "af9aee17-0f25"
    assert job_run_id({"TORCHELASTIC_RUN_ID": "my job/7"}) == "my_job_7"
    # torchrun without --rdzv-id says "none": the rendezvous address names the job.
    env = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "WORLD_SIZE": "2"}  # fmt: skip
    assert (
        job_run_id(env)
        == job_run_id({**env, "RANK": "1"})
        != job_run_id({**env, "MASTER_PORT": "29501"})
    )
    assert job_run_id({}) is None
    me = RankIdentity.from_environment({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    assert (me.rank, me.local_rank, me.world_size, me.distributed) == (3, 1, 4, True)


def test_a_launcher_that_sets_no_rank_is_read_from_the_process_group(monkeypatch):
    """Lightning's own DDP launcher sets no RANK nor WORLD_SIZE: every rank called itself rank
    0 of one, so a replica split went unseen and a pause named the wrong rank. The process
    group the job started says which rank this is (found by a new user's trial)."""
    import tensordbg.distributed.identity as identity

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "1"}
    monkeypatch.setattr(identity, "_process_group", lambda: (1, 2))
    me = RankIdentity.from_environment(env)
    assert (me.rank, me.local_rank, me.world_size) == (1, 1, 2)
    other = RankIdentity.from_environment({**env, "LOCAL_RANK": "0"})
    assert me.run_id is not None and me.run_id == other.run_id  # one job: they find each other
    monkeypatch.setattr(identity, "_process_group", lambda: None)  # no group: one process
    alone = RankIdentity.from_environment(env)
    assert (alone.rank, alone.world_size, alone.distributed) == (0, 1, False)


def test_rank_divergence_compares_norms_with_a_relative_tolerance():
    rule = RankDivergence(rtol=1e-5)
    assert rule.compare("fc.weight", 2.0, 2.0, rank=1) is None
    assert rule.compare("fc.weight", 2.0, 2.0 * (1 + 1e-7), rank=1) is None
    finding = rule.compare("fc.weight", 2.02, 2.0, rank=1)
    assert finding is not None and "fc.weight differs between ranks" in finding.message
    assert rule.compare("fc.weight", float("nan"), 2.0, rank=1) is not None


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)  # fmt: skip
    yield
    dist.destroy_process_group()


def test_a_ddp_model_is_watched_as_the_users_model(one_rank_group):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    assert unwrap(ddp) == (model, ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with tensordbg.attach(ddp, optimizer=opt, on_hit="record", server=False) as session:
        ddp(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert sorted(session.params_by_name) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert session.ranks is None  # one rank: nothing to coordinate
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
        ddp(torch.randn(2, 3))
    assert session.hits[0].module == "0" and session.hits[0].rank == 0


def test_fsdp2_parameters_are_checked_on_the_local_shard_without_a_collective(one_rank_group,
                                                                              capsys):  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    group = dist.distributed_c10d._get_default_group()

    def steps(n: int) -> int:
        before = group._get_sequence_number_for_group()
        for _ in range(n):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        return group._get_sequence_number_for_group() - before

    bare = steps(2)
    with tensordbg.attach(model, optimizer=opt, on_hit="record", server=False) as session:
        assert "4 parameters are sharded" in capsys.readouterr().err
        assert steps(2) == bare  # not one collective more than the training's own
        with torch.no_grad():
            model[0].weight.to_local()[0, 0] = float("nan")
        steps(1)
    assert [(h.rule, h.tensor, h.kind) for h in session.hits][:1] == [("NaN", "0.weight",
                                                                       "param")]  # fmt: skip


def test_the_lines_each_rank_prints_say_which_rank_printed_them():
    """Both ranks of a job printed "tensordbg: watching DistributedDataParallel ..." and "a UI
    connected (...)" (twice: F9 reaches every rank), none saying whose (found trying two ranks
    as a new user); a rank's summary said so already."""
    from types import SimpleNamespace

    from tensordbg.engine.hits import ranked_line

    rank1 = SimpleNamespace(ranks=object(), rank=1)
    said = ranked_line(rank1, "tensordbg: a UI connected (step 5, optimizer)")
    assert said == "tensordbg (rank 1): a UI connected (step 5, optimizer)"
    alone = SimpleNamespace(ranks=None, rank=0)
    assert ranked_line(alone, "tensordbg: watching Net") == "tensordbg: watching Net"
