"""Buffers and positions kept in a 16-bit format: normalisation statistics, rotary tables,
position indices."""

from __future__ import annotations

from collections.abc import Iterator

from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import HALF, count
from ampscope.analysis.findings import listed
from ampscope.records import Trace

_STATISTICS = ("running_mean", "running_var")


@rule("AMP501", "norm-statistics-in-16-bit", "warning",
      "BatchNorm running statistics kept in float16 or bfloat16")
def statistics_in_16_bit(trace: Trace) -> Iterator[Hit]:
    low = [b for b in trace.buffers if b.name.rsplit(".", 1)[-1] in _STATISTICS
           and b.dtype in HALF]
    if not low:
        return
    dtype = low[0].dtype
    bits = 8 if dtype == "bfloat16" else 11
    yield Hit(
        f"BatchNorm's running statistics are kept in {dtype}: "
        f"{listed([b.name for b in low], 3)}.",
        (f"{count(len(low), 'buffer')} in {dtype}",),
        f"the running averages move by momentum × (batch value − average) per step; with "
        f"{bits} significant bits, a change below 2^-{bits} of the average rounds away, so "
        "the statistics stop following the data"
        + (" and a variance above 65504 is inf" if dtype == "float16" else "")
        + "; evaluation then normalises with stale values",
        "keep normalisation layers in float32 (after model.half(), call .float() on every "
        "BatchNorm), or keep float32 weights and run the forward under torch.autocast")


# Buffers that hold rotary position tables, by the names the common codebases give them.
_ROTARY = ("inv_freq", "cos", "sin", "freqs", "freqs_cis", "cos_cached", "sin_cached", "rope")


@rule("AMP502", "rotary-tables-in-16-bit", "note",
      "rotary position tables kept in float16 or bfloat16")
def rotary_in_16_bit(trace: Trace) -> Iterator[Hit]:
    low = [b for b in trace.buffers if b.dtype in HALF
           and any(b.name.rsplit(".", 1)[-1].endswith(k) for k in _ROTARY)]
    if not low:
        return
    dtype = low[0].dtype
    bits = 8 if dtype == "bfloat16" else 11
    frequencies = [b for b in low if "freq" in b.name.rsplit(".", 1)[-1]]
    consequence = (f"each value keeps {bits} significant bits (within 2^-{bits + 1} ≈ "
                   f"{2.0 ** -(bits + 1):.1e} relative of its float32 value)")
    if frequencies:
        consequence += (f"; a frequency rounded so is multiplied by the position: at "
                        f"position p the angle is off by up to p·θ·2^-{bits + 1}, over "
                        f"0.1 rad for the fastest pair (θ = 1) from position "
                        f"{int(0.1 * 2 ** (bits + 1)) + 1}")
    yield Hit(
        f"Rotary position tables are kept in {dtype}: {listed([b.name for b in low], 3)}.",
        (f"{count(len(low), 'buffer')} in {dtype}",),
        consequence,
        "compute the tables in float32 and keep them there (cast the rotated q and k "
        "instead), or accept it as a deliberate saving")


# The largest integer below which every integer is exact: 2^(significand bits).
_EXACT = {"bfloat16": 2 ** 8, "float16": 2 ** 11}


@rule("AMP503", "positions-in-16-bit", "warning",
      "position indices made in float16 or bfloat16 beyond the integers it holds exactly")
def positions_in_16_bit(trace: Trace) -> Iterator[Hit]:
    # torch.arange(T, dtype=torch.bfloat16): its values are 0, 1, ..., T-1 (with start and
    # step, start + k·step); past 2^8 (bfloat16) or 2^11 (float16) neighbours round together.
    found = []
    for o in trace.ops:
        if not o.op.startswith("aten.arange") or not o.outputs:
            continue
        dtype, shape = o.outputs[0].dtype, o.outputs[0].shape
        if dtype not in _EXACT or not shape or shape[0] - 1 <= _EXACT[dtype]:  # 0..T-1
            continue
        found.append(o)
    if not found:
        return
    first = found[0]
    dtype, n = first.outputs[0].dtype, first.outputs[0].shape[0]
    exact = _EXACT[dtype]
    yield Hit(
        f"Positions are made in {dtype}: torch.arange of {n:,} values"
        + (f" at {first.source}" if first.source else "")
        + f", where integers above {exact:,} are not all exact.",
        (f"{count(len(found), 'arange')} returned {dtype} with more than {exact:,} values",),
        f"{dtype} holds every integer up to {exact:,} only: {exact + 1:,} rounds to "
        f"{exact:,}, past {exact:,} only every second position is left and past "
        f"{2 * exact:,} every fourth, so neighbouring tokens get the same position, and the "
        "rotary or sinusoidal embeddings made from them are equal",
        "make positions as integers or float32 (torch.arange(T, dtype=torch.float32)) and cast "
        "what is computed from them, not the positions",
        first.source)
