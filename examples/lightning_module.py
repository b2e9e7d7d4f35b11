"""tensordbg in a Lightning training: one callback. Runs offline (a small regression on random
data) in a second or two on a CPU.

    python examples/lightning_module.py               # a healthy run: no hits
    python examples/lightning_module.py --fault 3     # a poisoned batch in step 3: the training
                                                      # pauses; open the UI with `tensordbg tui`
    python examples/lightning_module.py --fault 3 --record --accumulate 4
                                                      # no pause; the hits are printed at the end
    tensordbg run examples/lightning_module.py --plain --fault 3
                                                      # no callback in the script: `tensordbg
                                                      # run` gives the Trainer one

The planted fault is a poisoned batch: one sample whose features are all the same value (a
sensor stuck). The model standardizes each sample, so that sample divides 0 by 0. tensordbg
names the module that made the NaN (``net.0``, the standardization, not the layers that passed
it on) and the optimizer step of the batch.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from tensordbg.integrations.lightning import TensordbgCallback

BATCH = 8


class Standardize(nn.Module):
    """Each sample to zero mean and unit deviation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(Standardize(), nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data(fault: int | None, accumulate: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = (x[:, :4] - x[:, 4:]).sum(1, keepdim=True)
    if fault is not None:
        x[fault * accumulate * BATCH + 5] = 0.5  # the first batch of optimizer step `fault`
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def main(fault: int | None = None, record: bool = False, accumulate: int = 1, steps: int = 12,
         plain: bool = False) -> TensordbgCallback | None:  # fmt: skip
    torch.manual_seed(0)
    # The one line: the callback attaches at train start to the module, the trainer's
    # optimizers and its GradScaler, and detaches at train end (its hits stay readable).
    callback = None if plain else TensordbgCallback(on_hit="record" if record else "pause")
    trainer = pl.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[] if callback is None else [callback],
    )
    trainer.fit(Regression(), data(fault, accumulate))
    return callback


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", type=int, help="the optimizer step of the poisoned batch")
    parser.add_argument("--record", action="store_true", help="record hits instead of pausing")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--plain", action="store_true", help="no callback (for tensordbg run)")
    options = parser.parse_args()
    main(options.fault, options.record, options.accumulate, options.steps, options.plain)
