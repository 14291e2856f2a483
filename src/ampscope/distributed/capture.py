"""Capture on every rank of a DDP or FSDP2 job; rank 0 gathers. How, with an example:
docs/distributed.md ("Inside your own job")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import (
    Collective,
    DistributedReport,
    Held,
    RankReport,
    collectives,
    rank_peak,
)
from ampscope.records import SettingRecord, Trace, dtype_name
from ampscope.runs.session import Capture, CaptureOptions
from ampscope.runs.tensor_meta import local_tensor
from ampscope.torchcompat.distributed import storage_id


def held_bytes(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> Held:
    """Bytes this rank holds in parameters, gradients and optimizer state, by dtype. A storage
    counts once (tied weights, views)."""
    held: Held = {}
    seen: set[tuple[int, int | torch.SymInt]] = set()  # (storage, offset)

    def add(category: str, t: torch.Tensor) -> None:
        t = local_tensor(t)
        # The storage's C pointer, which views and tied weights share.
        key = (storage_id(t), t.storage_offset())
        if key in seen:
            return
        seen.add(key)
        by_dtype = held.setdefault(category, {})
        name = dtype_name(t.dtype)
        by_dtype[name] = by_dtype.get(name, 0) + t.numel() * t.element_size()

    params = list(model.parameters())
    for p in params:
        add("parameter", p)
    for p in params:
        if p.grad is not None:
            add("gradient", p.grad)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add("optimizer_state", value)
    return held


def _strategy_of(model: nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fsdp"
    return "ddp"


def backend_name() -> str:
    return str(dist.get_backend()) if dist.is_initialized() else "none"


class DistributedCapture:
    """`with DistributedCapture(model) as run:` on every rank. After the block, `run.trace` is
    this rank's trace and, on rank 0, `run.report` the `DistributedReport` of all ranks (None on
    the others). Under a fake process group only this rank is recorded (nothing to gather)."""

    def __init__(self, model: nn.Module, *, name: str | None = None,
                 parallel: Parallel | None = None, setting: SettingRecord | None = None,
                 workload: str = "custom", op_check=None, thin: bool | None = None) -> None:
        self.model = model
        # DDP's wrapper runs the model's own forward: names without "module." read better.
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        # `thin`: a predicted rank's foreach ops answered per tensor (CaptureOptions).
        self._capture = Capture(inner, CaptureOptions(model_name=name, setting=setting,
                                                      workload=workload, op_check=op_check,
                                                      thin=thin))
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.parallel = parallel or Parallel(_strategy_of(model), self.world_size)
        self.trace: Trace | None = None
        self.report: DistributedReport | None = None
        self.mode = "run"
        self.notes: list[str] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        # Collectives known not from ops but from the strategy (a predicted DDP step's).
        self.extra_collectives: list[Collective] = []

    def _on_step(self, optimizer, args, kwargs) -> None:
        if not any(o is optimizer for o in self._optimizers):
            self._optimizers.append(optimizer)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the body; leaves the report unfinished (call `finish`)."""
        hook = register_optimizer_step_post_hook(self._on_step)
        try:
            with self._capture.recording():
                yield
        finally:
            hook.remove()

    def __enter__(self) -> DistributedCapture:
        self._recording = contextlib.ExitStack()
        self._recording.enter_context(self.recording())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._recording.close()
        if exc_type is None:
            self.finish()

    def finish(self, inputs=None, outputs=None) -> DistributedReport | None:
        held = held_bytes(self.model, self._optimizers)
        self._optimizers = []
        trace = self.trace = self._capture.finish(inputs=inputs, outputs=outputs)
        trace.mode = self.mode
        mine = RankReport(self.rank, held,
                          collectives(trace.ops, self.world_size) + self.extra_collectives,
                          rank_peak(trace))
        ranks = [mine]
        if self.world_size > 1 and backend_name() != "fake":
            gathered: list | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine.to_dict(), gathered, dst=0)
            if self.rank != 0:
                return None
            assert gathered is not None  # rank 0's: a list, filled by gather_object
            ranks = [RankReport.from_dict(d) for d in gathered]
        self.report = DistributedReport(
            model=trace.model.name, parameters=trace.model.parameters, setting=trace.setting,
            parallel=self.parallel, backend=backend_name(), mode=self.mode, ranks=ranks,
            notes=list(self.notes), trace=trace)
        return self.report


def capture(model: nn.Module, *, name: str | None = None) -> DistributedCapture:
    """Record one step of a DDP- or FSDP2-wrapped model on every rank (see the module doc)."""
    return DistributedCapture(model, name=name)
