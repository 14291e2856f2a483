"""What precision costs: divergence from a high-precision reference, and range against formats.

Divergence of a tensor `a` from its reference `r` (both float64 copies):

    relative L2   ‖a − r‖ / ‖r‖
    max abs       max |a − r|
    cosine        ⟨a, r⟩ / (‖a‖ ‖r‖)
    SQNR          10 log10(‖r‖² / ‖a − r‖²) dB  (inf when equal)

Range of a tensor against a format (fp16, bf16, fp8): the share of its non-zero values that
would overflow (|x| > max), flush to zero (|x| below half the smallest subnormal, where
round-to-nearest gives 0) or land among the subnormals (below the smallest normal), and amax.

Under an fp8 recipe, each cast into fp8 at the scale the recipe used (one per tensor, or one per
row): the share of its non-zero values that saturate (|x · scale| above the format's max,
clamped to it) and that underflow (non-zero, 0 in fp8), counted on the run's real tensors by
`runs.values` and summed here over a layer's calls.

Namesakes, the same concern at another layer: `render/numerics.py`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ampscope.analysis.flow import split_block
from ampscope.analysis.format_table import json_float
from ampscope.runs.values import CastValues, Values

SCHEMA = "ampscope.numerics/1"

RANGE_FORMATS: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Divergence:
    rel_l2: float
    max_abs: float
    cosine: float
    sqnr_db: float

    @property
    def exact(self) -> bool:
        return self.max_abs == 0.0


def divergence(a: torch.Tensor, r: torch.Tensor) -> Divergence:
    a, r = a.double().flatten(), r.double().flatten()
    diff = a - r
    err, ref = float(diff.norm()), float(r.norm())
    na = float(a.norm())
    return Divergence(
        rel_l2=err / ref if ref else (0.0 if err == 0 else math.inf),
        max_abs=float(diff.abs().max()) if diff.numel() else 0.0,
        cosine=float(torch.dot(a, r)) / (na * ref) if na and ref else (1.0 if err == 0 else 0.0),
        sqnr_db=10 * math.log10(ref**2 / err**2) if err else math.inf,
    )


@dataclass(frozen=True)
class ModuleDivergence:
    name: str
    type: str
    calls: int
    divergence: Divergence  # over all its calls' outputs together


@dataclass(frozen=True)
class BlockDivergence:
    container: str  # "transformer.h"
    index: int
    divergence: Divergence


@dataclass(frozen=True)
class SettingNumerics:
    setting: str
    modules: list[ModuleDivergence]
    blocks: list[BlockDivergence]  # error growth with depth
    loss: Divergence | None
    grads: list[tuple[str, Divergence]]  # parameter → gradient divergence
    fp8_casts: list[CastRange] = field(default_factory=list)  # empty without an fp8 recipe


class _Shares:
    """Saturated and underflowed values as shares of the non-zero values cast."""

    nonzero: int
    saturated: int
    underflow: int

    @property
    def saturated_share(self) -> float:
        return self.saturated / self.nonzero if self.nonzero else 0.0

    @property
    def underflow_share(self) -> float:
        return self.underflow / self.nonzero if self.nonzero else 0.0


@dataclass(frozen=True)
class CastRange(_Shares):
    """The casts into fp8 of one operand of one layer's matmuls, over all its calls."""

    module: str
    phase: str
    role: str  # "input", "weight", "output gradient"
    dtype: str  # the fp8 format
    granularity: str  # "tensorwise" or "rowwise": one scale per tensor, or per row or column
    casts: int
    numel: int
    nonzero: int
    saturated: int
    underflow: int


def cast_ranges(casts: list[CastValues]) -> list[CastRange]:
    """The casts summed by layer, phase, role and format, in the order they first ran."""
    # (module, phase, role, dtype, granularity): CastRange's first fields.
    rows: dict[tuple[str, str, str, str, str], list[CastValues]] = {}
    for c in casts:
        granularity = "tensorwise" if c.scales == 1 else "rowwise"
        key = (c.module or "", c.phase, c.role or "other", c.dtype, granularity)
        rows.setdefault(key, []).append(c)
    return [CastRange(*key, casts=len(cs), numel=sum(c.numel for c in cs),
                      nonzero=sum(c.nonzero for c in cs), saturated=sum(c.saturated for c in cs),
                      underflow=sum(c.underflow for c in cs))
            for key, cs in rows.items()]


@dataclass(frozen=True)
class CastTotals(_Shares):
    """One setting's fp8 casts summed over every layer, phase and operand."""

    setting: str
    casts: int
    nonzero: int
    saturated: int
    underflow: int
    granularities: list[str]  # in the order they first ran: "tensorwise", "rowwise"


def cast_totals(s: SettingNumerics) -> CastTotals:
    return CastTotals(s.setting, sum(c.casts for c in s.fp8_casts),
                      sum(c.nonzero for c in s.fp8_casts), sum(c.saturated for c in s.fp8_casts),
                      sum(c.underflow for c in s.fp8_casts),
                      list(dict.fromkeys(c.granularity for c in s.fp8_casts)))


@dataclass(frozen=True)
class LossyCast:
    """One layer's operand in one phase, across the fp8 settings: each setting's casts of it
    (None where that setting has none)."""

    module: str
    phase: str
    role: str
    casts: list[CastRange | None]


@dataclass(frozen=True)
class Fp8Comparison:
    """The fp8 settings' casts side by side, as the terminal and HTML views show them: each
    setting's totals, then the operands that lost values (saturated or underflowed) in any
    setting, the worst `shown` of them, in the order they first ran."""

    totals: list[CastTotals]
    lossy: list[LossyCast]
    operands: int  # distinct (layer, phase, operand) cast in any setting
    lossy_operands: int  # how many of them lost a value in some setting


def compare_fp8_casts(report: NumericsReport, shown: int = 12) -> Fp8Comparison | None:
    """None when no setting cast into fp8."""
    settings = [s for s in report.settings if s.fp8_casts]
    if not settings:
        return None
    by_setting = [{(c.module, c.phase, c.role): c for c in s.fp8_casts} for s in settings]
    lost = {k: max(rows[k].underflow_share + rows[k].saturated_share
                   for rows in by_setting if k in rows)
            for rows in by_setting for k in rows}
    worst = sorted((k for k, v in lost.items() if v > 0), key=lambda k: -lost[k])
    keep = set(worst[:shown])
    return Fp8Comparison(
        [cast_totals(s) for s in settings],
        [LossyCast(*k, [rows.get(k) for rows in by_setting]) for k in lost if k in keep],
        len(lost), len(worst))


def compare_runs(setting: str, test: Values, ref: Values) -> SettingNumerics:
    modules = []
    for name, outs in ref.outputs.items():
        got = test.outputs.get(name)
        if not got or len(got) != len(outs) or any(g.shape != o.shape for g, o in zip(got, outs, strict=True)):
            continue  # ran differently (another code path): not comparable
        d = divergence(torch.cat([g.flatten() for g in got]), torch.cat([o.flatten() for o in outs]))
        modules.append(ModuleDivergence(name, ref.types.get(name, "?"), len(outs), d))
    blocks = []
    for m in modules:
        parts = split_block(m.name)
        if parts is not None and parts[2] == "":  # the block itself, not a child
            blocks.append(BlockDivergence(parts[0], parts[1], m.divergence))
    loss = divergence(test.loss, ref.loss) if test.loss is not None and ref.loss is not None else None
    grads = [(n, divergence(test.grads[n], g)) for n, g in ref.grads.items() if n in test.grads]
    return SettingNumerics(setting, modules, blocks, loss, grads, cast_ranges(test.fp8_casts))


# --- range -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatRange:
    overflow: float  # share of non-zero values above the format's max
    flush_to_zero: float  # share that would round to zero
    subnormal: float  # share that would be subnormal (and keep fewer significant bits)


@dataclass(frozen=True)
class TensorRange:
    kind: str  # "activation", "gradient", "weight"
    name: str
    numel: int
    amax: float
    formats: dict[str, FormatRange]


def tensor_range(kind: str, name: str, t: torch.Tensor) -> TensorRange:
    x = t.double().abs().flatten()
    nonzero = x[x > 0]
    n = max(nonzero.numel(), 1)
    formats = {}
    for fmt, dtype in RANGE_FORMATS.items():
        info = torch.finfo(dtype)
        smallest_subnormal = info.tiny * info.eps  # 2^(emin − mantissa bits): fp16 2^-24
        formats[fmt] = FormatRange(
            overflow=float((nonzero > info.max).sum()) / n,
            flush_to_zero=float((nonzero < smallest_subnormal / 2).sum()) / n,
            subnormal=float(((nonzero >= smallest_subnormal / 2) & (nonzero < info.tiny)).sum()) / n,
        )
    return TensorRange(kind, name, t.numel(), float(x.max()) if x.numel() else 0.0, formats)


def ranges(values: Values) -> list[TensorRange]:
    out = [tensor_range("activation", name, torch.cat([o.flatten() for o in outs]))
           for name, outs in values.outputs.items()]
    out += [tensor_range("gradient", name, g) for name, g in values.grads.items()]
    out += [tensor_range("weight", name, w) for name, w in values.weights.items()]
    return out


@dataclass
class NumericsReport:
    model: str
    workload: str
    reference: str
    settings: list[SettingNumerics] = field(default_factory=list)
    ranges: list[TensorRange] = field(default_factory=list)
    emulated: list[str] = field(default_factory=list)  # settings whose device was absent

    def fp16_overflows(self) -> list[TensorRange]:
        """Activations or gradients with values beyond fp16's max: fp16 training breaks there."""
        return [r for r in self.ranges
                if r.kind != "weight" and r.formats["float16"].overflow > 0]

    def fp16_gradient_underflow(self) -> tuple[int, int]:
        """(gradient values that would flush to zero in fp16 without loss scaling, all values)."""
        flushed = total = 0
        for r in self.ranges:
            if r.kind == "gradient":
                flushed += round(r.formats["float16"].flush_to_zero * r.numel)
                total += r.numel
        return flushed, total

    def to_dict(self) -> dict:
        flushed, total = self.fp16_gradient_underflow()
        return {
            "schema": SCHEMA,
            "model": self.model,
            "workload": self.workload,
            "reference": self.reference,
            "emulated": list(self.emulated),
            "settings": [_setting_dict(s) for s in self.settings],
            "ranges": [asdict(r) for r in self.ranges],
            "fp16_overflow": [r.name for r in self.fp16_overflows()],
            "fp16_gradient_underflow": {"values": flushed, "of": total},
        }


def _div(d: Divergence) -> dict:
    return {k: json_float(v) for k, v in asdict(d).items()}


def _setting_dict(s: SettingNumerics) -> dict:
    return {
        "setting": s.setting,
        "loss": _div(s.loss) if s.loss else None,
        "modules": [{"name": m.name, "type": m.type, "calls": m.calls, **_div(m.divergence)}
                    for m in s.modules],
        "blocks": [{"container": b.container, "index": b.index, **_div(b.divergence)}
                   for b in s.blocks],
        "grads": [{"param": n, **_div(d)} for n, d in s.grads],
        "fp8_casts": [{**asdict(c), "saturated_share": c.saturated_share,
                       "underflow_share": c.underflow_share} for c in s.fp8_casts],
    }
