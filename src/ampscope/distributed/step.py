"""One rank's train step under DDP or FSDP2, the same for a real rank and a predicted one.

The model is wrapped as the PyTorch docs wrap it: FSDP2 `fully_shard` on every transformer
block, then on the root (so each block is all-gathered and reduce-scattered on its own, and
the root's remaining parameters — embeddings, final norm, head — in one more group); DDP
around the whole model. The step itself is `workloads.train_step`, as for one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable

import torch
from torch import nn

from ampscope import workloads
from ampscope.distributed.capture import DistributedCapture
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import Collective, DistributedReport
from ampscope.hardware import Accelerator
from ampscope.models.base import LoadedModel
from ampscope.patches import patched
from ampscope.precision import Setting
from ampscope.records import dtype_name
from ampscope.runs.environment import RunEnvironment
from ampscope.runtime.predict import check_matmul_dtypes, fake_batch
from ampscope.torchcompat.distributed import compress_hook, rank_chunks_patch
from ampscope.torchcompat.fake import fake_mode_suspended
from ampscope.tricks import Trick, TrickFailed, enabled


class ShardTrickFailed(TrickFailed):
    """`fully_shard` raised while the `fsdp-shard` trick answered FSDP2's chunking: the caller
    runs the rank again on the exact path, on a fresh copy of the model (this one is sharded
    in part)."""


def wrap(model: nn.Module, parallel: Parallel, mesh=None, *, predicted: bool = False
         ) -> nn.Module:
    """The model as the job runs it; FSDP2 shards in place, DDP returns its wrapper. A
    `predicted` rank's FSDP2 makes only the chunks of each parameter it reads (the `fsdp-shard`
    trick), not one per rank of the mesh."""
    if parallel.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        policy = parallel.fsdp_policy()
        trick = rank_chunks_patch() if predicted and enabled(Trick.FSDP_SHARD) else None
        with patched(*trick) if trick is not None else contextlib.nullcontext():
            try:
                for block in workloads.repeated_blocks(model):
                    fully_shard(block, mesh=mesh, mp_policy=policy)
                fully_shard(model, mesh=mesh, mp_policy=policy)
            except Exception as e:
                if trick is not None:
                    raise ShardTrickFailed(str(e)) from e
                raise
        return model
    ddp = nn.parallel.DistributedDataParallel(model)
    if parallel.reduce_dtype not in (None, torch.float32):
        # DDP's fp16/bf16_compress_hook with the dtype as the hook's state (torch's own bf16
        # hook refuses to run without NCCL; the cast is the same). Its bucket and return are
        # unannotated, as DDP wants: it compares them with its own types, not strings.
        ddp.register_comm_hook(parallel.reduce_dtype, compress_hook)
    return ddp


def rank_step(lm: LoadedModel, parallel: Parallel, setting: Setting, batch: dict, *,
              optimizer: str = "adamw", predict: bool = False, mesh=None,
              checkpoint: bool = False,
              prepare: Callable[[nn.Module], None] | None = None,
              gpu: str | Accelerator | None = None) -> DistributedReport | None:
    """Run and capture one train step on this rank; rank 0 gets the report (None elsewhere).
    With `predict` every tensor is fake and the process group is expected to be PyTorch's
    fake one: a prediction for rank 0. `checkpoint` recomputes each block in the
    backward pass; `prepare` changes the model in place before it is wrapped (tensor
    parallelism, on the working copies of its weights). `gpu` (`--gpu`) is the GPU an
    emulated cuda rank's virtual device is (RunEnvironment; default: an H100)."""
    # DDP's constructor reads parameter values (it checks and broadcasts them), which fake
    # tensors lack: a predicted DDP step runs unwrapped and its all-reduce is added from the
    # gradients (`ddp_allreduce`).
    env = RunEnvironment(setting, predict=predict, gpu=gpu)
    fake = env.fake
    ddp_predicted = fake is not None and parallel.strategy == "ddp"
    with env.applied(lm.module), env.predicting(collecting=gc.isenabled()):
        if prepare is not None:
            prepare(lm.module)
        # FSDP2 over a tensor-parallel model builds the 2-D mesh of its shards, which reads
        # real ranks: out of the fake mode (the fake parameters keep theirs).
        with fake_mode_suspended() if prepare is not None and fake is not None \
                else contextlib.nullcontext():
            model = lm.module if ddp_predicted else wrap(lm.module, parallel, mesh,
                                                         predicted=fake is not None)
        run_lm = dataclasses.replace(lm, module=model)
        data = fake_batch(batch, fake) if fake is not None else batch
        run = DistributedCapture(model, name=lm.name, parallel=parallel,
                                 setting=env.setting_record(), workload="train",
                                 op_check=check_matmul_dtypes if fake is not None else None,
                                 thin=fake is not None)
        if fake is not None:
            run.mode = "predict"
        with run.recording():
            outputs = workloads.train_step(run_lm, data, setting, optimizer,
                                           predict=fake is not None, checkpoint=checkpoint)
        if ddp_predicted:
            run.extra_collectives.append(ddp_allreduce(model, parallel))
            run.notes.append(
                "DDP predicted: its first step all-reduces every gradient in one bucket "
                "(PyTorch 2.13 buckets everything together until the reducer rebuilds its "
                "buckets, 25 MiB each, from the second step); the bytes are the same.")
        return run.finish(inputs=data, outputs=outputs)


def ddp_allreduce(model: nn.Module, parallel: Parallel) -> Collective:
    """DDP's gradient all-reduce in its first step, from the gradients' sizes: one bucket of
    every gradient, in the hook's dtype when a compress hook is set."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dtype = parallel.reduce_dtype or (grads[0].dtype if grads else torch.float32)
    payload = sum(g.numel() for g in grads) * dtype.itemsize
    n = parallel.world_size
    return Collective(-1, "c10d.allreduce_.default", "all_reduce", "backward", None,
                      dtype_name(dtype), payload, payload * 2 * (n - 1) // n)

