"""Where the default's time goes inside its hooks: milliseconds a step for each kind of hook,
and how much of it reads tensors (their statistics) rather than keeping Python bookkeeping.

    python benchmarks/hooks.py                # overhead.py's CPU model, 3 runs of 40 steps
    python benchmarks/hooks.py --steps 100 --runs 5

The last column is the median of the time each hook spent reading tensors.

Python's garbage collector is counted apart: its time in the measured steps (in a hook or
not), how often each generation ran, and how many objects the collector tracks that a step holds
at the end of its backward pass, attached and bare. The collector runs when the objects made
since it last ran pass 700, so a step holding more than that runs it every step; and each
object a collection finds alive moves on, towards the full collection that walks every object
of the process (torch's too).

Quieter than overhead.py's ratio: it times tensordbg's own code only (perf_counter around each
hook the session installs, and around the two functions that read a tensor on the host), so the
noise of a busy machine in the model's kernels stays out of it. The time inside the hooks is
nearly all the default's cost (hooks that do nothing cost nothing measurable: overhead.py
--floor). It reaches into the session's internals: a measurement of where the cost goes, not a
way to run tensordbg.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import CONFIGS, GPT, Runner, machine

import tensordbg
from tensordbg.engine import vouching
from tensordbg.engine.capture import Capture
from tensordbg.engine.grad_hooks import GradHooks
from tensordbg.engine.params import ParamWatch
from tensordbg.engine.session import Session

# The hooks, as the session installs them: (class, method, what the table calls it).
HOOKS = [
    (Capture, "on_enter", "module pre-hooks"),
    (Capture, "_on_exit", "module post-hooks (the root's: the forward's records)"),
    (Capture, "_on_leaf_exit", "leaf modules' post-hooks (their calls entered there)"),
    (GradHooks, "_on_node_grad", "activation-gradient hooks"),
    (GradHooks, "on_grad", "activation-gradient hooks"),
    # (a residual's gradient is kept by a builtin hook, no Python: only a split's is timed)
    (vouching, "_keep_one", "activation gradients kept for a voucher (residuals)"),
    (Session, "param_grad", "parameter-gradient hooks (several ranks, eager)"),
    (Session, "pass_started", "start of the backward pass"),
    (Session, "_end_backward", "end of the backward pass (parameter gradients, rules)"),
    (Session, "_before_step", "optimizer step pre-hook"),
    (Session, "_after_step", "optimizer step post-hook"),
    (Session, "observe", "observe (the loss)"),
]
READERS = ("host_stats", "norms_of")  # every read of a tensor on the host goes through these
READING_METHODS = [(ParamWatch, "sampled")]  # and the parameters' samples after an update


class Clock:
    """Time spent inside the hooks, by hook, and inside the readers, by the hook they ran in."""

    def __init__(self) -> None:
        self.inside: dict[str, float] = defaultdict(float)
        self.reading: dict[str, float] = defaultdict(float)
        self.current: str | None = None  # the outermost hook running
        self.collections: list[Collector] = []  # one a run

    def hook(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.current is not None:  # called from another hook: counted there
                return fn(*args, **kwargs)
            self.current = label
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside[label] += time.perf_counter() - start
                self.current = None

        return timed

    def reader(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.reading[self.current or "outside the hooks"] += time.perf_counter() - start

        return timed

    def install(self) -> None:
        for cls, name, label in HOOKS:
            setattr(cls, name, self.hook(getattr(cls, name), label))
        for module in [m for n, m in list(sys.modules.items()) if n.startswith("tensordbg")]:
            for name in READERS:
                fn = getattr(module, name, None)
                if fn is not None and getattr(fn, "__module__", "").startswith("tensordbg"):
                    setattr(module, name, self.reader(fn))
        for cls, name in READING_METHODS:
            setattr(cls, name, self.reader(getattr(cls, name)))

    def clear(self) -> None:
        self.inside.clear()
        self.reading.clear()


class Collector:
    """Python's garbage collections while it listens: seconds and count, by generation."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = defaultdict(float)
        self.count: dict[int, int] = defaultdict(int)
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.count[info["generation"]] += 1

    def __enter__(self) -> Collector:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def held_at_backward_end(name: str, attached: bool) -> int:
    """The objects Python's collector tracks that one step made and still holds right after its
    backward pass (a warm step: the tenth)."""
    vocab, seq, dim, layers, heads, batch = CONFIGS[name]
    torch.manual_seed(0)
    runner = Runner("attached", GPT(vocab, seq, dim, layers, heads), "cpu", None)
    if attached:
        runner.session = tensordbg.attach(runner.model, optimizer=runner.optimizer,
                                          on_hit="record", server=False)  # fmt: skip
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(9):
        runner.step(tokens)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        logits = runner.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if runner.session is not None:
            runner.session.observe("loss", loss)
        loss.backward()
        held = sum(1 for o in gc.get_objects() if id(o) not in before)
    finally:
        if enabled:
            gc.enable()
    if runner.session is not None:
        runner.session.detach()
    return held


def run(clock: Clock, name: str, steps: int,
        warmup: int) -> tuple[dict[str, float], dict[str, float], float]:  # fmt: skip
    """One attached model trained ``warmup`` + ``steps`` steps: ms a step inside each hook (and
    "reading" / "Python" totals), of it reading tensors, by hook, and the median step."""
    vocab, seq, dim, layers, heads, batch = CONFIGS[name]
    torch.manual_seed(0)
    runner = Runner("attached", GPT(vocab, seq, dim, layers, heads), "cpu", None)
    runner.session = tensordbg.attach(runner.model, optimizer=runner.optimizer,
                                      on_hit="record", server=False)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(4)]
    for i in range(warmup):
        runner.step(batches[i % len(batches)])
    clock.clear()
    with Collector() as collector:
        times = [runner.step(batches[i % len(batches)]) for i in range(steps)]
    clock.collections.append(collector)
    hits = len(runner.session.hits)
    runner.session.detach()
    if hits:
        raise SystemExit(f"{hits} hits on a healthy model: the figures would not be the default's")
    per_step = {label: 1e3 * t / steps for label, t in clock.inside.items()}
    reads = {label: 1e3 * clock.reading.get(label, 0.0) / steps for label in per_step}
    per_step["total"] = sum(per_step.values())
    reads["total"] = per_step["  reading tensors"] = sum(reads.values())
    per_step["  Python"] = per_step["total"] - reads["total"]
    return per_step, reads, statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="encoder-256")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    clock = Clock()
    clock.install()
    results = [run(clock, args.model, args.steps, args.warmup) for _ in range(args.runs)]
    print(f"tensordbg inside its hooks (default rules, sync auto): {args.model}, {args.runs} runs "
          f"of {args.steps} steps after {args.warmup}, ms a step")  # fmt: skip
    print(f"machine: {machine()}")
    labels = list(dict.fromkeys(label for _, _, label in HOOKS))
    labels += ["total", "  reading tensors", "  Python"]
    header = "".join(f"{f'run {i + 1}':>8s}" for i in range(args.runs))
    print(f"{'':56s}{header}{'median':>8s}{'reading':>9s}")
    for label in labels:
        values = [r.get(label, 0.0) for r, _, _ in results]
        cells = "".join(f"{v:8.2f}" for v in values)
        reads = [r[label] for _, r, _ in results if label in r]
        read = f"{statistics.median(reads):9.2f}" if reads else ""
        print(f"{label:56s}{cells}{statistics.median(values):8.2f}{read}")
    steps = "".join(f"{s:8.1f}" for _, _, s in results)
    print(f"{'the attached step (median)':56s}{steps}")
    collected = [1e3 * sum(c.seconds.values()) / args.steps for c in clock.collections]
    cells = "".join(f"{v:8.2f}" for v in collected)
    print(f"{'  of the above, Python collector (mean, in hooks or not)':56s}{cells}"
          f"{statistics.median(collected):8.2f}")  # fmt: skip
    runs = len(clock.collections) * args.steps
    counts = {g: sum(c.count[g] for c in clock.collections) for g in range(3)}
    full = 1e3 * sum(c.seconds[2] for c in clock.collections) / max(counts[2], 1)
    print(f"collections in {runs} steps: {counts[0]} young, {counts[1]} middle, {counts[2]} full "
          f"(the full ones {full:.0f} ms each)")  # fmt: skip
    print(f"objects the collector tracks that a step holds after its backward pass: "
          f"{held_at_backward_end(args.model, True)} attached, "
          f"{held_at_backward_end(args.model, False)} bare")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
