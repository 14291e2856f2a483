"""`fit`: the largest micro-batch (and sequence) whose predicted train step fits a GPU.

Every figure comes from a predicted run (`memory(..., predict=True)`: a trace on fake tensors
and its memory report), each on the one model built on the meta device, of which it makes its
own fake working copies (docs/fit.md); the search that picks the runs is in analysis/fit.py.

Namesakes, the same concern at another layer: `analysis/fit.py`, `cli/fit.py`, `render/fit.py`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ampscope import hardware, workloads
from ampscope.analysis.fit import (
    FitReport,
    Point,
    Probe,
    Variant,
    allocated_peak,
    compared_peak,
    dominant,
    held_peak,
    largest,
    parse_bytes,
)
from ampscope.analysis.memory import MemoryReport, memory_report
from ampscope.analysis.step_time import step_time
from ampscope.api.preparation import ID_BYTES_PER_TOKEN, resolved
from ampscope.api.tracing import trace
from ampscope.errors import AmpscopeError
from ampscope.hardware.cuda_allocator import AllocatorConfig, config_for
from ampscope.models.base import LoadedModel
from ampscope.precision import Setting, on_device
from ampscope.records import Trace
from ampscope.render.style import format_bytes
from ampscope.runs.environment import RunEnvironment

AS_GIVEN = "as given"
# The most real memory the token ids of a batch the search picks may take (`_batch_limit`):
# a second or so to make.
_IDS_BUDGET = 2**30
_FSDP_NOTE = ("Over more GPUs: `ampscope fit MODEL --gpus N` searches FSDP2 and tensor-parallel "
              "plans; `ampscope run --nproc N --predict --gpu NAME SCRIPT` holds a script's own "
              "plan against the GPU (docs/fit.md).")


def fit(
    model: str | nn.Module | LoadedModel,
    *,
    gpu: str | None = None,
    memory_size: int | str | None = None,
    setting: str | Setting = "fp32+amp-bf16",
    seq: int | str = 64,
    optimizer: str = "adamw",
    variants: bool = True,
    max_probes: int = 16,
    on_probe: Callable[[Probe], None] | None = None,
) -> FitReport:
    """The largest micro-batch of a train step whose predicted peak fits `gpu`'s memory (from
    hardware/known.py) or `memory_size` ("80GiB", or bytes); with `seq="auto"`, first the longest
    power-of-two sequence (up to the model's context) that fits at batch 1. On a CUDA setting
    a step fits when the caching allocator's reserved peak (replayed for every probe) is within
    the budget, elsewhere when its allocated peak is.

    A setting without a device runs on CUDA when `gpu` is given. With `variants`, each change
    that could buy room — bf16 weights, activation checkpointing, a fused optimizer — is run
    predicted at the batch found, and its own largest batch searched the same way.
    `on_probe` is called after each predicted run. Raises AmpscopeError when even batch 1
    does not fit."""
    budget, accelerator, source = memory_budget(gpu, memory_size)
    if isinstance(setting, str) and ":" not in setting and gpu is not None:
        setting = on_device(setting, "cuda")
    base = resolved(setting)
    # Built once, as `plan` builds a named model for a predicted run: on the meta device (an
    # emulated device's own code sees that device while it builds).
    lm = RunEnvironment(base, gpu=gpu).load(model,
                                            device="meta" if isinstance(model, str) else None)
    allocator = config_for(base.device)  # PYTORCH_CUDA_ALLOC_CONF's options (None off cuda)
    probing = _Probing(lm, budget, optimizer, max_probes, on_probe, allocator, gpu)
    seq_auto = seq == "auto"
    if seq_auto:
        t = _longest_seq(lm, lambda t: compared_peak(probing.run(AS_GIVEN, base, 1, t)) <= budget)
        if t is None:
            raise AmpscopeError(_no_fit(lm.name, base, budget, source, probing.probes))
    elif isinstance(seq, int) and not isinstance(seq, bool) and seq > 0:
        if seq > lm.max_seq_len:
            raise AmpscopeError(f"seq {seq} exceeds {lm.name}'s context length {lm.max_seq_len}")
        t = seq
    else:
        raise AmpscopeError(f"seq must be a positive integer or 'auto', not {seq!r}")
    # A budget larger than any batch needs (--memory 1e30) would have the search extrapolate to
    # batches no run takes; it stops at this limit instead, and says so.
    probing.limit, why = _batch_limit(t)
    batch = probing.search(AS_GIVEN, base, t)
    if batch is None:
        raise AmpscopeError(_no_fit(lm.name, base, budget, source, probing.probes))
    at_limit = probing.run(AS_GIVEN, base, batch, t)  # probed by the search: its own run
    peak = compared_peak(at_limit)
    timed = None
    if gpu is not None:  # the step at the batch found, on the GPU (its trace kept for this)
        timed = step_time(probing.traces[AS_GIVEN, batch, t], hardware.by_name(gpu))
    probing.traces.clear()
    found = probing.variants(base, batch, t, peak) if variants else []
    notes = probing.notes
    reached = [name for name, b in [(AS_GIVEN, batch), *((v.name, v.batch) for v in found)]
               if b == probing.limit]
    if reached:
        notes.insert(0, f"{', '.join(reached)}: every batch up to {probing.limit:,} fits in "
                        f"{format_bytes(budget)}; fit probes no larger batch: {why}")
    return FitReport(
        model=lm.name, accelerator=accelerator, memory_bytes=budget, memory_source=source,
        setting=base.name, optimizer=optimizer, seq=t, seq_auto=seq_auto, batch=batch,
        peak_bytes=allocated_peak(at_limit), peak_phase=at_limit.peak.phase, at_limit=dominant(at_limit),
        probes=probing.probes, variants=found, notes=notes, batch_limit=probing.limit,
        step_seconds=timed.seconds if timed else None,
        tokens_per_second=timed.tokens_per_second if timed else None,
        mfu=timed.mfu if timed else None,
        bound=max(timed.by_bound, key=timed.by_bound.__getitem__) if timed else None,
        reserved_bytes=at_limit.reserved.reserved_peak if at_limit.reserved else None,
        held=held_peak(at_limit), margin_bytes=budget - peak)


class _Probing:
    """The predicted runs of one search: each (variant, batch, seq) run once, in order."""

    def __init__(self, lm: LoadedModel, budget: int, optimizer: str, max_probes: int,
                 on_probe: Callable[[Probe], None] | None,
                 allocator: AllocatorConfig | None = None, gpu: str | None = None) -> None:
        self.lm, self.budget, self.optimizer, self.allocator = lm, budget, optimizer, allocator
        self.gpu = gpu  # the GPU an emulated run's device is (its kernels, its answers)
        self.max_probes, self.on_probe = max_probes, on_probe
        self.probes: list[Probe] = []
        self.notes: list[str] = []
        self.limit: int | None = None  # the largest batch probed (_batch_limit)
        self._reports: dict[tuple[str, int, int], tuple[MemoryReport, list[str], list[str]]] = {}
        # The search's own traces (not the variants'), for the step time at its answer.
        self.traces: dict[tuple[str, int, int], Trace] = {}

    def run(self, variant: str, s: Setting, batch: int, t: int, **options) -> MemoryReport:
        """One predicted step, as `memory(..., predict=True)` runs it; its ops' names and
        phases are kept for the search's guesses."""
        key = (variant, batch, t)
        if key not in self._reports:
            result = trace(self.lm, setting=s, batch=batch, seq=t, optimizer=self.optimizer,
                           predict=True, gpu=self.gpu, **options)
            report = memory_report(result, allocator=self.allocator)
            probe = Probe(variant, batch, t, allocated_peak(report),
                          compared_peak(report) <= self.budget, report.peak.phase,
                          report.reserved.reserved_peak if report.reserved else None)
            self.probes.append(probe)
            if self.on_probe is not None:
                self.on_probe(probe)
            self._reports[key] = report, [o.op for o in result.ops], [o.phase for o in result.ops]
            if variant == AS_GIVEN:
                self.traces[key] = result
        return self._reports[key][0]

    def search(self, variant: str, s: Setting, t: int, start: int = 1, **options) -> int | None:
        """The largest batch of `variant` whose predicted peak fits, from `start`."""
        def point(batch: int) -> Point:
            report = self.run(variant, s, batch, t, **options)
            _, ops, phases = self._reports[variant, batch, t]
            held = compared_peak(report)
            return Point(batch, held <= self.budget, report.live_bytes, ops, phases,
                         held - max(report.live_bytes, default=0))

        batch, closed = largest(point, self.budget, start=start, max_probes=self.max_probes,
                                limit=self.limit)
        if not closed:
            self.notes.append(f"{variant}: stopped after {self.max_probes} probes; batch {batch} "
                              "fits, a larger one may too")
        return batch

    def variants(self, base: Setting, batch: int, t: int, peak: int) -> list[Variant]:
        """Each change that could buy room, run at `batch`, and its own largest batch."""
        found = []
        for name, change, s, options in _variants(self.lm, base):
            there = compared_peak(self.run(name, s, batch, t, **options))
            own = self.search(name, s, t, start=batch, **options)
            found.append(Variant(name, change, there, peak - there, own,
                                 compared_peak(self.run(name, s, own, t, **options))
                                 if own else None))
        self.notes.append(_FSDP_NOTE)
        return found


def memory_budget(gpu: str | None, memory_size: int | str | None
                  ) -> tuple[int, str | None, str]:
    """The memory to fit in: (bytes, the accelerator's short name, where the figure comes
    from); `fit` and `plans` (`fit --gpus N`)."""
    accelerator = hardware.by_name(gpu) if gpu is not None else None
    if memory_size is not None:
        return parse_bytes(memory_size), accelerator.name if accelerator else None, "--memory"
    if accelerator is None:
        raise AmpscopeError("give the GPU (--gpu h100; `ampscope fit --help` lists them) or its "
                            "memory (--memory 80GiB)")
    # (The table's accelerators all have their memory: built in, or a user's, new or inherited.)
    assert accelerator.memory_bytes is not None
    return accelerator.memory_bytes, accelerator.name, f"hardware.py: {accelerator.title}"


def _batch_limit(seq: int) -> tuple[int, str]:
    """The largest batch the search probes at `seq`, and why it probes none larger.

    No run takes a batch over `workloads.MAX_SIZE`. Far below that, a probe's token ids are
    made for real even on fake tensors (preparation.batch_for), so the search picks no batch whose
    ids would take more than `_IDS_BUDGET` or half the memory free here: a batch it chose is
    never refused by the run (with a message quoting a batch the user never gave), and never
    takes the machine's memory or minutes to make."""
    from ampscope.models.registry import available_memory_bytes

    free = available_memory_bytes()
    ids = _IDS_BUDGET if free is None else min(_IDS_BUDGET, free // 2)
    by_memory = max(1, ids // (ID_BYTES_PER_TOKEN * seq))
    if by_memory >= workloads.MAX_SIZE:
        return workloads.MAX_SIZE, f"ampscope runs no batch over {workloads.MAX_SIZE:,}"
    where = " (half the memory free here)" if ids < _IDS_BUDGET else ""
    return by_memory, (f"a larger one's token ids, made for real even in a predicted run, would "
                       f"take more than {format_bytes(ids)}{where}")


def _longest_seq(lm: LoadedModel, fits: Callable[[int], bool]) -> int | None:
    """The longest power of two up to the context length that fits (None: not even 1),
    by bisection over the powers, the longest tried first (a small model fits it at once)."""
    powers = [2**k for k in range(lm.max_seq_len.bit_length()) if 2**k <= lm.max_seq_len]
    if fits(powers[-1]):
        return powers[-1]
    lo, hi = -1, len(powers) - 1  # powers[lo] fits (-1: none known), powers[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(powers[mid]):
            lo = mid
        else:
            hi = mid
    return powers[lo] if lo >= 0 else None


def _variants(lm: LoadedModel, base: Setting) -> list[tuple[str, str, Setting, dict]]:
    """(name, how to ask for it, its setting, its run options) of each change to try."""
    out: list[tuple[str, str, Setting, dict]] = []
    if base.param_dtype != torch.bfloat16:
        pure = resolved(on_device("bf16", base.device))
        out.append(("bf16 weights", f"-s {pure.name}", pure, {}))
    if workloads.repeated_blocks(lm.module):
        out.append(("checkpointing", "--checkpoint", base, {"checkpoint": True}))
    out.append(("fused optimizer", "--optimizer-impl fused", base, {"optimizer_impl": "fused"}))
    return out


def _no_fit(name: str, setting: Setting, budget: int, source: str, probes: list[Probe]) -> str:
    smallest = min(probes, key=lambda p: (p.reserved_bytes or p.peak_bytes, p.peak_bytes))
    where = "--memory" if source == "--memory" else source.removeprefix("hardware.py: ")
    held = (f"the caching allocator would reserve {format_bytes(smallest.reserved_bytes)} "
            f"(allocated peak {format_bytes(smallest.peak_bytes)})"
            if smallest.reserved_bytes is not None else
            f"its predicted peak is {format_bytes(smallest.peak_bytes)}")
    return (f"{name} does not fit in {format_bytes(budget)} ({where}) under {setting.name} even "
            f"at batch {smallest.batch}, seq {smallest.seq}: {held}; try a bf16 setting, a "
            "shorter --seq or a larger GPU")
