"""`ampscope formats`: one table of format facts, then one table per value. Reads reports only.

Namesakes, the same concern at another layer: `analysis/formats.py`."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ampscope.analysis.format_table import FormatFacts, FormatsReport, Stored, ValueReport
from ampscope.render.style import DTYPE_STYLES, SHORT_DTYPES, titled_table

# The formats style.py has no short name for (yet), in the same spelling.
_MORE_SHORT = {"tf32": "tf32", "float8_e4m3fnuz": "fp8e4m3fnuz",
               "float8_e5m2fnuz": "fp8e5m2fnuz", "float8_e8m0fnu": "fp8e8m0"}
STATUS_WORDS = {  # status -> (words, style)
    "exact": ("exact", "green"), "rounded": ("rounded", ""), "subnormal": ("subnormal", "yellow"),
    "underflow": ("underflow → 0", "bold red"), "overflow": ("overflow → inf", "bold red"),
    "saturated": ("saturated", "bold red"), "nan": ("→ NaN", "bold red"),
    "sign-lost": ("sign lost", "bold red"), "no-zero": ("no zero", "bold red"),
}
_BEYOND = {"inf": "inf", "max": "±max", "nan": "NaN"}


def format_name(name: str) -> Text:
    return Text(SHORT_DTYPES.get(name) or _MORE_SHORT.get(name, name),
                style=DTYPE_STYLES.get(name, "yellow"))


def _number(x: float | None, digits: int = 3) -> str:
    """`x` to `digits` significant digits as Python's `g` writes it ("1.0012e-08"), but whole
    numbers below a million in full (65504, not 6.55e+04), and -0 as -0."""
    if x is None:
        return "—"
    if x.is_integer() and abs(x) < 1e6:
        return "-0" if x == 0 and math.copysign(1, x) < 0 else str(int(x))
    return f"{x:.{digits}g}"


def _compact(x: float | None) -> str:
    """`_number`, shorter: exponents without "+" and leading zeros (1.8e308, 9.77e-4), whichever
    of the plain and the exponent form is shorter, so the facts table fits 100 columns."""
    plain = _number(x)
    if x is None or x.is_integer() and abs(x) < 1e6:
        return plain
    mantissa, _, exponent = f"{x:.2e}".partition("e")
    short = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return short if len(short) < len(plain) else plain


def facts_table(formats: tuple[FormatFacts, ...]) -> Table:
    numbers = ("s/e/m", "bias", "max", "min\nnormal", "min\nsubnormal", "eps", "digits")
    table = titled_table("Formats", ("format", {"no_wrap": True}), *numbers, "inf NaN", "> max",
                         right=numbers, pad_edge=False)
    for f in formats:
        specials = " ".join(s for s, has in (("inf", f.has_inf), ("NaN", f.has_nan)) if has)
        table.add_row(format_name(f.name), f"{f.sign_bits}/{f.exponent_bits}/{f.mantissa_bits}",
                      str(f.bias), _compact(f.max), _compact(f.smallest_normal),
                      _compact(f.smallest_subnormal), _compact(f.eps), f"{f.digits:.2f}",
                      specials or "—", _BEYOND[f.overflow])
    return table


def _shown_digits(f: FormatFacts) -> int:
    """Enough significant digits to tell a value from its neighbours (IEEE's round-trip count,
    ceil(p·log10 2) + 1 for p significand bits), and never fewer than 5, so that a bf16 or fp8
    value does not print as the decimal it came from."""
    return max(5, math.ceil((f.mantissa_bits + 1) * math.log10(2)) + 1)


def _status(s: Stored) -> Text:
    words, style = STATUS_WORDS[s.status]
    text = Text(words, style=style)
    if s.nearest is False and s.status != "sign-lost":
        text.append(" (not nearest)", style="yellow")
    return text


def value_table(report: ValueReport, formats: dict[str, FormatFacts]) -> Table:
    table = titled_table(f"Value {report.text}", "format", "stored", "rel. error", "status",
                         ("bits: sign exponent mantissa", {"overflow": "fold"}),
                         right=("stored", "rel. error"), pad_edge=False)
    for s in report.stored:
        table.add_row(format_name(s.format), _number(s.value, _shown_digits(formats[s.format])),
                      _number(s.relative_error), _status(s), s.bits)
    return table


def notes_table(report: FormatsReport) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column()
    for f in report.formats:
        for note in f.notes:
            table.add_row(format_name(f.name), note)
    for name, reason in report.skipped:
        table.add_row(Text(name, style="dim"), Text(f"left out: {reason}", style="dim"))
    return table


def render_formats(report: FormatsReport) -> RenderableType:
    parts: list[RenderableType] = [facts_table(report.formats), Text(), notes_table(report),
                                   Text()]
    by_name = {f.name: f for f in report.formats}
    for value in report.values:
        parts += [value_table(value, by_name), Text()]
    return Group(*parts)
