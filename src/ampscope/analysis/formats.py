"""Number formats: what each floating-point format can hold, and how it stores a given value.

- `format_facts()` gives each format's layout and limits: `FormatFacts`.
- `store(text, name)` says how one format stores one decimal value: `Stored`.
- `formats_report(values)` gathers both for `ampscope formats [VALUE ...]`.

The layout of each format is written down in `LAYOUTS` (format_table.py) and checked against
`torch.finfo` and torch's own bit decoding in the tests; stored values are what torch's cast
stores, computed on the CPU (`torch.tensor(x, dtype=torch.float64).to(dtype)`, the bits read
back through an integer view). Where the facts come from and why (finfo's eps of
float8_e5m2fnuz, tf32 from its definition, a value rounded twice through float32, what torch
does beyond a format's range, `digits`): docs/formats.md.

Namesakes, the same concern at another layer: `render/formats.py`."""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import cache
from typing import cast

import torch

from ampscope.analysis.format_table import (
    LAYOUTS,
    SCHEMA,
    SKIPPED,
    STATUSES,
    FormatFacts,
    FormatsReport,
    Layout,
    Stored,
    ValueReport,
    _Limits,
    assemble,
    limits,
)
from ampscope.errors import AmpscopeError

__all__ = ["LAYOUTS", "SCHEMA", "SKIPPED", "STATUSES", "FormatFacts", "FormatsReport", "Layout",
           "Stored", "ValueReport", "facts", "format_facts", "formats_report", "store"]
_INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}

# Beyond 1e±400 every format here has long overflowed or underflowed; clamping the exact value
# there keeps Fraction arithmetic cheap (1e-100000000 would build a 40 MB integer) and changes
# no status, stored value or printed error.
_CLAMP = Decimal("1e400")


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
    # (An integer tensor's item() is an int.)
    return cast(int, t.view(_INT_VIEW[bits]).item()) & ((1 << bits) - 1)


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


def _limits(name: str) -> _Limits:
    if name == "tf32":  # not a torch dtype: its limits follow from its definition
        return limits(name, math.nan, math.nan, math.nan)
    info = torch.finfo(getattr(torch, name))
    return limits(name, info.max, info.smallest_normal, info.eps)


_BEYOND = {"overflow": "inf", "exact": "inf", "saturated": "max", "nan": "nan"}


def beyond(name: str) -> tuple[str, str]:
    """What torch's cast makes of a value beyond max, and of +inf: "inf", "max" or "nan"."""
    top = _limits(name).max
    return (_BEYOND[store(str(Decimal(top) * 2), name).status],
            _BEYOND[store("inf", name).status])


@cache
def facts(name: str) -> FormatFacts:
    return assemble(name, _limits(name), *beyond(name))


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
    # The exact value to measure q against: none for inf and NaN, or where q is not finite.
    finite = exact if exact is not None and math.isfinite(q) else None
    nearest = None
    if finite is not None:
        error = abs(Fraction(q) - finite)
        nearest = all(abs(Fraction(v) - finite) >= error for v in neighbours(name, raw))
    return Stored(format=name, value=q, bits=bit_groups(raw, LAYOUTS[name]),
                  status=_status(x, exact, q, _limits(name)),
                  relative_error=_relative(finite, q) if finite is not None else None,
                  nearest=nearest)


def formats_report(values: list[str] | tuple[str, ...] = (),
                   names: tuple[str, ...] | None = None) -> FormatsReport:
    """Facts of every format (or of `names`), and how each stores each of `values`."""
    names = names or available_formats()
    reports = tuple(ValueReport(v, parse_value(v)[0], tuple(store(v, n) for n in names))
                    for v in values)
    return FormatsReport(format_facts(names), reports, skipped_formats(), torch.__version__)
