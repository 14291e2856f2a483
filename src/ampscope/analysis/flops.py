"""Where the FLOPs of a step go, and the conventions people quote for them, side by side.

Counted FLOPs come from the ops that ran (runs/flops.py: PyTorch's formulas plus the CPU
attention kernels they lack). The conventions are computed from the model's shapes as the trace
saw them:

- 6·N·D (Kaplan et al. 2020): 6 FLOPs per parameter per token for a train step (2 forward, 4
  backward), 2·N·D for forward alone. Ignores attention's T² term.
- nanoGPT / PaLM (Chowdhery et al. 2022, appendix B): 6·N' + 12·L·H·Q·T per token, N' without
  position embeddings (a lookup); the attention term counts the full T×T score matrix, so it is
  also given with causal halving (6·L·H·Q·T).

L, H, Q and T are read off the first forward pass's attention ops, so they hold for any model
that calls `scaled_dot_product_attention`; MFU holds each matmul dtype's counted FLOPs to its
own peak (hardware.mfu). Both as the command shows them: docs/cli.md, "ampscope flops".

Namesakes, the same concern at another layer: `render/flops.py`, `runs/flops.py`,
`torchcompat/flops.py`."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from itertools import dropwhile, takewhile
from typing import Any

from ampscope import hardware
from ampscope.analysis.flow import collapse_blocks
from ampscope.analysis.summary import numel
from ampscope.records import OpCall, PassKind, Phase, SettingRecord, Trace, module_label
from ampscope.records.table import Table, table

SCHEMA = "ampscope.flops/1"
PHASES = ("forward", "backward", "optimizer")
_POSITION_EMBEDDING = re.compile(r"(^|\.)(wpe|embed_positions|position_embeddings)(\.|$)")


@dataclass(frozen=True)
class FlopRow:
    """FLOPs of one module's own ops (not its children's), per block when `repeats` > 1."""

    name: str
    forward: int
    backward: int
    dtype: str  # the dtype its matmuls ran in ("—" when it ran none)
    repeats: int = 1


@dataclass(frozen=True)
class AttentionShape:
    layers: int  # L: attention calls in the first forward pass
    heads: int  # H
    head_dim: int  # Q
    seq: int  # T (query length)


@dataclass(frozen=True)
class Convention:
    name: str
    flops: int
    note: str


@dataclass
class FlopReport:
    model: str
    setting: SettingRecord
    workload: str
    tokens: int  # tokens processed by the step: batch × sequence length
    by_phase: dict[str, int]
    by_dtype: dict[str, int]  # dtype a matmul ran in → its FLOPs
    causal: int  # counted, with causal attention on the kept entries only
    mode: str = "run"  # "predict": counted on fake tensors (the same ops, no values)
    rows: list[FlopRow] = field(default_factory=list)
    conventions: list[Convention] = field(default_factory=list)
    attention: AttentionShape | None = None
    utilization: Utilization | None = None  # with a step time: throughput and MFU
    # FLOPs of a training run's evaluation and sampling passes (runs/passes.py): counted
    # apart, outside `total`, the conventions and MFU, which are the step's.
    evaluation: int = 0
    # The step predicted on a GPU, a `StepTime` (api/gpu_time.py says which GPU and when): None
    # for a setting that is not cuda, or a workload that is not one step. Typed Any: step_time.py
    # imports this module, which must not import it back.
    predicted: Any = None

    @property
    def total(self) -> int:
        return sum(self.by_phase.values())

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "setting": self.setting.to_dict(),
            "workload": self.workload,
            "mode": self.mode,
            "tokens": self.tokens,
            "total": self.total,
            "total_causal": self.causal,
            "by_phase": self.by_phase,
            "by_dtype": self.by_dtype,
            "attention": asdict(self.attention) if self.attention else None,
            "conventions": [asdict(c) for c in self.conventions],
            "modules": [asdict(r) for r in self.rows],
            "utilization": asdict(self.utilization) if self.utilization else None,
            "evaluation": self.evaluation,
            "predicted": predicted_dict(self.predicted),
        }

    def table(self) -> Table:
        """Own FLOPs of each module, as `ampscope flops` prints them: identical blocks on one
        row (`repeats` of them, `forward`/`backward` per block); `total` is the row's FLOPs
        over all its repeats. The optimizer's FLOPs belong to no module (`by_phase`)."""
        return table(("module", "repeats", "forward", "backward", "total", "dtype"),
                     ((r.name, r.repeats, r.forward, r.backward,
                       r.repeats * (r.forward + r.backward), r.dtype) for r in self.rows))

    def to_dataframe(self):
        """`table()` as a pandas DataFrame (the optional extra `ampscope[pandas]`)."""
        return self.table().to_dataframe()


def predicted_dict(predicted: Any) -> dict | None:
    """A predicted step's JSON (a `StepTime`'s, or None) without its per-op list (thousands of
    entries on a large model: `StepTime.to_dict()` has them)."""
    if predicted is None:
        return None
    return {k: v for k, v in predicted.to_dict().items() if k != "ops"}


def matmul_dtype(op: OpCall) -> str:
    """The dtype an op with FLOPs ran in: that of its first floating input, or the fp8 data of
    one (an fp8 training matmul: its operands show bfloat16 and hold float8_e4m3fn, so MFU
    holds it to the fp8 peak)."""
    for data in op.input_data:
        if data is not None:
            return data
    for m in op.inputs:
        if m.dtype.startswith(("float", "bfloat")):
            return m.dtype
    return op.inputs[0].dtype if op.inputs else "?"


def attention_shape(trace: Trace) -> AttentionShape | None:
    """L, H, Q, T from the attention ops of the first forward pass (the first training pass
    of a run that trained)."""
    first_step = _first_forward(trace)
    calls = [o for o in first_step if "attention" in o.op and o.flops and len(o.inputs[0].shape) == 4]
    if not calls:
        return None
    _, heads, seq, head_dim = calls[0].inputs[0].shape
    return AttentionShape(len(calls), heads, head_dim, seq)


def _first_forward(trace: Trace) -> list[OpCall]:
    """Ops of the first forward pass (a generate trace has one per sampled token)."""
    ops = trace.ops
    train = next((p for p in trace.passes if p.kind == PassKind.TRAIN), None)
    if train is not None:
        ops = ops[train.first_op:train.end_op]
    started = dropwhile(lambda o: o.phase != "forward", ops)
    return list(takewhile(lambda o: o.phase == "forward", started))


def _rows(trace: Trace) -> list[FlopRow]:
    per_module: dict[str, dict] = {}
    for o in trace.ops:
        if not o.flops or o.phase not in ("forward", "backward"):
            continue
        row = per_module.setdefault(module_label(o.module),
                                    {"forward": 0, "backward": 0, "dtype": matmul_dtype(o)})
        row[o.phase] += o.flops
    rows = [FlopRow(name, r["forward"], r["backward"], r["dtype"]) for name, r in per_module.items()]
    return collapse_blocks(rows, key=lambda r: (r.forward, r.backward, r.dtype))


def flop_report(trace: Trace, *, tokens: int) -> FlopReport:
    """Counted FLOPs of the traced step by phase, dtype and module, and the conventions."""
    by_phase = {p: sum(o.flops for o in trace.ops if o.phase == p) for p in PHASES}
    step = [o for o in trace.ops if o.flops and o.phase in PHASES]
    by_dtype: dict[str, int] = {}
    for o in step:
        by_dtype[matmul_dtype(o)] = by_dtype.get(matmul_dtype(o), 0) + o.flops
    report = FlopReport(
        model=trace.model.name, setting=trace.setting, workload=trace.workload, tokens=tokens,
        by_phase=by_phase, by_dtype=by_dtype, causal=sum(o.flops_causal for o in step),
        mode=trace.mode,
        rows=_rows(trace), attention=attention_shape(trace),
        evaluation=sum(o.flops for o in trace.ops if o.phase == Phase.EVALUATION),
    )
    report.conventions = conventions(trace, report)
    return report


def conventions(trace: Trace, report: FlopReport) -> list[Convention]:
    train = trace.workload == "train"
    per_param = 6 if train else 2
    n = trace.model.parameters
    d = report.tokens
    out = [
        Convention("counted", report.total,
                   "the ops that ran, PyTorch's formulas; attention over the full T×T scores"),
        Convention("counted, causal", report.causal,
                   "the same, causal attention counted only on the scores the mask keeps"),
    ]
    if trace.workload not in ("train", "forward"):
        return out  # sampling reruns a growing context: no per-token convention applies
    out.append(Convention(f"{per_param}·N·D", per_param * n * d,
                          f"N = {n:,} parameters (tied ones once), D = {d:,} tokens; "
                          "no attention term"))
    a = report.attention
    if a is not None:
        n_prime = n - sum(numel(p.shape) for p in trace.parameters
                          if _POSITION_EMBEDDING.search(p.name))
        attn = (12 if train else 4) * a.layers * a.heads * a.head_dim * a.seq
        out.append(Convention(f"nanoGPT {per_param}N' + {12 if train else 4}LHQT",
                              (per_param * n_prime + attn) * d,
                              f"N' = {n_prime:,} (no position embeddings), L={a.layers} H={a.heads} "
                              f"Q={a.head_dim} T={a.seq}"))
        out.append(Convention("nanoGPT, causal halving", (per_param * n_prime + attn // 2) * d,
                              "the attention term halved for the causal mask"))
    return out


@dataclass(frozen=True)
class Utilization:
    """Throughput of a step of known duration, and MFU against a device's peaks."""

    seconds: float
    tokens_per_second: float
    flops_per_second: float  # counted FLOPs / seconds
    device: str | None  # the accelerator whose peaks MFU uses; None: unknown → n/a
    mfu: float | None
    peaks: dict[str, float | None]  # dtype → the peak its matmuls are held to


def utilization(report: FlopReport, seconds: float, accelerator=None,
                matmul_precision: str = "highest") -> Utilization:
    """Tokens/s, achieved FLOP/s and MFU (hardware.mfu: each dtype against its own peak)."""
    peaks: dict[str, float | None] = {}
    mfu = None
    if accelerator is not None:
        peaks = {d: hardware.peak_flops(accelerator, d, matmul_precision) for d in report.by_dtype}
        mfu = hardware.mfu({d: float(f) for d, f in report.by_dtype.items()}, seconds,
                           accelerator, matmul_precision)
    return Utilization(
        seconds=seconds,
        tokens_per_second=report.tokens / seconds if seconds else 0.0,
        flops_per_second=report.total / seconds if seconds else 0.0,
        device=accelerator.title if accelerator is not None else None,
        mfu=mfu,
        peaks=peaks,
    )
