"""The bundled demo: a small GPT that trains well until a batch breaks its attention.

``tensordbg demo`` runs this file's :func:`train` in a subprocess with tensordbg attached and opens
the terminal UI in the foreground. The bug is a classic one: a batch holds a sequence that is all
padding, the attention mask hides every key of that sequence's rows, the softmax over nothing
divides 0 by 0, and NaN spreads through the whole network. tensordbg pauses at the attention
module that produced it, not at the loss or the layers downstream.

In the UI, ``P`` profiles the next steps of the training (5 unless changed): the Profile tab
(``F8``, then ``F8`` again for each of its views) shows where the time and memory went and what
to change. From Python the same is ``session.profile(steps=5)``; from the shell, ``tensordbg run
--profile 5 train.py``.

Run it on its own with ``python -m tensordbg.demo --no-ui`` to see the hits as text.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time

import torch
from torch import nn
from torch.nn import functional as F

import tensordbg

VOCAB = 64
PAD = 0
SEQ = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        # The bug: padding keys are hidden, and a row of only padding hides every key.
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        weights = F.softmax(scores, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), keep)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != PAD
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, keep)
        return self.head(self.ln(x))


def batches(steps: int, bad_step: int, seed: int = 0):
    """Sequences that count upward from a random start (easy to learn), padded at the end;
    at ``bad_step`` one sequence is all padding."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        start = torch.randint(1, VOCAB, (16, 1), generator=g)
        tokens = (start + torch.arange(SEQ)) % (VOCAB - 1) + 1
        lengths = torch.randint(SEQ // 2, SEQ + 1, (16,), generator=g)
        tokens[torch.arange(SEQ) >= lengths[:, None]] = PAD
        if step == bad_step:
            tokens[3] = PAD
        yield tokens


def train(
    steps: int = 60,
    bad_step: int = 25,
    on_hit: str = "pause",
    server: bool = True,
    ends_with_ui: bool = False,
) -> tensordbg.Session:
    """Train the demo model with tensordbg attached; returns the session (detached).
    ``ends_with_ui``: an interrupt is `tensordbg demo`'s UI quitting (it stops the training
    rather than detach: its q would have said that the training goes on)."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    session = tensordbg.attach(model, optimizer=optimizer, on_hit=on_hit, server=server)
    bad_losses, step, interrupted = 0, 0, False
    try:
        for step, tokens in enumerate(batches(steps, bad_step)):
            logits = model(tokens[:, :-1])
            target = tokens[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD)
            session.observe("loss", loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.item()
            if step % 10 == 0:
                print(f"step {step:3d}  loss {value:.4f}", flush=True)
            bad_losses = 0 if math.isfinite(value) else bad_losses + 1
            if bad_losses == 3:  # what a careful training script does: stop a diverged run
                print(f"step {step:3d}  the loss has been NaN for 3 steps: stopping", flush=True)
                session.ended_by = "the demo stopped: its loss was NaN for 3 steps"  # the UI says
                break
            time.sleep(0.05)  # slow enough to watch in the UI
    except KeyboardInterrupt:  # Ctrl-C, or `tensordbg demo`'s UI quitting
        interrupted = True
    if interrupted:  # where the UI said it was: a pause between steps is at the next one
        step = session.step
    if interrupted and ends_with_ui:
        print(f"step {step:3d}  the UI quit: the demo's training stops here (q lets a training "
              "of yours go on, unwatched)", flush=True)  # fmt: skip
    elif interrupted:
        print(f"step {step:3d}  interrupted: the training stops here", flush=True)
    if threading.current_thread() is threading.main_thread():
        # The Ctrl-C that `tensordbg demo` sends when its UI quits stops the loop; one that
        # comes after the loop ended by itself (the loss went NaN) would interrupt the summary
        # or the interpreter's exit with a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    session.detach(finished=True)
    return session


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tensordbg.demo",
        description="The training behind `tensordbg demo`: a tiny GPT whose attention turns "
        "NaN when a batch holds a sequence of padding only. In the UI, P profiles the next "
        "steps and F8 shows the profile.",
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--bad-step", type=int, default=25)
    parser.add_argument("--no-ui", action="store_true", help="record hits and print them")
    parser.add_argument("--ends-with-ui", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    on_hit = "record" if args.no_ui else "pause"
    session = train(args.steps, args.bad_step, on_hit=on_hit, server=not args.no_ui,
                    ends_with_ui=args.ends_with_ui)  # fmt: skip
    tensordbg.engine.hits.print_summary(session, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
