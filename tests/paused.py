"""A real training, run in a background thread, that pauses at a planted NaN: the scene the live
source, the server and the UI are tested on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import nn

import tensordbg


class Planted(nn.Module):
    """A small network whose ``mid`` layer turns NaN at ``bad_step``."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32).to(dtype)
        self.act = nn.GELU()
        self.mid = nn.Linear(32, 32).to(dtype)
        self.out = nn.Linear(32, 4).to(dtype)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inp(x))
        h = self.mid(h)  # the line provenance must point at
        if self.poison:
            h = h / torch.zeros_like(h[:1])  # the root's own code makes 0/0 here... and inf
        return self.out(h)


class PausedTraining:
    """Runs ``steps`` training steps in a thread with ``on_hit="pause"``; step ``bad_step``
    divides by zero in the model's forward. Use as a context manager; ``wait_paused()`` blocks
    until the training is paused. ``before_step(step)``, if given, is called on the training
    thread before each step: a test holds the training mid-run with it."""

    def __init__(self, steps: int = 6, bad_step: int = 3, dtype: torch.dtype = torch.float32,
                 server: bool = False, before_step: Callable[[int], None] | None = None,
                 **attach_args):  # fmt: skip
        self.model = Planted(dtype)
        self.dtype = dtype
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.steps, self.bad_step = steps, bad_step
        self.before_step = before_step
        self.session: tensordbg.Session | None = None
        self.attach_args = {"on_hit": "pause", "server": server, **attach_args}
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.attached = threading.Event()
        self.thread = threading.Thread(target=self._train, daemon=True)

    def _train(self) -> None:
        try:
            self.session = tensordbg.attach(self.model, optimizer=self.optimizer,
                                            **self.attach_args)  # fmt: skip
            self.attached.set()
            g = torch.Generator().manual_seed(1)
            for step in range(self.steps):
                if self.before_step is not None:
                    self.before_step(step)
                self.model.poison = step == self.bad_step
                x = torch.randn(16, 8, generator=g).to(self.dtype)
                loss = self.model(x).float().pow(2).mean()
                self.session.observe("loss", loss)
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.attached.set()
            self.finished.set()

    def __enter__(self) -> PausedTraining:
        self.thread.start()
        self.attached.wait(30)
        return self

    def wait(self, condition: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("the training did not get there in time")
            if self.error is not None:
                raise self.error
            time.sleep(0.005)

    def wait_paused(self, timeout: float = 30.0) -> None:
        self.wait(lambda: self.session is not None and self.session.controller.state == "paused",
                  timeout)  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        if self.session is not None:
            self.session.controller.detach()
        self.finished.wait(60)
        if self.session is not None:
            self.session.detach()
