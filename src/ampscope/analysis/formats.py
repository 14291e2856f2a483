"""Number formats: what each floating-point format can hold, and how it stores a given value.

- `format_facts()` gives each format's layout and limits: `FormatFacts`.
- `store(text, name)` says how one format stores one decimal value: `Stored`.
- `formats_report(values)` gathers both for `ampscope formats [VALUE ...]`.

Where the facts come from:

- max, smallest normal and eps come from `torch.finfo`; the layout (sign/exponent/mantissa
  bits, bias, which of inf and NaN exist) is written down in `LAYOUTS` from each format's
  definition and checked against `torch.finfo` and torch's own bit decoding in the tests.
  Where finfo contradicts the layout it is reported, not followed: torch's
  `finfo(float8_e5m2fnuz).eps` is 0.125 (c10's `numeric_limits::epsilon()` returns the bit
  pattern 0x34), but with 2 mantissa bits the gap after 1.0 is 0.25 (1.0 is 0x40, 1.25 is 0x41).
- tf32 is not a torch dtype (tensor cores read float32 and keep 10 of its 23 mantissa bits), so
  its facts follow from its definition, 1/8/10 bits with float32's bias, and its stored values
  are float32 rounded to 10 mantissa bits, nearest-even (see `_round_to_tf32`).
- Stored values are what torch stores, computed on the CPU: `torch.tensor(x,
  dtype=torch.float64).to(dtype)`, the bits read back with `.view(torch.int16)` and the like.
  c10's BFloat16, Half and Float8 types are constructed from a float, so a value that is not a
  float32 number is rounded twice (decimal -> float64 -> float32 -> format); next to a tie the
  result can be one step from the nearest value, which `Stored.nearest` flags. The error and
  the status are measured against the exact decimal the user wrote (`Fraction`), not against
  its float64. What torch does beyond a format's range is measured, not assumed
  (`FormatFacts.overflow`, `.infinity`): in torch 2.13 float8_e4m3fn saturates to ±448, inf
  included; the fnuz formats give NaN; float8_e8m0fnu drops the sign and has no zero.

`digits` is mantissa_bits·log10(2) = -log10(eps): how many decimal digits the format resolves
next to 1.0 (numpy's `finfo.precision` and torch's `finfo.resolution` = 10^-floor(digits) use the
same measure). Counting the implicit leading bit, (mantissa_bits + 1)·log10(2), adds 0.3.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import cache
from typing import NamedTuple

import torch

from ampscope.errors import AmpscopeError

SCHEMA = "ampscope.formats/1"
# Beyond 1e±400 every format here has long overflowed or underflowed; clamping the exact value
# there keeps Fraction arithmetic cheap (1e-100000000 would build a 40 MB integer) and changes
# no status, stored value or printed error.
_CLAMP = Decimal("1e400")


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
_INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


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
        return {k: _json_float(v) if isinstance(v, float) else v
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
        return {k: _json_float(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class ValueReport:
    text: str  # as the user wrote it
    value: float  # parsed to float64
    stored: tuple[Stored, ...]

    def to_dict(self) -> dict:
        return {"text": self.text, "value": _json_float(self.value),
                "stored": [s.to_dict() for s in self.stored]}


@dataclass(frozen=True)
class FormatsReport:
    formats: tuple[FormatFacts, ...]
    values: tuple[ValueReport, ...]
    skipped: tuple[tuple[str, str], ...]  # (dtype name, why it is left out)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "torch": torch.__version__,
                "formats": [f.to_dict() for f in self.formats],
                "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
                "values": [v.to_dict() for v in self.values]}


def _json_float(x: float) -> float | str:
    """JSON has no inf or NaN: write them as the strings "inf", "-inf", "nan"."""
    return x if math.isfinite(x) else str(x)


def available_formats() -> tuple[str, ...]:
    """The formats of `LAYOUTS` that the installed torch has (tf32 always), widest first."""
    return tuple(n for n in LAYOUTS if n == "tf32" or hasattr(torch, n))


def skipped_formats() -> tuple[tuple[str, str], ...]:
    return tuple((n, why) for n, why in SKIPPED.items() if hasattr(torch, n))


# --- bits ---------------------------------------------------------------------------------


def _round_to_tf32(f32_bits: int) -> int:
    """float32 bits -> the 19 bits of tf32, rounded to nearest, ties to even (as bf16 rounding in
    c10's round_to_nearest_even, at 10 mantissa bits instead of 7). A carry out of the mantissa
    bumps the exponent, so values past tf32's max become inf; inf and NaN pass through."""
    if f32_bits & 0x7F800000 == 0x7F800000:
        return (f32_bits | (0x400000 if f32_bits & 0x7FFFFF else 0)) >> 13  # keep NaN a NaN
    odd = (f32_bits >> 13) & 1
    return ((f32_bits + 0xFFF + odd) & 0xFFFFFFFF) >> 13


def encode(name: str, x: float) -> int:
    """The bit pattern, as an unsigned integer, that format `name` stores for the float64 `x`."""
    if name == "tf32":
        return _round_to_tf32(encode("float32", x))
    t = torch.tensor(x, dtype=torch.float64).to(getattr(torch, name))
    bits = 8 * t.element_size()
    return t.view(_INT_VIEW[bits]).item() & ((1 << bits) - 1)


def decode(name: str, raw: int) -> float:
    """The value of bit pattern `raw` in format `name`, decoded by torch."""
    if name == "tf32":
        return decode("float32", raw << 13)
    bits = LAYOUTS[name].bits
    signed = raw - (1 << bits) if bits > 8 and raw >> (bits - 1) else raw  # int16/32/64 views
    t = torch.tensor(signed, dtype=_INT_VIEW[bits]).view(getattr(torch, name))
    return t.to(torch.float64).item()


def bit_groups(raw: int, layout: Layout) -> str:
    """"0 01111111 0000000": sign, exponent and mantissa bits, the empty groups left out."""
    s = f"{raw:0{layout.bits}b}"
    ends = (layout.sign, layout.sign + layout.exponent)
    return " ".join(g for g in (s[:ends[0]], s[ends[0]:ends[1]], s[ends[1]:]) if g)


def neighbours(name: str, raw: int) -> list[float]:
    """The finite values next to bit pattern `raw`: one step down and up in magnitude, and, from
    zero, the smallest value of the other sign. The values of a format grow with the magnitude
    bits, so if any value is closer to x than `raw`'s, one of these is."""
    layout = LAYOUTS[name]
    sign = 1 << (layout.bits - 1) if layout.sign else 0
    top = sign or 1 << layout.bits
    magnitude = raw & (top - 1)
    patterns = [(raw & sign) | m for m in (magnitude - 1, magnitude + 1) if 0 <= m < top]
    if magnitude == 0 and sign:
        patterns.append((raw ^ sign) | 1)
    return [v for v in map(lambda p: decode(name, p), patterns) if math.isfinite(v)]


# --- facts --------------------------------------------------------------------------------


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


@cache
def _limits(name: str) -> _Limits:
    layout = LAYOUTS[name]
    eps = math.ldexp(1.0, -layout.mantissa)
    if name == "tf32":
        top = 2 ** layout.exponent - 2 - layout.bias  # the all-ones exponent is inf/NaN
        return _Limits(math.ldexp(2.0 - eps, top), math.ldexp(1.0, 1 - layout.bias), eps,
                       "definition", (layout.note,))
    info = torch.finfo(getattr(torch, name))
    notes = (layout.note,) if layout.note else ()
    if info.eps != eps:
        notes += (f"torch.finfo gives eps {info.eps:g}, but with {layout.mantissa} mantissa bits "
                  f"the gap after 1.0 is {eps:g}, shown here",)
    return _Limits(info.max, info.smallest_normal, eps, "torch.finfo", notes)


_BEYOND = {"overflow": "inf", "exact": "inf", "saturated": "max", "nan": "nan"}


@cache
def facts(name: str) -> FormatFacts:
    layout, limits = LAYOUTS[name], _limits(name)
    overflow = _BEYOND[store(str(Decimal(limits.max) * 2), name).status]
    infinity = _BEYOND[store("inf", name).status]
    notes = limits.notes
    if not layout.has_inf:  # torch chooses what happens here; measured above, not assumed
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


def format_facts(names: tuple[str, ...] | None = None) -> tuple[FormatFacts, ...]:
    return tuple(facts(n) for n in names or available_formats())


# --- values -------------------------------------------------------------------------------


def parse_value(text: str) -> tuple[float, Fraction | None]:
    """A decimal string -> (its float64, its exact value; None for inf and NaN)."""
    try:
        d = Decimal(text.strip())
    except InvalidOperation:
        raise AmpscopeError(f"not a number: {text!r} (write e.g. 1e-8, 65504, 0.1, nan, "
                            "-inf)") from None
    if d.is_nan():
        return math.nan, None
    if d.is_infinite():
        return float(d), None
    if d and abs(d.adjusted()) > 400:
        d = (_CLAMP if d.adjusted() > 0 else 1 / _CLAMP).copy_sign(d)
    return float(d), Fraction(d)


def _status(x: float, exact: Fraction | None, q: float, limits: _Limits) -> str:
    if math.isnan(q):
        return "exact" if math.isnan(x) else "nan"
    if exact is None:  # ±inf was written
        return "exact" if q == x else "saturated"
    if math.isinf(q):  # from a finite value, also one that float64 cannot hold (1e309)
        return "overflow"
    if exact == 0:
        return "exact" if q == 0 else "no-zero"
    if q == 0:
        return "underflow"
    if (q < 0) != (exact < 0):
        return "sign-lost"
    if abs(q) == limits.max and abs(exact) > limits.max + limits.max_step / 2:
        return "saturated"  # rounding to nearest would have gone past max
    if abs(q) < limits.smallest_normal:
        return "subnormal"
    return "exact" if q == exact else "rounded"


def _relative(exact: Fraction, q: float) -> float:
    if exact == 0:
        return 0.0 if q == 0 else math.inf
    try:
        return float(abs(Fraction(q) - exact) / abs(exact))
    except OverflowError:  # e.g. 1e-300 stored as 2^-127 by e8m0
        return math.inf


def store(text: str, name: str) -> Stored:
    """How format `name` stores the decimal value `text` (what torch's cast stores, see above)."""
    x, exact = parse_value(text)
    raw = encode(name, x)
    q = decode(name, raw)
    finite = exact is not None and math.isfinite(q)
    nearest = None
    if finite:
        error = abs(Fraction(q) - exact)
        nearest = all(abs(Fraction(v) - exact) >= error for v in neighbours(name, raw))
    return Stored(format=name, value=q, bits=bit_groups(raw, LAYOUTS[name]),
                  status=_status(x, exact, q, _limits(name)),
                  relative_error=_relative(exact, q) if finite else None, nearest=nearest)


def formats_report(values: list[str] | tuple[str, ...] = (),
                   names: tuple[str, ...] | None = None) -> FormatsReport:
    """Facts of every format (or of `names`), and how each stores each of `values`."""
    names = names or available_formats()
    reports = tuple(ValueReport(v, parse_value(v)[0], tuple(store(v, n) for n in names))
                    for v in values)
    return FormatsReport(format_facts(names), reports, skipped_formats())
