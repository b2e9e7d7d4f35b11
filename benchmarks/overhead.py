"""What tensordbg costs a training step: bare vs attached vs torch.autograd.detect_anomaly.

    python benchmarks/overhead.py                    # CPU: GPT-style encoder, d=256, 4 layers,
                                                     # seq 128, batch 8, AdamW
    python benchmarks/overhead.py --device cuda      # GPT-2 small in bf16 (d=768, 12 layers,
                                                     # seq 1024, batch 8)
    python benchmarks/overhead.py --ranks 2          # a DDP step of 2 ranks (gloo, CPU),
                                                     # attached vs bare, and the store's cost
    python benchmarks/overhead.py --capabilities     # what each capability of the default
                                                     # mode adds, one after another
    python benchmarks/overhead.py --floor            # the default beside hooks that only read
                                                     # what it reads, capability by capability:
                                                     # its floor, bookkeeping aside
    python benchmarks/overhead.py --prototype        # the default beside issue 8's guard
                                                     # design with the least Python

Copies of the same model train side by side in one process; each round runs one step of each,
in a rotating order, so that the machine's noise falls on all of them alike. The medians and
their ratios to the bare step are printed. tensordbg runs with the default rules, checked every
step (interval 1), without its UI server. Target: attached at most 1.03x bare (issue 8), on the
CPU and on CUDA.

"control" is a second bare copy, measured like the others: its ratio, which should be 1.000x,
is what this run can resolve. On a shared VM two identical copies part by up to 2 % in one
run's median, so quote several runs (``--no-control`` leaves it out).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import tensordbg


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


CONFIGS = {
    # name: (vocab, seq, dim, layers, heads, batch)
    "encoder-256": (2048, 128, 256, 4, 4, 8),
    "gpt2-small": (50257, 1024, 768, 12, 12, 8),
}


class Runner:
    """One model, its optimizer and how its steps run (bare, attached or under anomaly mode)."""

    def __init__(self, name: str, model: nn.Module, device: str, dtype: torch.dtype | None):
        self.name = name
        self.model = model
        self.device = device
        self.dtype = dtype
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.session = None
        self.times: list[float] = []

    def step(self, tokens: torch.Tensor) -> float:
        start = time.perf_counter()
        context = torch.autograd.detect_anomaly() if self.name == "anomaly" else _null()
        with context:
            with _autocast(self.device, self.dtype):
                logits = self.model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            if self.session is not None:
                self.session.observe("loss", loss)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _autocast(device: str, dtype: torch.dtype | None):
    if dtype is None:
        return _null()
    return torch.autocast(device_type=device, dtype=dtype)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    text = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({threads} threads)"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", choices=sorted(CONFIGS), default=None)
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-anomaly", action="store_true", help="leave anomaly mode out")
    parser.add_argument(
        "--no-control", action="store_true", help="leave out the second bare copy (control)"
    )
    parser.add_argument(
        "--also",
        nargs="*",
        default=["eager"],
        choices=("eager", "batched", "deferred"),
        help="modes to measure besides the default one (default: eager, which screens every "
        "tensor where it is made)",
    )
    parser.add_argument(
        "--ranks", type=int, default=None, help="a DDP step of N ranks (CPU), attached vs bare"
    )
    parser.add_argument(
        "--capabilities",
        action="store_true",
        help="the default mode built up one capability at a time: idle hooks (installed, doing "
        "nothing), guards (model output, loss), "
        "+ forward origin (module hooks), + backward origin (activation and parameter "
        "gradients), + weight checks (the default)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="the default beside hooks that read what it reads on a clean CPU step and do "
        "nothing else (no records, no rules), capability by capability: the cost of the "
        "reads, bookkeeping aside (with --capabilities: both, side by side)",
    )
    parser.add_argument(
        "--prototype",
        action="store_true",
        help="the default beside the issue's guard design with the least Python (references kept "
        "by the module hooks, the output and loss screened, one norm of each parameter gradient "
        "before the step, a sample of each parameter after it), without and with the gradients "
        "of the kept activations held to the step (its backward origin)",
    )
    args = parser.parse_args(argv)
    if args.ranks is not None:
        return ranks_main(args)
    device = args.device
    name = args.model or ("gpt2-small" if device == "cuda" else "encoder-256")
    rounds = args.rounds or (100 if device == "cpu" else 50)
    dtype = torch.bfloat16 if device == "cuda" else None
    vocab, seq, dim, layers, heads, batch = CONFIGS[name]

    torch.manual_seed(0)
    base = GPT(vocab, seq, dim, layers, heads).to(device)
    runners = [Runner("bare", base, device, dtype)]
    sessions = {}
    variants = CAPABILITIES if args.capabilities else [(m, m, 4) for m in ["auto", *args.also]]
    for label, mode, capabilities in variants:
        label = "attached" if label == "auto" else label
        runner = Runner(label, copy.deepcopy(base), device, dtype)
        runner.session = tensordbg.attach(
            runner.model, optimizer=runner.optimizer, on_hit="record", server=False, sync=mode,
            include=["-"] if capabilities == 1 else (),
        )  # fmt: skip
        _switch_off(runner.session, capabilities)
        sessions[runner.name] = runner.session
        runners.append(runner)
    if args.floor:  # each capability's reads alone, before the rows that keep the books
        for at, (label, reads) in enumerate(FLOORS, start=1):
            runners.insert(at, Runner(label, copy.deepcopy(base), device, dtype))
            watch_floor(runners[at].model, runners[at].optimizer, reads)
    if args.prototype:
        for label, grads in (("design", False), ("design+grad", True)):
            runners.insert(1, Runner(label, copy.deepcopy(base), device, dtype))
            runners[1].session = Guards(runners[1].model, runners[1].optimizer, grads)
    if not args.no_anomaly and not (args.capabilities or args.floor or args.prototype):
        runners.append(Runner("anomaly", copy.deepcopy(base), device, dtype))
    if not args.no_control:
        runners.append(Runner("control", copy.deepcopy(base), device, dtype))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device) for _ in range(4)]

    params = sum(p.numel() for p in base.parameters())
    print(f"tensordbg overhead: {name} ({params / 1e6:.1f} M parameters, batch {batch}, seq {seq}"
          f"{', bf16 autocast' if dtype else ''}) on {device}")  # fmt: skip
    print(f"machine: {machine()}")
    for i in range(args.warmup):
        for runner in runners:
            runner.step(batches[i % len(batches)])
    for i in range(rounds):
        order = runners[i % len(runners) :] + runners[: i % len(runners)]
        for runner in order:
            runner.times.append(runner.step(batches[i % len(batches)]))

    bare = runners[0].times
    print(f"{'':12s} {'median ms':>10s} {'ratio':>7s} {'ratio IQR':>15s}   (of {rounds} rounds)")
    for runner in runners:
        # Each round's step against the bare step of the same round: the machine's slow drifts
        # cancel out, which a ratio of two medians does not do.
        ratios = sorted(t / b for t, b in zip(runner.times, bare, strict=True))
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        med = statistics.median(runner.times)
        print(f"{runner.name:12s} {med * 1e3:10.1f} {statistics.median(ratios):7.3f}x"
              f" {q1:7.3f}-{q3:.3f}")  # fmt: skip
    broken = False
    for name, session in sessions.items():
        print(f"{name}: sync {session.mode}, {session.step} steps, {len(session.hits)} hits")
        if session.broken and session.broken is not True:  # the idle hooks. True: on purpose
            # An internal error turns every hook off: its figure would be idle hooks'.
            print(f"{name}: BROKEN ({session.broken}): its figure measures nothing")
            broken = True
        session.detach()
    return 1 if broken else 0


# The default mode built up one capability at a time: (label, sync, how many capabilities on).
CAPABILITIES = [
    ("idle hooks", "auto", 0),  # every hook installed, each returning at once: torch's dispatch
    ("guards", "auto", 1),  # the model's output and the loss (the root's hooks only)
    ("+fwd origin", "auto", 2),  # every module's call and output: the forward origin
    # The activation gradients no parameter gradient vouches for, and the parameter gradients
    # (read at the pass's end, they vouch for the rest): the origin of a backward-only NaN.
    ("+bwd origin", "auto", 3),
    ("+weights", "auto", 4),  # the weights after a clean update (sampled): the default, whole
]


# The floor of each capability: hooks that read what the default reads for it on a clean CPU
# step, and nothing else. (label, how many capabilities' reads.) The forward origin reads
# nothing on a clean step (it keeps references), so its floor is the guards'.
FLOORS = [("floor guard", 1), ("floor +bwd", 2), ("floor +wts", 3)]


def watch_floor(model: nn.Module, optimizer: torch.optim.Optimizer, reads: int = 3) -> None:
    """Hooks that read what the default reads on a clean CPU step of this model, and nothing
    more. Guards (``reads`` 1): the model's output (its sum). Backward origin (2): the one
    activation gradient per block that no parameter gradient vouches for (the attention's
    output, made by the block's own code: its sum, in its hook), and one norm pass over the
    parameter gradients when the pass ends. Weights (3): after the update, a sample of each
    parameter (``SAMPLE`` elements) and a rotating eighth of them (by count) whole. No call,
    record, rule or phase: what is left between this and the default is bookkeeping."""
    from torch.autograd import Variable

    from tensordbg.engine.params import ROTATION, SAMPLE, sample_of

    params = list(model.parameters())
    turn = [0]

    def read(t: torch.Tensor) -> bool:
        return math.isfinite(t.sum().item())

    def read_grad(grad_outputs: tuple) -> None:
        if grad_outputs[0] is not None:
            read(grad_outputs[0])

    def pass_ended() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        all(math.isfinite(n) for n in torch.stack(torch._foreach_norm(grads)).tolist())

    def output(module: nn.Module, args: tuple, out: object) -> None:
        if module is model:
            read(out)
            if reads >= 2:
                out.grad_fn.register_prehook(
                    lambda g: Variable._execution_engine.queue_callback(pass_ended)
                )

    def proj_input(module: nn.Module, args: tuple) -> None:
        if args[0].grad_fn is not None:
            args[0].grad_fn.register_prehook(read_grad)

    def after_step(*args: object) -> None:
        torch.isfinite(torch.cat([sample_of(p)[:SAMPLE] for p in params])).all().item()
        whole = params[turn[0] % len(params) :][: max(1, len(params) // ROTATION)]
        turn[0] += len(whole)
        all(math.isfinite(n) for n in torch.stack(torch._foreach_norm(whole)).tolist())

    for name, module in model.named_modules():
        module.register_forward_hook(output)
        if name.endswith(".proj") and reads >= 2:
            module.register_forward_pre_hook(proj_input)
    if reads >= 3:
        optimizer.register_step_post_hook(after_step)


class Guards:
    """The guard design issue 8 measured outside the project, with the least Python: the module
    hooks keep references to what each call got and returned; the model's output (one sum) and
    the observed loss are screened; before the step, one norm of each parameter gradient, judged
    as Python floats; after it, ``SAMPLE`` elements of each parameter against the last step's.
    ``grads``: each kept activation's gradient is held too, by a hook that only appends it,
    until the step (the issue's backward origin). Nothing is named or recorded: a floor."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, grads: bool):
        from tensordbg.engine.params import SAMPLE, sample_of

        self.model, self.grads, self.calls, self.held = model, grads, [], []
        self.params = list(model.parameters())
        self.views = [sample_of(p.detach())[:SAMPLE] for p in self.params]
        self.sample: torch.Tensor | None = None
        for module in model.modules():
            module.register_forward_pre_hook(lambda m, args: self.calls.append(args))
            module.register_forward_hook(self.output)
        optimizer.register_step_pre_hook(self.before_step)
        optimizer.register_step_post_hook(self.after_step)

    def output(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.calls.append(out)
        if module is not self.model:
            return
        self.bad = not math.isfinite(out.sum().item())
        if self.grads:
            keep = self.held.append
            for t in self.calls:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(keep)

    def observe(self, name: str, loss: torch.Tensor) -> None:
        self.bad = self.bad or not math.isfinite(loss.item())

    def before_step(self, *args: object) -> None:
        grads = [p.grad.reshape(-1) for p in self.params if p.grad is not None]
        norms = [math.sqrt(torch.dot(g, g).item()) for g in grads]
        self.hits = [i for i, n in enumerate(norms) if not math.isfinite(n) or n > 1e3]
        self.calls, self.held = [], []

    def after_step(self, *args: object) -> None:
        sample = torch.cat(self.views)
        if self.sample is not None:
            self.still = (sample == self.sample).tolist()
        self.sample = sample


def _switch_off(session: tensordbg.Session, capabilities: int) -> None:
    """Switch the capabilities after the first ``capabilities`` off, through the session's
    internals: a measurement of where the cost goes, not a way to run tensordbg."""
    if capabilities == 0:
        session.broken, session.active = True, False  # as after an internal error: every
        # hook returns at once
        return
    if capabilities < 3:  # no activation gradient is hooked, no parameter gradient read
        session.plan_gradients = lambda *args: []
        session.capture.grad_hooks.hook_node = lambda *args: None
        session.capture.grad_hooks.hook_leaf = lambda *args: None
        session._note_param_grads = lambda: set()
        session.note_pass_params = lambda: None
        session.grads_changed = lambda: False
    if capabilities < 4:  # no weight is read after the update
        session._check_parameters = lambda *args, **kwargs: None


def ranks_main(args: argparse.Namespace) -> int:
    """``--ranks N``: N processes (torch.multiprocessing, gloo on the CPU, one thread each) train
    the same model under DistributedDataParallel; each round runs one step of a bare DDP copy
    and one of an attached DDP copy, in turns. Rank 0 prints the medians, their ratio, and what
    one read of the job's store costs (each rank reads it once a step)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = args.model or "encoder-256"
    rounds = args.rounds or 20
    mp.spawn(_rank_worker, args=(args.ranks, port, name, rounds, args.warmup), nprocs=args.ranks)
    return 0


def _rank_worker(rank: int, world: int, port: int, name: str, rounds: int, warmup: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    vocab, seq, dim, layers, heads, batch = CONFIGS[name]
    torch.manual_seed(0)
    base = GPT(vocab, seq, dim, layers, heads)
    ddp = nn.parallel.DistributedDataParallel
    runners = [Runner("bare", ddp(base), "cpu", None),
               Runner("attached", ddp(copy.deepcopy(base)), "cpu", None)]  # fmt: skip
    session = runners[1].session = tensordbg.attach(
        runners[1].model, optimizer=runners[1].optimizer, on_hit="record", server=False
    )
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(4)]
    for i in range(warmup + rounds):
        for runner in runners if i % 2 else runners[::-1]:
            elapsed = runner.step(batches[i % len(batches)])
            if i >= warmup:
                runner.times.append(elapsed)
    reads = []
    for _ in range(200):
        start = time.perf_counter()
        session.ranks._read()
        reads.append(time.perf_counter() - start)
    if rank == 0:
        bare, attached = (statistics.median(r.times) for r in runners)
        ratios = sorted(a / b for a, b in zip(runners[1].times, runners[0].times, strict=True))
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        print(f"tensordbg overhead, {world} ranks of DDP (gloo, CPU, 1 thread each): {name}, "
              f"{rounds} rounds; machine: {machine()}")  # fmt: skip
        print(f"bare      {bare * 1e3:8.1f} ms")
        print(f"attached  {attached * 1e3:8.1f} ms  {statistics.median(ratios):.3f}x "
              f"(IQR {q1:.3f}-{q3:.3f})")  # fmt: skip
        read = statistics.median(reads) * 1e6
        print(f"one read of the job's store (once a step): {read:.0f} us, median of 200; "
              f"{len(session.hits)} hits; RankDivergence every 10 steps")  # fmt: skip
    session.detach()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
