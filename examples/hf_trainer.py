"""tensordbg in a Hugging Face ``Trainer``: one callback. Runs offline (a tiny GPT-2 built from a
config, random tokens) in a few seconds on a CPU.

    python examples/hf_trainer.py                   # a healthy run: no hits
    python examples/hf_trainer.py --fault 3         # a NaN appears in step 3: the training
                                                    # pauses; open the UI with `tensordbg tui`
    python examples/hf_trainer.py --fault 3 --record --accumulate 4
                                                    # no pause; the hits are printed at the end
    tensordbg run examples/hf_trainer.py --plain --fault 3
                                                    # no callback in the script: `tensordbg run`
                                                    # gives the Trainer one

The planted fault stands in for a numerical bug inside one layer: in the given optimizer step,
the output of the second block's first MLP layer (``transformer.h.1.mlp.c_fc``) holds a NaN.
tensordbg names that module and that step (a step is an optimizer step, however many
micro-batches it accumulates).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from tensordbg.integrations.hf import TensordbgCallback


def plant_nan(module: torch.nn.Module, step: int, accumulate: int) -> None:
    """The fault: ``module``'s output holds a NaN in the first forward of optimizer ``step``."""
    calls = [0]

    def hook(mod: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not mod.training:
            return None
        calls[0] += 1
        if calls[0] - 1 != step * accumulate:
            return None
        output = output.clone()
        output[0, 0, 0] = float("nan")
        return output

    module.register_forward_hook(hook)


def main(fault: int | None = None, record: bool = False, accumulate: int = 1, steps: int = 6,
         plain: bool = False) -> TensordbgCallback | None:  # fmt: skip
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    if fault is not None:
        plant_nan(model.transformer.h[1].mlp.c_fc, fault, accumulate)
    tokens = torch.randint(0, 64, (64, 16))
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_trainer_"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate,
        max_steps=steps,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
    )
    # The one line: the callback attaches at train begin to the Trainer's model, optimizer and
    # GradScaler, watches every step, and detaches at train end (its hits stay readable).
    callback = None if plain else TensordbgCallback(on_hit="record" if record else "pause")
    Trainer(model=model, args=args, train_dataset=data,
            callbacks=[] if callback is None else [callback]).train()  # fmt: skip
    return callback


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", type=int, help="the optimizer step where a NaN appears")
    parser.add_argument("--record", action="store_true", help="record hits instead of pausing")
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--plain", action="store_true", help="no callback (for tensordbg run)")
    options = parser.parse_args()
    main(options.fault, options.record, options.accumulate, options.steps, options.plain)
