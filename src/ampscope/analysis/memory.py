"""Memory of a traced step, from its storages: every byte by category and dtype, the peak and
where it happens, the live bytes over the step, and the formulas people use beside the counts.

Everything here reads `Trace.storages` (runs/memory.py): one record per storage, so views
and tied weights count once, live from `created` through `freed` (inclusive). What the live
bytes "at op k" are, the method and what it does not model: docs/memory.md.

Namesakes, the same concern at another layer: `render/memory.py`, `runs/memory.py`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from ampscope.analysis.allocator import replay_storages
from ampscope.analysis.summary import itemsize, numel
from ampscope.hardware.cuda_allocator import AllocatorConfig, AllocatorReplay
from ampscope.records import STORAGE_CATEGORIES, StorageRecord, Trace
from ampscope.records.table import Table, table
from ampscope.records.timeline import argmax, cuda_block_size, live_at, live_bytes

SCHEMA = "ampscope.memory/1"

@dataclass(frozen=True)
class MemoryRow:
    """Bytes and number of storages of one category in one dtype."""

    category: str
    dtype: str
    bytes: int
    count: int


@dataclass(frozen=True)
class Peak:
    bytes: int
    op: int | None  # index of the op at the peak; None when the step ran no op
    op_name: str | None
    module: str | None
    phase: str | None
    # With the CUDA allocator's rounding (cuda settings only): the peak of the rounded
    # timeline, and the op where it is (the same op, or one where many small blocks are live).
    rounded_bytes: int | None = None
    rounded_op: int | None = None


@dataclass(frozen=True)
class SharedStorage:
    """One storage that several names refer to (tied weights): counted once."""

    names: tuple[str, ...]
    category: str
    dtype: str
    bytes: int


@dataclass(frozen=True)
class Estimate:
    """A formula people use, with its value for this trace and the counted figure it
    estimates. `bytes` is None when the formula does not apply (`note` says why)."""

    label: str
    formula: str
    bytes: int | None
    counted: int | None
    counted_label: str
    note: str = ""


@dataclass(frozen=True)
class TimelineBucket:
    """A run of consecutive ops and the most bytes live during any of them."""

    first_op: int
    last_op: int
    phase: str  # at the op with the most bytes
    bytes: int


@dataclass(frozen=True)
class MeasuredPeak:
    """The step's peak as the real device's allocator saw it (`memory --measure`): CUDA's
    counter on a GPU, the profiler's allocation events on the CPU."""

    device: str  # torch.cuda.get_device_name(), or "cpu"
    source: str  # "torch.cuda.max_memory_allocated" or "torch.profiler memory events"
    max_memory_allocated: int  # over the step, counted as the prediction counts it
    # CUDA: torch.cuda.max_memory_allocated() as it read; CPU: the most bytes the step
    # allocated over what was live at its start
    raw_max_memory_allocated: int
    # CUDA: allocated before the step (the model as loaded, the batch); CPU: the step's own
    # copies of the weights and the batch, live at its start
    allocated_before: int

    def error(self, predicted: int) -> float:
        """The prediction's relative error against this measurement."""
        return (predicted - self.max_memory_allocated) / self.max_memory_allocated


@dataclass
class MemoryReport:
    model: str
    setting: str
    device: str
    workload: str
    mode: str  # "run" or "predict"
    before_bytes: int  # live before the first op: weights, buffers, inputs
    end_bytes: int  # live after the last op
    peak: Peak
    at_peak: list[MemoryRow]  # what is live at the peak
    allocated: list[MemoryRow]  # every storage of the step, live at once or not
    largest_at_peak: list[StorageRecord]  # the biggest storages live at the peak
    shared: list[SharedStorage]
    estimates: list[Estimate]
    live_bytes: list[int]  # after each op: live_bytes[k] is the bytes live through op k
    timeline: list[TimelineBucket]
    rounding: str | None  # "cuda" when the peak is also given with CUDA's block rounding
    notes: list[str] = field(default_factory=list)
    measured: MeasuredPeak | None = None  # on a real CUDA device or the CPU, with --measure
    emulated: bool = False  # the device was absent: the run was emulated on the CPU
    # the CUDA caching allocator replayed over the storages (cuda settings only)
    reserved: AllocatorReplay | None = None

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": self.model, "setting": self.setting, "device": self.device,
            "workload": self.workload, "mode": self.mode,
            "before_bytes": self.before_bytes, "end_bytes": self.end_bytes,
            "peak": asdict(self.peak),
            "rounding": self.rounding,
            "at_peak": [asdict(r) for r in self.at_peak],
            "allocated": [asdict(r) for r in self.allocated],
            "largest_at_peak": [asdict(s) | {"shape": list(s.shape), "names": list(s.names)}
                                for s in self.largest_at_peak],
            "shared": [asdict(s) | {"names": list(s.names)} for s in self.shared],
            "estimates": [asdict(e) for e in self.estimates],
            "timeline": {"live_bytes": list(self.live_bytes),
                         "buckets": [asdict(b) for b in self.timeline]},
            "notes": list(self.notes),
            "measured": asdict(self.measured) if self.measured else None,
            "emulated": self.emulated,
            "reserved": self.reserved.to_dict() if self.reserved else None,
        }


    def table(self) -> Table:
        """Category × dtype, as `ampscope memory` prints it: bytes and storages live at the
        peak beside everything the step allocated (0 where none is live at the peak)."""
        peak = {(r.category, r.dtype): r for r in self.at_peak}
        rows = []
        for r in self.allocated:
            p = peak.get((r.category, r.dtype))
            rows.append((r.category, r.dtype, p.bytes if p else 0, p.count if p else 0,
                         r.bytes, r.count))
        return table(("category", "dtype", "peak_bytes", "peak_storages", "allocated_bytes",
                      "allocated_storages"), rows)

    def to_dataframe(self):
        """`table()` as a pandas DataFrame (the optional extra `ampscope[pandas]`)."""
        return self.table().to_dataframe()


# -- the timeline -----------------------------------------------------------------------------

def breakdown(storages: Iterable[StorageRecord]) -> list[MemoryRow]:
    """Bytes and count by category × dtype, categories in precedence order, then by bytes."""
    cells: dict[tuple[str, str], list[int]] = {}
    for s in storages:
        cell = cells.setdefault((s.category, s.dtype), [0, 0])
        cell[0] += s.nbytes
        cell[1] += 1
    order: dict[str, int] = {c: i for i, c in enumerate(STORAGE_CATEGORIES)}
    return sorted((MemoryRow(c, d, b, n) for (c, d), (b, n) in cells.items()),
                  key=lambda r: (order.get(r.category, len(order)), -r.bytes, r.dtype))


def bucketed(live: list[int], phases: list[str], buckets: int) -> list[TimelineBucket]:
    """At most `buckets` runs of equally many ops, each with its most bytes."""
    if not live:
        return []
    width = -(-len(live) // buckets)
    out = []
    for first in range(0, len(live), width):
        last = min(first + width, len(live)) - 1
        top = max(range(first, last + 1), key=live.__getitem__)
        out.append(TimelineBucket(first, last, phases[top], live[top]))
    return out


# -- the formulas -----------------------------------------------------------------------------

def _per_param(total: int, n: int) -> str:
    per = total / n if n else 0.0
    return f"{per:.0f}" if per == int(per) else f"{per:.2f}"


def _dtypes_of(pairs: Iterable[tuple[str, int]]) -> str:
    """"float32" or "float32, bfloat16" (most elements first)."""
    by: dict[str, int] = {}
    for dtype, n in pairs:
        by[dtype] = by.get(dtype, 0) + n
    return ", ".join(sorted(by, key=by.__getitem__, reverse=True))


def _counted(storages: list[StorageRecord], *categories: str) -> int:
    return sum(s.nbytes for s in storages if s.category in categories)


def parameter_estimates(trace: Trace) -> list[Estimate]:
    """Parameters only (accelerate's `estimate-memory` model size), and the same summed over
    parameter names as a state_dict would (tied weights twice), when there are tied weights."""
    params = trace.parameters
    n = sum(numel(p.shape) for p in params)
    size = sum(numel(p.shape) * itemsize(p.dtype) for p in params)
    dtypes = _dtypes_of((p.dtype, numel(p.shape)) for p in params)
    counted = _counted(trace.storages, "parameter")
    out = [Estimate(
        "parameters only", f"{n:,} params × {_per_param(size, n)} B ({dtypes})", size, counted,
        "parameter storages",
        "what accelerate's `estimate-memory` reports as the model's size in this dtype",
    )]
    if any(p.tied_to for p in params):
        per_name = sum(numel(p.shape) * itemsize(p.dtype) * (1 + len(p.tied_to)) for p in params)
        tied = ", ".join(" = ".join((p.name, *p.tied_to)) for p in params if p.tied_to)
        out.append(Estimate(
            "numel × element size per parameter name", "Σ over named_parameters(remove_duplicate=False)",
            per_name, counted, "parameter storages",
            f"tied weights counted once per name ({tied}); one storage holds them",
        ))
    return out


def training_state_estimate(trace: Trace) -> Estimate:
    """N × (weight + gradient + optimizer state) bytes per parameter, from the trace's dtypes:
    16 B/param for fp32 weights with AdamW (4 + 4 + 2 × 4)."""
    label = "weights + gradients + optimizer state"
    params = trace.parameters
    if not any(p.grad_dtype for p in params):
        return Estimate(label, "N × (w + g + s) B", None, None, "",
                        f"no gradients: the {trace.workload} workload does not train")
    by_param: dict[str, list[tuple[str, str]]] = {}
    shapes = {p.name: p.shape for p in params}
    for s in trace.optimizer_state:
        if s.shape == shapes.get(s.param):  # moments; not the scalar `step` counters
            by_param.setdefault(s.param, []).append((s.key, s.dtype))
    n = sum(numel(p.shape) for p in params)
    weights = sum(numel(p.shape) * itemsize(p.dtype) for p in params)
    grads = sum(numel(p.shape) * itemsize(p.grad_dtype) for p in params if p.grad_dtype)
    state = sum(numel(p.shape) * itemsize(d) for p in params for _, d in by_param.get(p.name, []))
    keys = ", ".join(dict.fromkeys(k for v in by_param.values() for k, _ in v)) or "none"
    formula = (
        f"N × {_per_param(weights + grads + state, n)} B: "
        f"{_per_param(weights, n)} weights ({_dtypes_of((p.dtype, numel(p.shape)) for p in params)})"
        f" + {_per_param(grads, n)} gradients "
        f"({_dtypes_of((p.grad_dtype, numel(p.shape)) for p in params if p.grad_dtype)})"
        f" + {_per_param(state, n)} optimizer state ({keys})"
    )
    steps = [s for s in trace.optimizer_state if s.shape != shapes.get(s.param)]
    note = (f"the counted figure includes {len(steps)} scalar optimizer tensors "
            f"({', '.join(sorted({s.key for s in steps}))}) the formula leaves out" if steps else "")
    return Estimate(label, formula, weights + grads + state,
                    _counted(trace.storages, "parameter", "gradient", "optimizer_state"),
                    "parameter + gradient + optimizer state storages", note)


_ATTENTION = "torch.nn.functional.scaled_dot_product_attention"
_FUSED_ATTENTION = ("flash_attention", "efficient_attention", "cudnn_attention")


def _transformer_shape(trace: Trace) -> tuple[int, int, int, int, int] | str:
    """(L, b, s, h, a) read off the first step's attention calls, or why they cannot be."""
    calls = [c for c in trace.calls if c.func == _ATTENTION and c.phase == "forward"]
    if not calls:
        return "no scaled_dot_product_attention call to read b, s, h and a from"
    step = min(c.step for c in calls)
    calls = [c for c in calls if c.step == step]
    q = calls[0].inputs[0].shape if calls[0].inputs else ()
    if len(q) != 4:
        return "the attention's query is not (b, a, s, head_dim)"
    b, a, s, head_dim = q
    return len(calls), b, s, a * head_dim, a


def saved_activation_bytes(trace: Trace) -> int | None:
    """Bytes saved for backward that are activations (not weights, buffers, inputs, nor casts
    of weights), live when backward starts: what the activation formulas estimate."""
    first = next((o.index for o in trace.ops if o.phase == "backward"), None)
    if first is None:
        return None
    total = 0
    for s in live_at(trace.storages, first):
        if not s.saved:
            continue
        if s.category == "activation" or (
            s.category == "autocast_cast" and s.created is not None
            and not any(trace.ops[s.created].input_names)
        ):
            total += s.nbytes
    return total


def activation_estimates(trace: Trace) -> list[Estimate]:
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", §4.1): a GPT layer stores s·b·h·(34 + 5·a·s/h) bytes of activations for backward,
    with 16-bit activations, 1-byte dropout masks, no tensor or sequence parallelism and no
    recomputation; 5·a·s²·b of it are the attention scores, softmax and its dropout mask, which
    fused attention kernels (flash, memory-efficient, cuDNN) do not store."""
    label = "activations, Korthikanti et al. 2022"
    shape = _transformer_shape(trace)
    counted = saved_activation_bytes(trace)
    if counted is None:
        return [Estimate(label, "L · s·b·h·(34 + 5·a·s/h)", None, None, "",
                         f"the {trace.workload} workload runs no backward pass: nothing is saved")]
    if isinstance(shape, str):
        return [Estimate(label, "L · s·b·h·(34 + 5·a·s/h)", None, counted,
                         "saved for backward", shape)]
    layers, b, s, h, a = shape
    setting = trace.setting
    sixteen = {setting.autocast_dtype, setting.param_dtype} & {"bfloat16", "float16"}
    assumptions = ("assumes a GPT layer (4h MLP, two LayerNorms, dropout) with 16-bit activations"
                   + ("" if sixteen else "; this run keeps float32 activations (about twice the bytes)"))
    fused = any(o.phase == "forward" and any(k in o.op for k in _FUSED_ATTENTION)
                for o in trace.ops)
    where = f"L={layers}, s={s}, b={b}, h={h}, a={a}"
    full = layers * s * b * (34 * h + 5 * a * s)
    without_scores = layers * 34 * s * b * h
    counted_label = "saved for backward, live as backward starts"
    scores = Estimate(label, f"L · s·b·h·(34 + 5·a·s/h), {where}", full, counted, counted_label,
                      assumptions + ("" if fused else "; this run's attention kernel stores them"))
    no_scores = Estimate(label + ", fused attention", f"L · 34·s·b·h, {where}", without_scores,
                         counted, counted_label,
                         "without the 5·a·s²·b of attention scores, which fused attention "
                         "kernels recompute" + ("; this run's kernel is one" if fused else ""))
    # The one that describes this run's attention kernel first.
    return [no_scores, scores] if fused else [scores, no_scores]


# -- the report -------------------------------------------------------------------------------

def memory_report(trace: Trace, *, buckets: int = 48, largest: int = 5,
                  allocator: AllocatorConfig | None = None) -> MemoryReport:
    """The memory report of `trace`; on a cuda setting with the caching allocator replayed
    over its storages under `allocator` (PYTORCH_CUDA_ALLOC_CONF's options; default: none)."""
    storages, ops = trace.storages, trace.ops
    before, live = live_bytes(storages, len(ops))
    k = argmax(live)
    op = ops[k] if k is not None else None
    peak_bytes = live[k] if k is not None else before
    device = trace.setting.device
    rounded = rounded_op = None
    reserved: AllocatorReplay | None = None
    notes: list[str] = []
    if device == "cuda":
        reserved = replay_storages(storages, len(ops), allocator)
        notes += (allocator.notes if allocator else ())
        rounded_before, rounded_live = live_bytes(storages, len(ops), cuda_block_size)
        rounded_op = argmax(rounded_live)
        rounded = rounded_live[rounded_op] if rounded_op is not None else rounded_before
    peak = Peak(peak_bytes, k, op.op if op else None, op.module if op else None,
                op.phase if op else None, rounded, rounded_op)
    at_peak = live_at(storages, k)
    estimates = parameter_estimates(trace)
    if not storages:
        notes.append("The trace has no storage records (made before ampscope recorded memory).")
    if trace.workload not in ("forward", "generate"):
        static = training_state_estimate(trace)
        estimates.append(static)
        activations = activation_estimates(trace)
        estimates += activations
        if static.bytes is not None and activations[0].bytes is not None:
            estimates.append(Estimate(
                "the usual total",
                "weights + gradients + optimizer state + "
                + activations[0].formula.split(",")[0],
                static.bytes + activations[0].bytes, peak_bytes, "peak",
                "a sum of what is not all live at once (gradients are made as activations "
                "are freed), without the temporaries (the loss's, the optimizer's) that can "
                "set the peak",
            ))
    return MemoryReport(
        model=trace.model.name, setting=trace.setting.name, device=device,
        emulated=trace.setting.emulated,
        workload=trace.workload, mode=trace.mode, before_bytes=before,
        end_bytes=live[-1] if live else before, peak=peak,
        at_peak=breakdown(at_peak), allocated=breakdown(storages),
        largest_at_peak=sorted(at_peak, key=lambda s: -s.nbytes)[:largest],
        shared=[SharedStorage(s.names, s.category, s.dtype, s.nbytes)
                for s in storages if len(s.names) > 1],
        estimates=estimates, live_bytes=live,
        timeline=bucketed(live, [o.phase for o in ops], buckets),
        rounding="cuda" if device == "cuda" else None, notes=notes, reserved=reserved,
    )
