"""`ampscope formats`: format facts against torch.finfo, torch's decoding and hand-derived
numbers; stored values and bit patterns by hand; rounding properties with hypothesis; the
rendered tables."""

from __future__ import annotations

import io
import json
import math
import struct
from decimal import Decimal
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from rich.console import Console

from ampscope.analysis.formats import (
    SCHEMA,
    STATUSES,
    available_formats,
    facts,
    formats_report,
    parse_value,
    store,
)
from ampscope.errors import AmpscopeError
from ampscope.render.formats import STATUS_WORDS, render_formats

FORMATS = available_formats()
TORCH_FORMATS = [n for n in FORMATS if n != "tf32"]
NARROW = [n for n in TORCH_FORMATS if getattr(torch, n).itemsize <= 2]
UNSIGNED = {n for n in FORMATS if facts(n).sign_bits == 0}  # float8_e8m0fnu
PROPERTY = settings(max_examples=200, deadline=None)


def value_of(name: str, raw: int) -> float:
    """Bit pattern -> value, decoded independently of the module under test: torch reads the raw
    bytes; tf32 is the top 19 bits of a float32."""
    if name == "tf32":
        return struct.unpack(">f", (raw << 13).to_bytes(4, "big"))[0]
    dtype = getattr(torch, name)
    data = bytearray(raw.to_bytes(dtype.itemsize, "little"))
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).item()


def exact(x: float) -> str:
    """x's exact decimal expansion (repr gives the shortest string that reads back as x, which
    is not x: "0.1" is not the float64 0.1000000000000000055...)."""
    return str(Decimal(x))


def raw_of(s) -> int:
    return int(s.bits.replace(" ", ""), 2)


def all_values(name: str) -> torch.Tensor:
    """Every value of an 8- or 16-bit format, as float64."""
    dtype = getattr(torch, name)
    if dtype.itemsize == 1:
        return torch.arange(256).to(torch.uint8).view(dtype).double()
    return (torch.arange(65536) - 32768).to(torch.int16).view(dtype).double()


# --- facts --------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_facts_match_torch_finfo(name):
    f, info = facts(name), torch.finfo(getattr(torch, name))
    assert (f.bits, f.max, f.smallest_normal) == (info.bits, info.max, info.smallest_normal)
    assert f.source == "torch.finfo"
    assert f.smallest_normal == 2.0 ** (1 - f.bias) or name == "float8_e8m0fnu"
    if name == "float8_e5m2fnuz":  # torch's finfo eps is wrong here; we say so and fix it
        assert info.eps == 0.125 and f.eps == 0.25
        assert any("torch.finfo gives eps 0.125" in n for n in f.notes)
    else:
        assert f.eps == info.eps


@pytest.mark.fast
@pytest.mark.parametrize("name", FORMATS)
def test_eps_is_the_gap_after_one(name):
    one = store("1", name)
    assert one.status == "exact"
    assert value_of(name, raw_of(one) + 1) - 1.0 == facts(name).eps


@pytest.mark.parametrize("name", NARROW)
def test_facts_match_every_value_of_the_format(name):
    f, values = facts(name), all_values(name)
    finite = values[values.isfinite()]
    assert finite.max().item() == f.max and finite.min().item() == (-f.max if f.sign_bits else
                                                                  f.smallest_normal)
    smallest = finite[finite > 0].min().item()
    assert smallest == (f.smallest_subnormal or f.smallest_normal)
    assert values.isinf().any().item() == f.has_inf
    assert values.isnan().any().item() == f.has_nan


@pytest.mark.fast
def test_hand_derived_facts():
    assert facts("float16").max == 65504 and facts("float16").smallest_subnormal == 2.0 ** -24
    assert facts("float16").smallest_normal == 2.0 ** -14
    assert facts("bfloat16").eps == 2.0 ** -7
    assert facts("float8_e4m3fn").max == 448 and facts("float8_e5m2").max == 57344
    tf32 = facts("tf32")
    assert (tf32.sign_bits, tf32.exponent_bits, tf32.mantissa_bits) == (1, 8, 10)
    assert tf32.eps == 2.0 ** -10 and tf32.source == "definition"
    assert tf32.max == (2 - 2.0 ** -10) * 2.0 ** 127
    assert tf32.smallest_normal == facts("float32").smallest_normal == 2.0 ** -126
    assert tf32.smallest_subnormal == 2.0 ** -136
    assert facts("float32").digits == pytest.approx(23 * math.log10(2))
    assert facts("float64").digits == pytest.approx(-math.log10(facts("float64").eps))


@pytest.mark.fast
def test_out_of_range_behaviour_is_what_torch_does():
    assert (facts("float16").overflow, facts("float16").infinity) == ("inf", "inf")
    # torch's float8_e4m3fn cast saturates, inf included (there is no inf to go to)
    assert torch.tensor(1e6).to(torch.float8_e4m3fn).float().item() == 448
    assert (facts("float8_e4m3fn").overflow, facts("float8_e4m3fn").infinity) == ("max", "max")
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        if name in FORMATS:
            assert (facts(name).overflow, facts(name).infinity) == ("nan", "nan")


# --- stored values ------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("text, name, bits", [
    ("1.0", "bfloat16", "0 01111111 0000000"),
    ("-2.0", "float16", "1 10000 0000000000"),
    ("448", "float8_e4m3fn", "0 1111 110"),
    ("57344", "float8_e5m2", "0 11110 11"),
    ("1.0", "tf32", "0 01111111 0000000000"),
    ("-0.0", "float32", "1 00000000 00000000000000000000000"),
    ("1", "float64", "0 01111111111 " + "0" * 52),
    ("0.5", "float8_e8m0fnu", "01111110"),
    ("nan", "float8_e4m3fn", "0 1111 111"),
    ("-inf", "float16", "1 11111 0000000000"),
])
def test_hand_derived_bit_patterns(text, name, bits):
    assert store(text, name).bits == bits


@pytest.mark.fast
def test_the_issue_example_1e_minus_8():
    fp16, bf16 = store("1e-8", "float16"), store("1e-8", "bfloat16")
    assert (fp16.value, fp16.status, fp16.relative_error) == (0.0, "underflow", 1.0)
    # 1e-8 = 1.3422·2^-27; 7 mantissa bits: 172/128·2^-27
    assert bf16.value == 172 / 128 * 2.0 ** -27 == 1.0011717677116394e-08
    assert bf16.status == "rounded" and bf16.relative_error == pytest.approx(1.1717677e-3)
    text = rendered(["1e-8"])
    assert "1.0012e-08" in row(text, "bf16", 1)
    assert "underflow → 0" in row(text, "fp16", 1)


@pytest.mark.fast
@pytest.mark.parametrize("text, name, value, status", [
    ("65504", "float16", 65504, "exact"),
    ("65519", "float16", 65504, "rounded"),  # below the midpoint 65520
    ("65520", "float16", math.inf, "overflow"),  # the midpoint: ties to even, past max
    ("1e-6", "float16", 1.0132789611816406e-06, "subnormal"),
    ("1e39", "float32", math.inf, "overflow"),
    ("1e39", "float64", 1e39, "rounded"),  # 1e39 is no float64 either
    ("1e309", "float64", math.inf, "overflow"),
    ("0.5", "float64", 0.5, "exact"),
    ("464", "float8_e4m3fn", 448, "rounded"),  # midpoint of 448 and 480: ties to even
    ("465", "float8_e4m3fn", 448, "saturated"),
    ("inf", "float8_e4m3fn", 448, "saturated"),
    ("-1e6", "float8_e4m3fn", -448, "saturated"),
    ("inf", "bfloat16", math.inf, "exact"),
    ("-0", "float8_e4m3fnuz", 0.0, "exact"),
    ("1e-8", "float8_e5m2", 0.0, "underflow"),
    ("1e-5000", "float64", 0.0, "underflow"),
    ("1e5000", "float8_e4m3fn", 448, "saturated"),
])
def test_stored_value_and_status(text, name, value, status):
    s = store(text, name)
    assert (s.value, s.status) == (value, status)


@pytest.mark.fast
def test_nan_and_sign_quirks():
    assert math.isnan(store("nan", "float16").value) and store("nan", "float16").status == "exact"
    assert store("300", "float8_e4m3fnuz").status == "nan"
    assert store("-inf", "float8_e5m2fnuz").status == "nan"
    if "float8_e8m0fnu" in FORMATS:  # no sign, no zero: torch keeps |x|, 0 becomes 2^-127
        minus = store("-2", "float8_e8m0fnu")
        assert (minus.value, minus.status, minus.nearest) == (2.0, "sign-lost", False)
        zero = store("0", "float8_e8m0fnu")
        assert (zero.value, zero.status, zero.relative_error) == (2.0 ** -127, "no-zero", math.inf)
        assert store("1.5", "float8_e8m0fnu").value == 2.0  # ties up: 1.5 is the midpoint


@pytest.mark.fast
def test_torch_rounds_twice_through_float32_and_we_say_so():
    # 1 + 2^-8 + 2^-30 is a float64; torch casts it to float32 first (1 + 2^-8, a bf16 tie,
    # to even: 1.0), though 1 + 2^-7 is nearer
    s = store(exact(1 + 2.0 ** -8 + 2.0 ** -30), "bfloat16")
    assert (s.value, s.status, s.nearest) == (1.0, "rounded", False)
    s = store(exact(1 + 2.0 ** -11 + 2.0 ** -40), "float16")
    assert (s.value, s.nearest) == (1.0, False)
    # the same from a decimal that float64 itself rounds to the tie
    assert store("1.0039062500000001", "bfloat16").nearest is False
    assert store("1.0039062500000001", "float32").nearest is True
    assert "(not nearest)" in row(rendered(["1.0039062500000001"]), "bf16", 1)


@pytest.mark.fast
def test_tf32_rounds_float32_to_nearest_even():
    assert store(exact(1 + 2.0 ** -11), "tf32").value == 1.0  # tie, to even
    assert store(exact(1 + 3 * 2.0 ** -11), "tf32").value == 1 + 2.0 ** -9  # tie, to even (up)
    assert store(exact(1 + 2.0 ** -11 + 2.0 ** -20), "tf32").value == 1 + 2.0 ** -10
    assert store(exact(facts("tf32").max * (1 + 2.0 ** -11)), "tf32").status == "overflow"


@pytest.mark.fast
def test_parse_value():
    assert parse_value("0.1") == (0.1, Fraction(1, 10))
    assert parse_value("-inf") == (-math.inf, None)
    assert math.isnan(parse_value("nan")[0])
    with pytest.raises(AmpscopeError, match="not a number"):
        parse_value("abc")


# --- properties ---------------------------------------------------------------------------


@st.composite
def format_and_float32(draw):
    name = draw(st.sampled_from(FORMATS))
    x = draw(st.floats(width=32, allow_nan=False, allow_infinity=False))
    return name, abs(x) if name in UNSIGNED else x


@PROPERTY
@given(format_and_float32())
def test_no_representable_value_is_closer(case):
    """From a float32 torch rounds once, so the result is the nearest value (ties aside, which
    `<` allows); neighbours are the patterns one magnitude step either side, and across 0."""
    name, x = case
    # torch's e8m0 cast reads a float32's exponent field: a float32 subnormal (below 2^-126)
    # goes up to 2^-126, not to the nearer 2^-127 (see the test below).
    assume(not (name == "float8_e8m0fnu" and abs(x) < 2.0**-126))
    s = store(exact(x), name)
    assume(math.isfinite(s.value))
    raw, sign = raw_of(s), 1 << (facts(name).bits - 1) if facts(name).sign_bits else 0
    size = sign or 1 << facts(name).bits
    magnitude = raw & (size - 1)
    patterns = [(raw & sign) | m for m in (magnitude - 1, magnitude + 1) if 0 <= m < size]
    patterns += [(raw ^ sign) | 1] if sign and magnitude == 0 else []
    error = abs(Fraction(s.value) - Fraction(x))
    for v in map(lambda p: value_of(name, p), patterns):
        assert not (math.isfinite(v) and abs(Fraction(v) - Fraction(x)) < error), (name, x, v)
    assert s.nearest is True


@pytest.mark.fast
def test_e8m0_of_a_float32_subnormal_is_not_the_nearest_value():
    s = store("6.9e-39", "float8_e8m0fnu")  # between 2^-127 (5.9e-39) and 2^-126 (1.2e-38)
    assert s.value == 2.0**-126 and s.nearest is False


@st.composite
def format_and_two_values(draw):
    name = draw(st.sampled_from(FORMATS))
    top = facts(name).max
    values = st.floats(min_value=0.0 if name in UNSIGNED else -top, max_value=top)
    return name, sorted([draw(values), draw(values)])


@PROPERTY
@given(format_and_two_values())
def test_rounding_is_monotonic(case):
    name, (x, y) = case
    assert store(exact(x), name).value <= store(exact(y), name).value


@PROPERTY
@given(st.sampled_from(FORMATS).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, 2 ** facts(n).bits - 1))))
def test_representable_values_round_trip(case):
    name, raw = case
    v = value_of(name, raw)
    assume(not math.isnan(v))
    s = store(exact(v), name)
    assert (s.value, raw_of(s)) == (v, raw) or (v == 0 and s.value == 0)  # 0 and -0: same bits
    assert s.status in ("exact", "subnormal")
    assert s.relative_error in (0.0, None)


@PROPERTY
@given(st.floats(min_value=6.2e-5, max_value=65000))
def test_tf32_equals_fp16_where_fp16_is_normal(x):
    """Both keep 10 mantissa bits and round float32 to nearest even: an independent oracle."""
    x = float(torch.tensor(x, dtype=torch.float32))  # fp16 and tf32 both start from float32
    assert store(exact(x), "tf32").value == store(exact(x), "float16").value


# --- report and rendering -----------------------------------------------------------------


@pytest.mark.fast
def test_report_dict_is_strict_json():
    data = formats_report(["1e-8", "nan", "-inf", "1e39"]).to_dict()
    text = json.dumps(data, allow_nan=False)
    assert data["schema"] == SCHEMA == "ampscope.formats/1"
    assert [f["name"] for f in data["formats"]][:7] == [
        "float64", "float32", "tf32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]
    stored = {s["format"]: s for s in data["values"][0]["stored"]}
    assert stored["float16"]["status"] == "underflow"
    assert stored["bfloat16"]["bits"] == "0 01100100 0101100"
    assert data["values"][2]["stored"][0]["value"] == "-inf" and '"nan"' in text
    assert {s["name"] for s in data["skipped"]} <= {"float4_e2m1fn_x2"}


def rendered(values: list[str]) -> str:
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(render_formats(formats_report(values)))
    return out.getvalue()


def row(text: str, name: str, table: int) -> str:
    """The row of format `name` in the table-th table of rendered text (0: the facts)."""
    bodies: list[list[str]] = []  # the lines after each header rule
    for line in text.splitlines():
        if line.startswith("━"):
            bodies.append([])
        elif bodies:
            bodies[-1].append(line)
    return next(line for line in bodies[table] if line.startswith(f"{name} "))


@pytest.mark.fast
def test_facts_table_fits_100_columns():
    text = rendered([])
    assert "…" not in text and max(map(len, text.splitlines())) <= 100
    assert row(text, "fp16", 0).split("│")[3].strip() == "65504"
    assert row(text, "fp8e4m3", 0).split("│")[-1].strip() == "±max"
    assert "torch's cast turns values that round beyond ±448 into ±448, and ±inf into ±448" in text


@pytest.mark.fast
def test_every_status_has_words():
    assert set(STATUS_WORDS) == set(STATUSES)


@pytest.mark.fast
def test_value_table_rows():
    text = rendered(["448"])
    cells = [c.strip() for c in row(text, "fp8e4m3", 1).split("│")]
    assert cells == ["fp8e4m3", "448", "0", "exact", "0 1111 110"]
    cells = [c.strip() for c in row(text, "fp8e4m3fnuz", 1).split("│")]
    assert cells[1:4] == ["nan", "—", "→ NaN"]
    text = rendered(["-1e-8"])  # fp16 keeps the sign of what underflowed; fnuz has no -0
    assert row(text, "fp16", 1).split("│")[1].strip() == "-0"
    assert row(text, "fp8e4m3fnuz", 1).split("│")[1].strip() == "0"


@pytest.mark.fast
def test_negative_values_reach_formats_also_after_debug(capsys):
    from ampscope.cli import main

    assert main(["--debug", "formats", "-inf", "--json", "-"]) == 0
    assert '"-inf"' in capsys.readouterr().out


@pytest.mark.fast
def test_the_measured_table_is_what_this_torch_answers():
    """`ampscope formats` without values reads format_table.MEASURED (no torch import) when the
    installed torch is the build it was measured on: each row must be finfo's figures and the
    casts' behaviour beyond max as torch gives them here."""
    from importlib.metadata import version

    from ampscope.analysis import format_table
    from ampscope.analysis.formats import beyond

    if version("torch") != format_table.MEASURED_ON:
        assert format_table.measured_report() is None  # another build: measured afresh
        return
    assert tuple(format_table.MEASURED) == FORMATS
    for name, row in format_table.MEASURED.items():
        assert (row.overflow, row.infinity) == beyond(name), name
        if name != "tf32":
            info = torch.finfo(getattr(torch, name))
            assert (row.max, row.smallest_normal, row.finfo_eps) == (
                info.max, info.smallest_normal, info.eps), name
    assert format_table.measured_report().to_dict() == formats_report().to_dict()
