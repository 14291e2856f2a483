"""The facts of the number formats as plain data, in a module that imports no torch: the
records `formats.py` fills in, and the facts of every format as measured on one torch build, so
that `ampscope formats` without values answers without importing torch.

`MEASURED` holds what `formats.py` reads from torch: `torch.finfo`'s max, smallest normal and
eps, and what torch's cast makes of values beyond max and of ±inf. It is used only when the
installed torch is the build it was measured on (`MEASURED_ON`, read from the package metadata,
nothing imported); any other build is measured afresh. tests/test_formats.py checks that the
table equals torch's own answers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from importlib.metadata import PackageNotFoundError, version
from typing import NamedTuple

SCHEMA = "ampscope.formats/1"


class Layout(NamedTuple):
    sign: int
    exponent: int
    mantissa: int
    bias: int
    has_inf: bool
    has_nan: bool
    note: str = ""

    @property
    def bits(self) -> int:
        return self.sign + self.exponent + self.mantissa


# From each format's definition: IEEE 754 (fp64, fp32, fp16), Google's bfloat16, NVIDIA's
# TensorFloat-32, the OCP 8-bit float spec (e4m3fn, e5m2), the "fnuz" formats of AMD/Graphcore
# (finite, NaN, unsigned zero) and OCP MX's e8m0 scale.
LAYOUTS: dict[str, Layout] = {
    "float64": Layout(1, 11, 52, 1023, True, True),
    "float32": Layout(1, 8, 23, 127, True, True),
    "tf32": Layout(1, 8, 10, 127, True, True,
                   "not a torch dtype: float32's range with 10 mantissa bits, the precision "
                   "matmuls run in under torch.backends.cuda.matmul.allow_tf32 / "
                   "set_float32_matmul_precision('high'); computed from its definition"),
    "bfloat16": Layout(1, 8, 7, 127, True, True),
    "float16": Layout(1, 5, 10, 15, True, True),
    "float8_e4m3fn": Layout(1, 4, 3, 7, False, True,
                            "no inf; only S.1111.111 is NaN, so exponent 1111 holds 256..448"),
    "float8_e5m2": Layout(1, 5, 2, 15, True, True),
    "float8_e4m3fnuz": Layout(1, 4, 3, 8, False, True,
                              "no inf, no -0; the only NaN is 1.0000.000, the -0 pattern"),
    "float8_e5m2fnuz": Layout(1, 5, 2, 16, False, True,
                              "no inf, no -0; the only NaN is 1.00000.00, the -0 pattern"),
    "float8_e8m0fnu": Layout(0, 8, 0, 127, False, True,
                             "exponent only: the powers of two 2^-127..2^127 (OCP MX block "
                             "scale); no sign, no zero, 11111111 is NaN. torch's cast keeps "
                             "|x| and turns 0 into 2^-127"),
}
# Formats the installed torch may know but that are left out, with the reason.
SKIPPED = {
    "float4_e2m1fn_x2": "two fp4 values packed in one byte: torch.finfo does not support it and "
                        "torch has no cast to it (\"copy_kernel\" not implemented)",
}
STATUSES = ("exact", "rounded", "subnormal", "underflow", "overflow", "saturated", "nan",
            "sign-lost", "no-zero")


@dataclass(frozen=True)
class FormatFacts:
    name: str  # torch dtype name without "torch.", or "tf32"
    bits: int
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int  # stored bits, without the implicit leading 1
    bias: int
    max: float
    smallest_normal: float
    smallest_subnormal: float | None  # None: the format has no subnormals
    eps: float  # gap between 1.0 and the next value, 2^-mantissa_bits
    digits: float  # mantissa_bits·log10(2)
    has_inf: bool
    has_nan: bool
    overflow: str  # what torch's cast makes of finite values beyond max: "inf", "max", "nan"
    infinity: str  # ... and of ±inf: "inf", "max", "nan"
    source: str  # "torch.finfo" or "definition"
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {k: json_float(v) if isinstance(v, float) else v
                for k, v in asdict(self).items()} | {"notes": list(self.notes)}


@dataclass(frozen=True)
class Stored:
    """How one format stores one value."""

    format: str
    value: float  # the stored value, exactly (every value of these formats is a float64)
    bits: str  # "sign exponent mantissa" from the raw bits, e.g. "0 01111111 0000000"
    status: str  # one of STATUSES
    relative_error: float | None  # |stored - value| / |value|; None when either is inf or NaN
    nearest: bool | None  # no value of the format is closer; None when either is inf or NaN

    def to_dict(self) -> dict:
        return {k: json_float(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class ValueReport:
    text: str  # as the user wrote it
    value: float  # parsed to float64
    stored: tuple[Stored, ...]

    def to_dict(self) -> dict:
        return {"text": self.text, "value": json_float(self.value),
                "stored": [s.to_dict() for s in self.stored]}


@dataclass(frozen=True)
class FormatsReport:
    formats: tuple[FormatFacts, ...]
    values: tuple[ValueReport, ...]
    skipped: tuple[tuple[str, str], ...]  # (dtype name, why it is left out)
    torch: str  # the version whose casts were measured

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "torch": self.torch,
                "formats": [f.to_dict() for f in self.formats],
                "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
                "values": [v.to_dict() for v in self.values]}


def json_float(x: float) -> float | str:
    """JSON has no inf or NaN: write them as the strings "inf", "-inf", "nan"."""
    return x if math.isfinite(x) else str(x)



# --- limits and facts ---------------------------------------------------------------------


class _Limits(NamedTuple):
    max: float
    smallest_normal: float
    eps: float
    source: str
    notes: tuple[str, ...]

    @property
    def max_step(self) -> Fraction:
        """The gap below max, the same as the gap the next value up would have had."""
        return Fraction(2) ** (math.frexp(self.max)[1] - 1) * Fraction(self.eps)



def limits(name: str, finfo_max: float, finfo_smallest_normal: float,
           finfo_eps: float) -> _Limits:
    """A format's limits from torch.finfo's figures (tf32's from its definition; the finfo
    arguments are then ignored). Where finfo's eps contradicts the layout it is noted, and the
    layout's eps is used."""
    layout = LAYOUTS[name]
    eps = math.ldexp(1.0, -layout.mantissa)
    if name == "tf32":
        top = 2 ** layout.exponent - 2 - layout.bias  # the all-ones exponent is inf/NaN
        return _Limits(math.ldexp(2.0 - eps, top), math.ldexp(1.0, 1 - layout.bias), eps,
                       "definition", (layout.note,))
    notes: tuple[str, ...] = (layout.note,) if layout.note else ()
    if finfo_eps != eps:
        notes += (f"torch.finfo gives eps {finfo_eps:g}, but with {layout.mantissa} mantissa bits "
                  f"the gap after 1.0 is {eps:g}, shown here",)
    return _Limits(finfo_max, finfo_smallest_normal, eps, "torch.finfo", notes)


def assemble(name: str, limits: _Limits, overflow: str, infinity: str) -> FormatFacts:
    """FormatFacts from the layout, the limits, and what torch's cast does beyond max
    ("inf", "max", "nan") and to ±inf."""
    layout = LAYOUTS[name]
    notes = limits.notes
    if not layout.has_inf:  # torch chooses what happens here; measured, not assumed
        pm = "±" if layout.sign else ""
        words = {"inf": f"{pm}inf", "max": f"{pm}{limits.max:g}", "nan": "NaN"}
        notes += (f"torch's cast turns values that round beyond {pm}{limits.max:g} into "
                  f"{words[overflow]}, and {pm}inf into {words[infinity]}",)
    return FormatFacts(
        name=name, bits=layout.bits, sign_bits=layout.sign, exponent_bits=layout.exponent,
        mantissa_bits=layout.mantissa, bias=layout.bias, max=limits.max,
        smallest_normal=limits.smallest_normal,
        smallest_subnormal=limits.smallest_normal * limits.eps if layout.mantissa else None,
        eps=limits.eps, digits=layout.mantissa * math.log10(2), has_inf=layout.has_inf,
        has_nan=layout.has_nan, overflow=overflow, infinity=infinity, source=limits.source,
        notes=notes)


# --- the facts as measured on one build ----------------------------------------------------


class Measured(NamedTuple):
    """What torch answers for one format: finfo's max, smallest_normal and eps, and what its
    cast makes of a value beyond max and of ±inf."""

    max: float
    smallest_normal: float
    finfo_eps: float
    overflow: str
    infinity: str


MEASURED_ON = "2.13.0+cpu"
# In `available_formats()` order (widest first); tf32's limits come from its definition.
MEASURED: dict[str, Measured] = {
    "float64": Measured(1.7976931348623157e+308, 2.2250738585072014e-308, 2.220446049250313e-16, "inf", "inf"),
    "float32": Measured(3.4028234663852886e+38, 1.1754943508222875e-38, 1.1920928955078125e-07, "inf", "inf"),
    "tf32": Measured(math.nan, math.nan, math.nan, "inf", "inf"),
    "bfloat16": Measured(3.3895313892515355e+38, 1.1754943508222875e-38, 0.0078125, "inf", "inf"),
    "float16": Measured(65504.0, 6.103515625e-05, 0.0009765625, "inf", "inf"),
    "float8_e4m3fn": Measured(448.0, 0.015625, 0.125, "max", "max"),
    "float8_e5m2": Measured(57344.0, 6.103515625e-05, 0.25, "inf", "inf"),
    "float8_e4m3fnuz": Measured(240.0, 0.0078125, 0.125, "nan", "nan"),
    "float8_e5m2fnuz": Measured(57344.0, 3.0517578125e-05, 0.125, "nan", "nan"),
    "float8_e8m0fnu": Measured(1.7014118346046923e+38, 5.877471754111438e-39, 1.0, "nan", "nan"),
}
# What `skipped_formats()` gives on that build.
MEASURED_SKIPPED = ("float4_e2m1fn_x2",)


def measured_report() -> FormatsReport | None:
    """The report of `ampscope formats` without values, from `MEASURED`; None unless the
    installed torch is the build it was measured on."""
    try:
        installed = version("torch")
    except PackageNotFoundError:
        return None
    if installed != MEASURED_ON:
        return None
    facts = tuple(assemble(n, limits(n, m.max, m.smallest_normal, m.finfo_eps), m.overflow,
                           m.infinity) for n, m in MEASURED.items())
    return FormatsReport(facts, (), tuple((n, SKIPPED[n]) for n in MEASURED_SKIPPED),
                         MEASURED_ON)
