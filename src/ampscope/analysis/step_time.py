"""How long one traced step takes on a target accelerator, and where the time goes.

`step_time(trace, accelerator)` costs every op of the step (analysis/op_time.py) with the
parameters of hardware/kernels.py and adds them up as an eager PyTorch step runs: one op after
another on one stream, except the collectives FSDP2 and DDP overlap (`exposed_seconds`). Which
ops are the step (those `flops.flop_report` counts), the overlap rule and what `StepTime`
holds: docs/performance.md, "The method"."""

from __future__ import annotations

from dataclasses import dataclass, field

from ampscope import hardware
from ampscope.analysis.flops import PHASES, matmul_dtype
from ampscope.analysis.fusion import fuse
from ampscope.analysis.op_time import BOUNDS, OpTime, op_time
from ampscope.analysis.summary import tokens_of
from ampscope.hardware.kernels import KernelParams, params
from ampscope.hardware.known import Accelerator
from ampscope.records import OpCall, Trace, module_label
from ampscope.runtime.predict import gc_paused

SCHEMA = "ampscope.step_time/1"
OVERLAPPED = {"forward": ("all_gather", "reduce_scatter"),
               "backward": ("all_gather", "reduce_scatter", "all_reduce")}
TOP_MODULES = 10


@dataclass
class StepTime:
    """A predicted step on one accelerator.

    `seconds`: the step; `by_bound`: seconds by what bounds each op ("compute", "memory",
    "launch", "communication": only the exposed part of overlapped collectives); `by_phase`:
    seconds by phase (forward, backward, optimizer); `by_module`: the `TOP_MODULES` modules
    whose own ops take longest, seconds each; `ops`: every op of the step with its time;
    `tokens` and `tokens_per_second`; `mfu` (None where a peak is unknown); `hidden_seconds`:
    collective time the overlap rule hid; `notes`: what was assumed; `params`: the figures used
    and their sources."""

    model: str
    setting: str
    accelerator: str
    seconds: float
    by_bound: dict[str, float]
    by_phase: dict[str, float]
    by_module: dict[str, float]
    ops: list[OpTime]
    tokens: int
    tokens_per_second: float
    mfu: float | None
    hidden_seconds: float
    params: KernelParams
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "setting": self.setting,
            "accelerator": self.accelerator,
            "seconds": self.seconds,
            "by_bound": self.by_bound,
            "by_phase": self.by_phase,
            "by_module": self.by_module,
            "tokens": self.tokens,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "hidden_seconds": self.hidden_seconds,
            "notes": self.notes,
            "params": self.params.to_dict(),
            "ops": [o.to_dict() for o in self.ops],
        }


def step_ops(trace: Trace) -> list:
    """The ops of the step, as `flop_report` counts them: the forward, backward and optimizer
    phases."""
    return [o for o in trace.ops if o.phase in PHASES]


def step_time(trace: Trace, accelerator: Accelerator, *, world_size: int = 1) -> StepTime:
    """The predicted time of the traced step on `accelerator` (docs/performance.md), with the
    figures of `hardware.kernels.params(accelerator)` (the user's hardware.toml over them);
    `world_size`: the group size of a collective whose record lacks one."""
    figures = params(accelerator)
    step = step_ops(trace)
    with gc_paused():  # tens of thousands of small records: no full collection among them
        timed = _timed(step, accelerator, figures, world_size)
    compiled = sum(o.compiled for o in step)
    kernels = fuse(timed, step, trace.storages, accelerator, figures) if compiled else 0
    by_bound = dict.fromkeys(BOUNDS, 0.0)
    by_phase = dict.fromkeys(PHASES, 0.0)
    by_module: dict[str, float] = {}
    hidden = 0.0
    for phase in PHASES:
        ops = [t for t in timed if t.phase == phase]
        overlappable = [t for t in ops if t.collective in OVERLAPPED.get(phase, ())]
        overlapped = {t.index for t in overlappable}
        other = sum(t.seconds for t in ops if t.index not in overlapped)
        exposed = exposed_seconds(overlappable, other, last_exposed=phase == "backward")
        hidden += sum(t.seconds for t in overlappable) - exposed
        by_phase[phase] = other + exposed
        by_bound["communication"] += exposed
        for t in ops:
            if t.index in overlapped or t.bound == "none":
                continue
            by_bound[t.bound] += t.seconds
    for t in timed:
        if t.seconds:
            label = module_label(t.module)
            by_module[label] = by_module.get(label, 0.0) + t.seconds
    top = dict(sorted(by_module.items(), key=lambda kv: -kv[1])[:TOP_MODULES])
    seconds = sum(by_phase.values())
    count = tokens_of(trace)
    return StepTime(
        model=trace.model.name, setting=trace.setting.name, accelerator=accelerator.name,
        seconds=seconds, by_bound=by_bound, by_phase=by_phase, by_module=top, ops=timed,
        tokens=count, tokens_per_second=count / seconds if seconds else 0.0,
        mfu=_mfu(trace, seconds, accelerator), hidden_seconds=hidden, params=figures,
        notes=_notes(trace, timed, accelerator, hidden, (compiled, kernels)))


def _timed(step: list[OpCall], accelerator: Accelerator, figures: KernelParams,
           world_size: int) -> list[OpTime]:
    """`op_time` of every op, each distinct op costed once: a model's blocks repeat the same
    ops on the same shapes (a 70B step: 21,569 ops, a few hundred distinct), and an op's cost
    depends on nothing but the fields in the key."""
    memo: dict[tuple, OpTime] = {}
    out = []
    for o in step:
        # By identity, which is cheap: a replayed block's records share their shape tuples
        # (runs/windows.py), and every record lives while this runs, so no id is reused.
        key = (o.op, id(o.inputs), id(o.outputs), o.flops, o.fp32_precision, o.group,
               o.group_span, id(o.input_data))
        t = memo.get(key)
        if t is None:
            t = memo[key] = op_time(o, accelerator, figures, world_size=world_size)
            out.append(t)
        else:
            out.append(OpTime(o.index, o.op, str(o.phase), o.module, t.seconds, t.bound,
                              t.flops, t.bytes, t.mode, t.compute_s, t.memory_s,
                              t.collective, t.ranks))
    return out


def exposed_seconds(collectives: list[OpTime], other: float, *, last_exposed: bool) -> float:
    """The overlap rule: the first collective (and backward's last) in full, the rest beyond
    what the phase's other ops hide."""
    if not collectives:
        return 0.0
    ends = [collectives[0]] + ([collectives[-1]] if last_exposed and len(collectives) > 1 else [])
    fixed = sum(t.seconds for t in ends)
    rest = sum(t.seconds for t in collectives) - fixed
    return fixed + max(0.0, rest - other)


def _mfu(trace: Trace, seconds: float, accelerator: Accelerator) -> float | None:
    if seconds <= 0:
        return None
    by_dtype: dict[str, float] = {}
    for o in step_ops(trace):
        if o.flops:
            by_dtype[matmul_dtype(o)] = by_dtype.get(matmul_dtype(o), 0.0) + o.flops
    return hardware.mfu(by_dtype, seconds, accelerator, trace.setting.matmul_precision)


def _notes(trace: Trace, timed: list[OpTime], acc: Accelerator, hidden: float,
           fused: tuple[int, int]) -> list[str]:
    notes = ["Eager PyTorch: one op after another on one stream; each op max(compute, memory, "
             "host dispatch) + a kernel launch gap (docs/performance.md)."]
    compiled, kernels = fused
    if compiled:
        notes.append(f"torch.compile: {compiled} ops ran in compiled code; their pointwise and "
                     f"reduction ops are costed as {kernels} fused Inductor kernels, matmuls "
                     "and attention as their own kernels (docs/performance.md).")
    if acc.multiprocessors is None:
        notes.append(f"{acc.name} has no SM count in the hardware table: matmuls are timed "
                     "without tile or wave quantization.")
    if any(t.collective for t in timed):
        notes.append(f"Collectives: ring algorithm; FSDP2/DDP overlap rule hid {hidden:.6f} s "
                     "of all-gathers, reduce-scatters and backward all-reduces.")
    if not acc.bandwidth_bytes_per_s:
        notes.append(f"{acc.name} has no memory bandwidth in the hardware table: memory "
                     "traffic costs nothing here.")
    if trace.mode != "predict" and trace.setting.emulated:
        notes.append("Traced emulated on another device: the ops are the target's, their "
                      "kernels' choice as the emulation made it.")
    return notes
