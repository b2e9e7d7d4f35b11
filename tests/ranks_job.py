"""A tiny DDP training for the multi-rank tests, run by ``torchrun --nproc-per-node 2``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ranks_job.py \
        SCENARIO OUT_DIR

Each rank writes ``OUT_DIR/rank<N>.json``: its hits, its session's identity, what it saw.
Scenarios: ``nan`` (rank 1's training forward makes a NaN in module ``1`` at step 3; hits
recorded), ``raise`` (the same, raising), ``pause`` (an evaluation forward of rank 1 makes it, so
the training itself stays healthy; the test drives the pause through the UI's client), ``drift``
(rank 1's ``3.weight`` is changed by hand at step 4), ``dump`` (as ``nan``, both ranks fed the
same data and writing every step into one dump directory, ``OUT_DIR/dump``), ``hitdump`` (as
``nan``, with ``on_hit="dump"``: only the steps with hits are written), ``skip`` (as
``nan``, with ``on_hit="skip"``), ``two`` (two optimizers, the second owning ``3``; rank 1's
gradient of ``3.weight`` is made NaN at step 3 by a hook, so only that optimizer's gradients go
bad), ``bare`` (no tensordbg).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tensordbg
from tensordbg.rules import NaN, RankDivergence

STEPS = {"pause": 8, "drift": 12}
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "reduce",
               "gather", "scatter", "all_to_all", "send", "recv", "all_gather_object",
               "broadcast_object_list", "all_reduce_coalesced", "monitored_barrier")  # fmt: skip


class Poison(nn.Module):
    """Multiplies by NaN on one rank at one step (its own code makes the NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * float("nan") if self.armed else y


def count_collectives() -> dict[str, int]:
    """Count the calls of every Python-level collective from here on."""
    counts: dict[str, int] = {}
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def main(scenario: str, out: Path) -> None:
    started = time.time()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Poison(), nn.Tanh(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    optimizers = [opt]
    if scenario == "two":
        opt = torch.optim.SGD([*model[0].parameters(), *model[1].parameters()], lr=0.01)
        optimizers = [opt, torch.optim.SGD(model[3].parameters(), lr=0.01)]
    armed = {"grad": False}
    if scenario == "two" and rank == 1:
        model[3].weight.register_hook(lambda g: g * float("nan") if armed["grad"] else g)
    counts = count_collectives()
    session = None
    if scenario != "bare":
        on_hit = {"raise": "raise", "pause": "pause", "skip": "skip",
                  "hitdump": "dump"}.get(scenario, "record")  # fmt: skip
        rules = [NaN(), RankDivergence(every=2)]
        dumps = {"dump_dir": out / "dump", "dump_every": 1, "dump_tensors": ["3.weight"]}
        if scenario == "hitdump":
            dumps = {"dump_dir": out / "dump"}
        session = tensordbg.attach(ddp, optimizer=optimizers, rules=rules, on_hit=on_hit,
                                   server=scenario == "pause", summary_at_exit=False,
                                   **(dumps if "dump" in scenario else {}))  # fmt: skip
    paused_steps: list[int] = []
    if session is not None:
        session.bus.subscribe(lambda e, p: paused_steps.append(p["step"]), events={"pause"})
    named: list[list[str]] = []  # at each hit, the names of the phase's records (the UI's list)
    if session is not None:
        phases = session.phases
        session.bus.subscribe(lambda e, p: named.append([r.stats.name for r in phases.records]),
                              events={"hit"})  # fmt: skip
    # What the UI's "previous step" column says of a gradient the all-reduce brought NaN,
    # asked as the hit is made (the training thread: the live source answers at once).
    compared: list[dict] = []
    if session is not None and scenario == "nan" and rank == 0:
        from tensordbg.sources.live import LiveSource

        def compare(event: str, hit: dict) -> None:
            if hit["kind"] == "grad" and not compared:
                reply = LiveSource(session).stats(hit["ref"])
                compared.append({"previous": reply["previous"], "why": reply.get("previous_why")})

        session.bus.subscribe(compare, events={"hit"})
    generator = torch.Generator().manual_seed(0 if scenario == "dump" else rank)
    for step in range(STEPS.get(scenario, 6)):
        poison = model[1]
        poison.armed = (scenario in ("nan", "raise", "dump", "hitdump", "skip") and rank == 1
                        and step == 3)  # fmt: skip
        if scenario == "pause" and rank == 1 and step == 3:
            poison.armed = True  # an evaluation forward on rank 1 only makes a NaN
            with torch.no_grad():
                ddp(torch.randn(16, 4, generator=generator))
            poison.armed = False
        if scenario == "drift" and rank == 1 and step == 4:
            with torch.no_grad():
                model[3].weight.add_(0.01)
        armed["grad"] = step == 3
        x = torch.randn(16, 4, generator=generator)
        try:
            loss = ddp(x).pow(2).mean()
        except tensordbg.WatchpointHit:
            (out / "raised").write_text(str(time.time()))  # when the job's end began
            raise
        loss.backward()
        for o in optimizers:
            o.step()
            o.zero_grad()
    result = {
        "rank": rank,
        "hits": [h.as_dict() for h in session.hits] if session else [],
        "run_id": session.run_id if session else None,
        "session_rank": session.rank if session else None,
        "modules": sorted(session.capture.calls_by_path) if session else [],
        "params": sorted(session.params_by_name) if session else [],
        "collectives": counts,
        "paused_steps": paused_steps,
        "named_at_hits": named,
        "compared": compared,
        "skipped": session.skipped_updates if session else [],
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "finished": time.time(),
        "seconds": time.time() - started,
    }
    if session is not None:
        session.detach()
    dist.destroy_process_group()
    # What tensordbg left running once detached: nothing (its threads are joined at detach).
    result["threads_left"] = sorted(t.name for t in threading.enumerate()
                                    if t is not threading.main_thread())  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's worker threads outlive destroy_process_group (something else still holds the
    # group, with or without tensordbg), and the interpreter's teardown under them has
    # aborted the process ("terminate called without an active exception") in about one
    # job in a hundred under CI load, after the rank's work was done and written. The job
    # ends here instead: what it did is in its json, checked by the tests.
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.enable(all_threads=True)  # an abort shows every thread's Python stack
    main(sys.argv[1], Path(sys.argv[2]))
