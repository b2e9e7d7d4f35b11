"""tensordbg in the trainers people use: the Hugging Face ``Trainer`` and Lightning's.

Each test trains a tiny model built here (nothing downloads) for a few optimizer steps. A fault
is planted at a known module and a known optimizer step (a forward hook of the test's own that
writes a NaN, or a poisoned batch); the callback must name both, count micro-batches of one
optimizer step as one step, stay quiet on a healthy run and keep its hits after training.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import zygote
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="the 'hf' extra is not installed: pip install -e '.[hf]'"
)
pytest.importorskip("accelerate", reason="the 'hf' extra is not installed: pip install -e '.[hf]'")
pl = pytest.importorskip(
    "pytorch_lightning",
    reason="the 'lightning' extra is not installed: pip install -e '.[lightning]'",
)

from tensordbg.integrations import hf, lightning  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUIET = {"server": False, "summary_at_exit": False}


def nan_at_call(module: nn.Module, call: int) -> None:
    """Make ``module``'s output hold a NaN in its ``call``-th training forward (from 0); with
    ``a`` micro-batches a step, call ``s * a + j`` is micro-batch ``j`` of optimizer step ``s``."""
    calls = [0]

    def poison(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not mod.training:
            return None
        calls[0] += 1
        if calls[0] - 1 != call:
            return None
        output = output.clone()
        output.view(-1)[0] = float("nan")
        return output

    module.register_forward_hook(poison)


def first_origin(session):
    return next(h for h in session.hits if h.origin)


# --- Hugging Face Trainer --------------------------------------------------------------------


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def hf_train(model, callback, tmp_path, steps=5, accumulate=1, logged=None, **args):
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 64, (64, 16), generator=g)]  # fmt: skip
    training_args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=steps,
        gradient_accumulation_steps=accumulate, learning_rate=1e-3, report_to=[],
        logging_steps=1, use_cpu=True, disable_tqdm=True, **{"save_strategy": "no", **args},
    )  # fmt: skip
    callbacks = [callback]
    if logged is not None:

        class Logged(transformers.TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    logged.append(logs["loss"])

        callbacks.append(Logged())
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=data, callbacks=callbacks
    )
    return trainer


def test_hf_trainer_names_the_module_and_the_optimizer_step_of_a_planted_nan(tmp_path):
    model = tiny_gpt2()
    nan_at_call(model.transformer.h[1].mlp.c_fc, call=3)
    callback = hf.TensordbgCallback(on_hit="record", **QUIET)
    hf_train(model, callback, tmp_path, steps=4).train()

    hit = first_origin(callback.session)
    assert (hit.rule, hit.module, hit.kind, hit.step) == (
        "NaN", "transformer.h.1.mlp.c_fc", "output", 3,
    )  # fmt: skip
    assert "passed on" not in hit.message


def test_hf_trainer_counts_an_optimizer_step_of_four_micro_batches_as_one_step(tmp_path):
    model = tiny_gpt2()
    nan_at_call(model.transformer.h[0].attn.c_proj, call=2 * 4 + 2)  # micro-batch 2 of step 2
    callback = hf.TensordbgCallback(on_hit="record", **QUIET)
    hf_train(model, callback, tmp_path, steps=3, accumulate=4).train()

    session = callback.session
    hit = first_origin(session)
    assert (hit.module, hit.step, hit.phase) == ("transformer.h.0.attn.c_proj", 2, "forward")
    assert session.step == 3  # three optimizer steps, twelve forwards


def test_hf_trainer_resumed_from_a_checkpoint_numbers_its_hits_as_the_trainer_does(tmp_path):
    """Resumed at global_step 3, the session counted from 0: a NaN planted at step 5 was said
    to be at step 2."""
    model = tiny_gpt2()
    hf_train(model, hf.TensordbgCallback(on_hit="record", **QUIET), tmp_path, steps=3,
             save_strategy="steps", save_steps=3).train()  # fmt: skip
    model = tiny_gpt2()
    nan_at_call(model.transformer.h[1].mlp.c_fc, call=2)  # the third step after resuming: 5
    callback = hf.TensordbgCallback(on_hit="record", **QUIET)
    trainer = hf_train(model, callback, tmp_path, steps=6)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    hit = first_origin(callback.session)
    assert (hit.module, hit.step) == ("transformer.h.1.mlp.c_fc", 5)
    assert callback.session.step == trainer.state.global_step == 6


def test_hf_trainer_healthy_run_has_no_hits_and_its_session_stays_readable(tmp_path):
    model = tiny_gpt2()
    callback = hf.TensordbgCallback(**QUIET)  # pause on a hit: a false alarm would hang here
    logged: list[float] = []
    hf_train(model, callback, tmp_path, logged=logged).train()

    session = callback.session
    assert session.detached and session.hits == []
    assert session.step == 5
    # The loss the model returned is observed: the loss curve is the Trainer's own loss.
    losses = [loss for _, loss, _, _ in session.history]
    assert losses == pytest.approx(logged, rel=1e-3)
    assert not model._forward_hooks  # detached at train end: nothing of tensordbg is left


def test_hf_trainer_bf16_autocast_on_cpu_finds_the_fault(tmp_path):
    model = tiny_gpt2()
    nan_at_call(model.transformer.h[1].mlp.c_proj, call=2)
    callback = hf.TensordbgCallback(on_hit="record", **QUIET)
    hf_train(model, callback, tmp_path, steps=3, bf16=True).train()

    hit = first_origin(callback.session)
    assert (hit.module, hit.step) == ("transformer.h.1.mlp.c_proj", 2)


def test_hf_trainer_gradscaler_skip_of_a_fused_adamw_is_a_skipped_step_not_a_hit(tmp_path):
    """fp16 on a GPU: accelerate steps the Trainer's default optimizer (a fused AdamW, which
    skips an overflowing update inside its kernel) through a GradScaler. On CPU the same
    wiring, with the scaler given to the accelerator by hand."""
    model = tiny_gpt2()
    inf_grad_at_call(model.transformer.h[1].mlp.c_fc, call=2)
    callback = hf.TensordbgCallback(on_hit="record", **QUIET)
    trainer = hf_train(model, callback, tmp_path, steps=4)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.train()

    session = callback.session
    assert trainer.optimizer.optimizer.defaults.get("fused")
    assert session.skipped_steps == [2]
    assert session.hits == []  # one skipped step is how mixed precision works
    assert session.step == 4


def inf_grad_at_call(module: nn.Module, call: int) -> None:
    """Make the gradient of ``module``'s output infinite in its ``call``-th training forward."""
    calls = [0]

    def poison(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if mod.training:
            calls[0] += 1
            if calls[0] - 1 == call:
                output.register_hook(lambda grad: grad * float("inf"))

    module.register_forward_hook(poison)


def test_callbacks_refuse_what_the_trainer_gives_and_unknown_arguments_with_a_sentence():
    with pytest.raises(TypeError, match="takes the optimizer from the trainer"):
        hf.TensordbgCallback(optimizer=object())
    with pytest.raises(TypeError, match="unknown argument 'on_hits'"):
        lightning.TensordbgCallback(on_hits="record")
    with pytest.raises(ValueError, match="on_hit is one of"):
        hf.TensordbgCallback(on_hit="stop")


# --- Lightning -------------------------------------------------------------------------------


class Standardize(nn.Module):
    """Scales each sample to zero mean and unit deviation: a constant sample divides 0 by 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(Standardize(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def regression_data(poisoned_batch: int | None = None, batch_size: int = 8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True)
    if poisoned_batch is not None:
        x[poisoned_batch * batch_size + 3] = 0.5  # a sensor stuck at one value
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def pl_fit(module, callback, loader, steps=5, accumulate=1, **args):
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=steps, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[callback], **args,
    )  # fmt: skip
    trainer.fit(module, loader)
    return trainer


def test_lightning_names_the_module_and_the_optimizer_step_of_a_poisoned_batch():
    torch.manual_seed(0)
    module = Regression()
    callback = lightning.TensordbgCallback(on_hit="record", **QUIET)
    pl_fit(module, callback, regression_data(poisoned_batch=3))

    hit = first_origin(callback.session)
    assert (hit.rule, hit.module, hit.kind, hit.step) == ("NaN", "net.0", "output", 3)


def test_lightning_counts_an_optimizer_step_of_four_micro_batches_as_one_step():
    torch.manual_seed(0)
    module = Regression()
    callback = lightning.TensordbgCallback(on_hit="record", **QUIET)
    trainer = pl_fit(module, callback, regression_data(poisoned_batch=2 * 4 + 1), steps=4,
                     accumulate=4)  # fmt: skip

    session = callback.session
    hit = first_origin(session)
    assert (hit.module, hit.step) == ("net.0", 2)
    assert session.step == trainer.global_step == 4


def test_a_lightning_training_resumed_from_a_checkpoint_numbers_its_hits_as_the_trainer_does(
    tmp_path,
):
    """Resumed at global_step 5, the session counted from 0: a NaN at step 7 was said to be at
    step 2."""
    torch.manual_seed(0)
    module = Regression()
    trainer = pl_fit(module, lightning.TensordbgCallback(on_hit="record", **QUIET),
                     regression_data(), steps=5)  # fmt: skip
    trainer.save_checkpoint(tmp_path / "five.ckpt")
    module = Regression()
    nan_at_call(module.net[1], call=2)  # the third step after resuming: step 7
    callback = lightning.TensordbgCallback(on_hit="record", **QUIET)
    resumed = pl.Trainer(
        max_steps=9, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    resumed.fit(module, regression_data(), ckpt_path=tmp_path / "five.ckpt")
    hit = first_origin(callback.session)
    assert (hit.module, hit.step) == ("net.1", 7)
    assert callback.session.step == resumed.global_step == 9


def test_a_nan_made_by_lightning_loss_code_names_no_line_of_lightnings():
    """The loss is observed from Lightning's on_before_backward: "It was observed at call.py:228",
    a line of Lightning's hook dispatcher, was said of a NaN made in training_step."""

    class LogLoss(Regression):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            return torch.log(self.net[1:](x) - 100).mean()  # log of negatives: NaN

    torch.manual_seed(0)
    callback = lightning.TensordbgCallback(on_hit="record", **QUIET)
    pl_fit(LogLoss(), callback, regression_data(), steps=1)
    hit = first_origin(callback.session)
    assert hit.tensor == "loss" and "It was observed at" not in hit.message


def test_lightning_healthy_run_has_no_hits_and_observes_the_loss_it_trained_on():
    torch.manual_seed(0)
    module = Regression()
    callback = lightning.TensordbgCallback(**QUIET)  # pause on a hit: a false alarm would hang
    pl_fit(module, callback, regression_data(), steps=3, accumulate=2)

    session = callback.session
    assert session.detached and session.hits == [] and session.step == 3
    # Lightning divides the loss by the accumulation; the curve shows the training step's own.
    losses = [loss for _, loss, _, _ in session.history]
    steps = [module.losses[i : i + 2] for i in range(0, 6, 2)]
    assert losses == pytest.approx([sum(s) / 2 for s in steps], rel=1e-5)


def test_lightning_skip_drops_the_update_of_the_step_whose_closure_made_the_nan():
    """Lightning runs forward and backward inside ``optimizer.step(closure)``: the update is
    skipped only if tensordbg waits for the closure (gradients final) before deciding."""
    torch.manual_seed(0)
    module = Regression()
    callback = lightning.TensordbgCallback(on_hit="skip", **QUIET)
    pl_fit(module, callback, regression_data(poisoned_batch=2), steps=5)

    assert callback.session.skipped_updates == [2]
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_lightning_gradscaler_skip_is_a_skipped_step_not_a_hit():
    torch.manual_seed(0)
    module = Regression()
    inf_grad_at_call(module.net[1], call=2)
    callback = lightning.TensordbgCallback(on_hit="record", **QUIET)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    plugin = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)
    pl_fit(module, callback, regression_data(), steps=4, plugins=[plugin])

    session = callback.session
    assert session.skipped_steps == [2]
    assert session.hits == []


def test_lightning_bf16_autocast_on_cpu_finds_the_poisoned_batch():
    torch.manual_seed(0)
    module = Regression()
    callback = lightning.TensordbgCallback(on_hit="record", **QUIET)
    pl_fit(module, callback, regression_data(poisoned_batch=1), steps=3, precision="bf16-mixed")

    hit = first_origin(callback.session)
    assert (hit.module, hit.step) == ("net.0", 1)


# --- what the trainers need of the engine ----------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Standardize(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def test_a_step_given_a_closure_judges_the_gradients_after_the_closure_ran():
    """``optimizer.step(closure)`` runs forward and backward inside the step (Lightning,
    LBFGS): skipping a step that hit must wait for the closure's gradients."""
    import tensordbg

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = tensordbg.attach(model, optimizer=optimizer, on_hit="skip", **QUIET)
    x = torch.randn(8, 8)
    for step in range(4):
        batch = x.clone()
        if step == 2:
            batch[3] = 0.5  # a constant sample: Standardize divides 0 by 0

        def closure(batch=batch):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(batch), batch.sum(1, keepdim=True))
            loss.backward()
            return loss

        optimizer.step(closure)
    session.detach()
    assert session.skipped_updates == [2]
    assert first_origin(session).module == "0"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fused_adamw_that_learns_is_not_taken_for_weights_that_do_not_change():
    """A fused AdamW (the Hugging Face Trainer's default) writes the weights without bumping
    their version counter."""
    import tensordbg

    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    session = tensordbg.attach(model, optimizer=optimizer, on_hit="record", **QUIET)
    x = torch.randn(32, 8)
    for _ in range(6):
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
        optimizer.zero_grad()
    session.detach()
    assert session.hits == []


# --- import cost and tensordbg run -----------------------------------------------------------


def test_importing_tensordbg_imports_neither_framework():
    code = (
        "import sys, tensordbg, tensordbg.integrations.runner; "
        "print(sorted(m for m in ('transformers', 'pytorch_lightning', 'lightning', "
        "'accelerate') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


HF_SCRIPT = """
    import torch, transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    calls = [0]

    def poison(module, args, output):  # the planted fault: a NaN in step 2's forward
        calls[0] += 1
        if calls[0] == 3:
            output = output.clone()
            output[0, 0, 0] = float("nan")
            return output

    model.transformer.h[1].mlp.c_fc.register_forward_hook(poison)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16))]
    args = transformers.TrainingArguments(
        output_dir=OUT, per_device_train_batch_size=2, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, max_steps=3)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    print("trained")
"""

LIGHTNING_SCRIPT = """
    import torch
    import pytorch_lightning as pl
    from torch import nn

    class Standardize(nn.Module):
        def forward(self, x):
            return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(Standardize(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x = torch.randn(64, 8)
    x[2 * 8 + 5] = 1.0  # the poisoned batch: optimizer step 2
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                         batch_size=8)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), loader)
    print("trained")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "where"),
    [
        (HF_SCRIPT, "step 2 forward: [NaN] transformer.h.1.mlp.c_fc.output"),
        (LIGHTNING_SCRIPT, "step 2 forward: [NaN] net.0.output"),
    ],
    ids=["hf", "lightning"],
)
def test_tensordbg_run_watches_a_framework_script_without_changing_it(tmp_path, script, where):
    path = tmp_path / "train.py"
    path.write_text(f"OUT = {str(tmp_path / 'out')!r}\n" + textwrap.dedent(script))
    done = zygote.run([sys.executable, "-m", "tensordbg.cli", "run", "--on-hit", "record",
                       str(path)], timeout=300, cwd=tmp_path)  # fmt: skip
    assert "trained" in done.stdout, done.stderr[-3000:]
    assert "through its trainer" in done.stderr
    assert where in done.stderr, done.stderr[-3000:]
    assert done.returncode == 1  # the script exited 0, but something hit (as a linter)


@pytest.mark.slow
@pytest.mark.parametrize("script", [HF_SCRIPT, LIGHTNING_SCRIPT], ids=["hf", "lightning"])
def test_tensordbg_run_profiles_a_framework_script(tmp_path, script):
    """Under a trainer the session is the callback's: --profile started none ("no model was
    found, nothing was profiled")."""
    path = tmp_path / "train.py"
    path.write_text(f"OUT = {str(tmp_path / 'out')!r}\n" + textwrap.dedent(script))
    done = zygote.run([sys.executable, "-m", "tensordbg.cli", "run", "--on-hit", "record",
                       "--profile", "2", str(path)], timeout=300, cwd=tmp_path)  # fmt: skip
    assert "trained" in done.stdout, done.stderr[-3000:]
    assert "tensordbg profile: 2 steps" in done.stderr, done.stderr[-3000:]
    assert "nothing was profiled" not in done.stderr


@pytest.mark.slow
def test_an_uncaught_hit_in_lightning_shows_the_users_frames_then_the_summary(tmp_path):
    """Lightning tears down (the callback detaches) before the hit reaches the top: the
    traceback still leaves tensordbg's and PyTorch's frames out, and the summary comes after."""
    script = LIGHTNING_SCRIPT.replace(
        "enable_model_summary=False)",
        "enable_model_summary=False, callbacks=[TensordbgCallback(on_hit='raise')])",
    ).replace(
        "import torch\n",
        "import torch\n    from tensordbg.integrations.lightning import TensordbgCallback\n",
        1,
    )
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    done = zygote.run([sys.executable, str(path)], timeout=300, cwd=tmp_path)
    err = done.stderr
    assert done.returncode == 1 and "trained" not in done.stdout, err[-3000:]
    start = err.index(
        "Traceback (most recent call last; tensordbg's and PyTorch's frames left out)"
    )
    assert f'File "{path}"' in err[start:]
    assert "tensordbg/engine" not in err and "torch/nn/modules" not in err
    assert err.index("tensordbg.hit.WatchpointHit: net.0.output holds") < err.index(
        "tensordbg: 1 hit, at its origin"
    )


DDP_SCRIPT = """
    import json, sys
    import torch
    import pytorch_lightning as pl
    from torch import nn
    from tensordbg.integrations.lightning import TensordbgCallback

    class Standardize(nn.Module):
        def forward(self, x):
            return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(Standardize(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.global_rank == 1 and self.global_step == 2:  # rank 1's batch is poisoned
                x = x.clone()
                x[3] = 0.5
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    if __name__ == "__main__":
        torch.manual_seed(0)
        x = torch.randn(128, 8)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
        callback = TensordbgCallback(on_hit="record", server=False, summary_at_exit=False)
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=2, strategy="ddp",
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[callback])
        trainer.fit(Regression(), loader)
        session = callback.session
        hits = [[h.step, h.module, h.kind, h.origin] for h in session.hits]
        with open(f"{OUT}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"rank": session.rank, "steps": session.step, "hits": hits}, f)
"""


def ranks_said(stderr: str) -> str:
    """What a failed two-rank job said, DDP's warning of every step left out: the last 3,000
    characters were that warning, not what the rank that failed was doing (a rank 1 that
    aborted once under load, "terminate called without an active exception", said no more)."""
    lines = [line for line in stderr.splitlines() if "find_unused_parameters" not in line]
    return "\n".join(lines)[-12000:]


@pytest.mark.slow
def test_lightning_ddp_two_processes_each_rank_has_its_session_and_rank_1_names_its_batch(
    tmp_path,
):
    """Lightning's own DDP launcher (2 CPU processes, gloo) re-runs the script for rank 1 and
    sets no ``RANK``: the callback takes the rank from the trainer."""
    import json

    path = tmp_path / "train_ddp.py"
    path.write_text(f"OUT = {str(tmp_path)!r}\n" + textwrap.dedent(DDP_SCRIPT))
    done = zygote.run([sys.executable, str(path)], timeout=300, cwd=tmp_path)
    assert done.returncode == 0, ranks_said(done.stderr)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["steps"] for r in ranks] == [3, 3]
    origin = next(h for h in ranks[1]["hits"] if h[3])
    assert origin == [2, "net.0", "output", True]
    # Rank 0's own forward made nothing; the NaN reached it through DDP's gradient all-reduce.
    assert not [h for h in ranks[0]["hits"] if h[2] == "output"]


HF_TORCHRUN_SCRIPT = """
    import json, os, sys
    import torch
    import transformers
    from tensordbg.integrations.hf import TensordbgCallback

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    calls = [0]

    def poison(module, args, output):  # rank 1's third training forward of h.1.mlp.c_fc
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            output = output.clone()
            output.view(-1)[0] = float("nan")
            return output

    model.transformer.h[1].mlp.c_fc.register_forward_hook(poison)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (32, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=OUT, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3,
        report_to=[], save_strategy="no", use_cpu=True, ddp_backend="gloo", disable_tqdm=True)
    callback = TensordbgCallback(on_hit="record", server=False, summary_at_exit=False)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    session = callback.session
    hits = [[h.step, h.module, h.kind, h.origin] for h in session.hits]
    with open(f"{OUT}/rank{rank}.json", "w") as f:
        json.dump({"rank": session.rank, "run_id": session.run_id, "steps": session.step,
                   "hits": hits, "detached": session.detached}, f)
    # As tests/ranks_job.py: the interpreter's teardown under gloo's threads has aborted a
    # rank after its work was done and written; the job ends here.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
"""


@pytest.mark.slow
def test_hf_trainer_under_torchrun_has_a_session_per_rank_and_rank_1_names_its_module(tmp_path):
    """The Trainer launched by ``torchrun --nproc-per-node 2`` (gloo, CPU): one session per
    rank of one job; rank 1's planted NaN is its hit at the module and step; rank 0 only
    receives it through DDP's gradient all-reduce."""
    import json
    import os

    path = tmp_path / "train_hf.py"
    path.write_text(f"OUT = {str(tmp_path)!r}\n" + textwrap.dedent(HF_TORCHRUN_SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(path)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, ranks_said(done.stderr)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["run_id"] == ranks[1]["run_id"]
    assert [r["steps"] for r in ranks] == [4, 4] and all(r["detached"] for r in ranks)
    origin = next(h for h in ranks[1]["hits"] if h[3])
    assert origin == [2, "transformer.h.1.mlp.c_fc", "output", True]
    # Rank 0's own forward of step 2 was clean; what it received later is passed on.
    assert not [h for h in ranks[0]["hits"] if h[0] <= 2 and h[2] == "output"]
    assert ranks[0]["hits"] and not [h for h in ranks[0]["hits"] if h[3]], ranks[0]["hits"][:3]


def test_a_trainer_callback_s_summary_says_its_rank_in_a_job_of_several(capsys):
    """Each rank of a job prints its summary, interleaved: a plain attach's says "tensordbg
    (rank 1):", the trainer callbacks' said "tensordbg:" (found by a new user's trial)."""
    from types import SimpleNamespace

    from tensordbg.integrations.frameworks import TrainingWatch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = TrainingWatch({"on_hit": "record", "server": False})
    session = watch.begin(model, [optimizer], scaler=None, rank=1)
    model(torch.full((2, 4), float("nan"))).sum().backward()
    session.ranks = SimpleNamespace(at_safe_point=False)  # as a job of several ranks (api.py)
    watch.end()
    assert capsys.readouterr().err.startswith("tensordbg (rank 1): ")
