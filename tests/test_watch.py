"""`ampscope.watch` and the training frameworks' callbacks: optimizer step N of a real loop is
traced, files are written, and nothing of ampscope stays installed afterwards."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

import ampscope
from ampscope.models import gpt2
from ampscope.torchcompat import dispatch


def installed_hooks(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple:
    """Every hook dict torch keeps, globally and on the model and the optimizer."""
    return (
        dict(nn_module._global_forward_hooks), dict(nn_module._global_forward_pre_hooks),
        dict(nn_module._global_forward_hooks_with_kwargs),
        dict(nn_module._global_forward_hooks_always_called),
        dict(nn_module._global_backward_hooks), dict(nn_module._global_backward_pre_hooks),
        dict(optim_module._global_optimizer_pre_hooks),
        dict(optim_module._global_optimizer_post_hooks),
        dispatch.function_stack_depth(), dispatch.dispatch_stack_depth(),
        {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
             dict(m._backward_pre_hooks), "forward" in m.__dict__)
         for n, m in model.named_modules()},
        None if optimizer is None else (dict(optimizer._optimizer_step_pre_hooks),
                                        dict(optimizer._optimizer_step_post_hooks)),
    )


def model_and_optimizer():
    torch.manual_seed(0)
    model = gpt2.load("gpt2-tiny").module
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 256, (2, 9), generator=g)
    _, loss = model(ids[:, :-1], ids[:, 1:].contiguous())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def direct_capture(step: int) -> ampscope.Trace:
    """Step `step` of the same loop, recorded by `ampscope.capture` around that step alone."""
    model, optimizer = model_and_optimizer()
    for i in range(1, step):
        train_step(model, optimizer, i)
    with ampscope.capture(model) as t:
        train_step(model, optimizer, step)
    return t


def ops(trace: ampscope.Trace) -> list[tuple[str, str]]:
    return [(o.op, o.phase) for o in trace.ops]


def test_watch_traces_step_n_of_a_hand_written_loop_and_leaves_nothing(tmp_path):
    model, optimizer = model_and_optimizer()
    before = installed_hooks(model, optimizer)
    w = ampscope.watch(model, optimizer, out=tmp_path / "run")
    for i in range(1, 4):
        train_step(model, optimizer, i)
        if i == 1:
            assert w.trace is None and w.steps == 1
    assert installed_hooks(model, optimizer) == before
    t = w.trace
    # the 2nd step, op for op, as a capture around that step alone records it, and not the 1st
    # (where AdamW makes its state lazily: 3 zeros_like-made tensors per parameter)
    assert ops(t) == ops(direct_capture(2))
    assert ops(t) != ops(direct_capture(1))
    assert {s.key for s in t.optimizer_state} == {"step", "exp_avg", "exp_avg_sq"}
    assert len(t.optimizer_state) == 3 * len(list(model.parameters()))
    assert [(o.name, o.dtype) for o in t.inputs] == [("idx", "int64"), ("targets", "int64")]
    # the files, next to the run's outputs
    assert w.files == [tmp_path / "run" / "ampscope-step2.json",
                       tmp_path / "run" / "ampscope-step2.html"]
    back = ampscope.Trace.from_dict(json.loads(w.files[0].read_text()))
    assert ops(back) == ops(t)
    assert w.files[1].read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "ampscope-step2.html", "ampscope-step2.json"]  # no temporary file left


def test_watch_without_an_optimizer_given_and_step_1():
    model, optimizer = model_and_optimizer()
    before = installed_hooks(model, optimizer)
    w = ampscope.watch(model, step=1)
    for i in range(1, 3):
        train_step(model, optimizer, i)
    assert installed_hooks(model, optimizer) == before
    assert ops(w.trace) == ops(direct_capture(1))


def test_a_hook_of_the_users_registered_after_watch_keeps_running():
    """watch's step hook cannot remove itself while torch iterates the hooks when another hook
    follows it: it goes inert, and is removed at the model's next call."""
    model, optimizer = model_and_optimizer()
    before = installed_hooks(model, optimizer)
    w = ampscope.watch(model, optimizer, step=2)
    calls = []
    handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(1))
    for i in range(1, 4):
        train_step(model, optimizer, i)
    assert len(calls) == 3 and ops(w.trace) == ops(direct_capture(2))
    handle.remove()
    assert installed_hooks(model, optimizer) == before


def test_a_loop_that_raises_in_step_n_is_cleaned_up_by_the_with_block():
    model, optimizer = model_and_optimizer()
    before = installed_hooks(model, optimizer)
    with pytest.raises(RuntimeError, match="user's error"), \
            ampscope.watch(model, optimizer, step=2) as w:
        train_step(model, optimizer, 1)
        raise RuntimeError("user's error")
    assert w.trace is None
    assert installed_hooks(model, optimizer) == before


@pytest.mark.fast
def test_watch_refuses_bad_arguments_at_once(tmp_path):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ampscope.AmpscopeError, match="step must be a positive integer"):
        ampscope.watch(model, optimizer, step=0)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ampscope.AmpscopeError, match="out must be a folder"):
        ampscope.watch(model, optimizer, out=tmp_path / "f")
    with pytest.raises(ampscope.AmpscopeError, match="needs a torch.optim.Optimizer"):
        ampscope.watch(model, "adamw")
    assert installed_hooks(model, optimizer) == installed_hooks(*model_and_optimizer())


# -- Hugging Face Trainer -----------------------------------------------------------------

def hf_run(tmp_path, callback, *, name: str = "out", data_collator=None):
    """A tiny GPT-2 trained for 3 optimizer steps by the Trainer, on the CPU."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (6, 8), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=data_collator, callbacks=[callback])
    return trainer, model


def test_hf_callback_traces_step_2_of_a_trainer_run_into_its_output_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ampscope.integrations.hf import AmpscopeCallback

    callback = AmpscopeCallback()
    trainer, model = hf_run(tmp_path, callback)
    before = installed_hooks(model, None)
    trainer.train()
    assert installed_hooks(model, None) == before
    assert not any(o._optimizer_step_post_hooks for o in (trainer.optimizer.optimizer,))

    class Direct(transformers.TrainerCallback):
        """ampscope.capture from the end of step 1's optimizer.step() to that of step 2's."""

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0:
                self.recorder = ampscope.capture(model)
                self.trace = self.recorder.__enter__()
            elif state.global_step == 1:
                self.recorder.__exit__(None, None, None)

    direct = Direct()
    other, _ = hf_run(tmp_path, direct, name="direct")
    other.train()
    t = callback.trace
    assert ops(t) == ops(direct.trace)
    assert {s.key for s in t.optimizer_state} == {"step", "exp_avg", "exp_avg_sq"}
    out = tmp_path / "out"
    assert ampscope.Trace.from_dict(json.loads((out / "ampscope-step2.json").read_text())).ops
    assert (out / "ampscope-step2.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.fast
def test_hf_callback_leaves_nothing_installed_when_step_n_raises(tmp_path):
    """A Trainer callback is not told of an exception: train() is wrapped so that the recorders
    come off however it ends."""
    pytest.importorskip("transformers")
    from transformers import default_data_collator

    from ampscope.integrations.hf import AmpscopeCallback

    callback = AmpscopeCallback()
    seen: dict[str, tuple] = {}

    def collator(rows):
        # The first batch loaded once step 1's optimizer.step() has returned: step 2's, or the
        # one after it (a batch may be fetched ahead), while the recorders are installed.
        if callback.watch is not None and callback.watch.steps == 1:
            seen["while tracing"] = installed_hooks(model, None)
            raise RuntimeError("the user's broken batch")
        return default_data_collator(rows)

    trainer, model = hf_run(tmp_path, callback, data_collator=collator)
    before = installed_hooks(model, None)
    with pytest.raises(RuntimeError, match="the user's broken batch"):
        trainer.train()
    assert seen["while tracing"] != before  # the capture was on when it raised
    assert installed_hooks(model, None) == before  # and is off now: hooks, both mode stacks
    assert (dispatch.function_stack_depth(), dispatch.dispatch_stack_depth()) == (0, 0)
    assert callback.trace is None and not (tmp_path / "out" / "ampscope-step2.json").exists()
    # the guard is the instance's own: the Trainer class, and so every other Trainer, is as it was
    assert "train" in vars(trainer) and "guarded" not in type(trainer).train.__qualname__


# -- Lightning --------------------------------------------------------------------------------

def test_lightning_callback_traces_step_2_of_fit_into_its_log_dir(tmp_path):
    lightning = pytest.importorskip("lightning")
    from ampscope.integrations.lightning import AmpscopeCallback

    class Tiny(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = gpt2.load("gpt2-tiny").module

        def training_step(self, batch, batch_idx):
            return self.net(batch[:, :-1], batch[:, 1:].contiguous())[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def fit(callback, root):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.DataLoader(torch.randint(0, 256, (6, 9), generator=g),
                                           batch_size=2)
        module = Tiny()
        trainer = lightning.Trainer(max_steps=3, accelerator="cpu", logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, callbacks=[callback],
                                    default_root_dir=str(root))
        before = installed_hooks(module, None)
        trainer.fit(module, data)
        assert installed_hooks(module, None) == before
        assert not trainer.optimizers[0]._optimizer_step_post_hooks
        return module

    callback = AmpscopeCallback()
    fit(callback, tmp_path / "run")

    class Direct(lightning.Callback):
        """ampscope.capture from the end of batch 0 (its optimizer.step() returned) to the end
        of batch 1."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                self.recorder = ampscope.capture(pl_module)
                self.trace = self.recorder.__enter__()
            elif batch_idx == 1:
                self.recorder.__exit__(None, None, None)

    direct = Direct()
    fit(direct, tmp_path / "direct")
    t = callback.trace
    # Lightning runs forward and backward inside optimizer.step(closure): still labelled so
    assert {o.phase for o in t.ops} == {"forward", "backward", "optimizer"}
    assert ops(t) == ops(direct.trace)
    assert {s.key for s in t.optimizer_state} == {"step", "exp_avg", "exp_avg_sq"}
    assert (tmp_path / "run" / "ampscope-step2.json").exists()
    assert (tmp_path / "run" / "ampscope-step2.html").exists()


def test_a_failed_write_is_logged_and_the_training_goes_on(tmp_path, monkeypatch, caplog):
    import errno
    import importlib

    watch_module = importlib.import_module("ampscope.api.watch")  # the name is the function

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(watch_module, "write_atomic", full_disk)
    model, optimizer = model_and_optimizer()
    w = ampscope.watch(model, optimizer, out=tmp_path)
    with caplog.at_level("WARNING", logger="ampscope"):
        for i in range(1, 4):
            train_step(model, optimizer, i)
    # the loop was not stopped (AdamW counted 3 steps), and the trace is kept
    assert {float(s["step"]) for s in optimizer.state.values()} == {3.0}
    assert w.steps == 2 and w.trace is not None
    assert w.files == [tmp_path / "ampscope-step2.json"]  # written before the disk filled
    assert [r.getMessage() for r in caplog.records] == [
        f"ampscope.watch: cannot write to {tmp_path}: No space left on device"]


def test_the_frameworks_are_imported_only_by_their_callbacks():
    import subprocess
    import sys

    code = ("import sys, ampscope, ampscope.integrations; ampscope.watch; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
