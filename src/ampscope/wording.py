"""How ampscope words a byte count, an op's name and a GPU's article, in every layer.

A report's notes (distributed/verdicts.py: a rank's peak against a GPU's memory), the Trace
Event timeline's slice names (records/perfetto.py) and every view (render/style.py re-exports
both) say a size or an op the same way. It imports nothing, not even torch: `ampscope formats`
and the other answers that start without torch show sizes through render/style.py.
"""

from __future__ import annotations


def short_op(op: str) -> str:
    """"aten.addmm.default" -> "addmm"; "aten.add.Tensor" -> "add.Tensor"."""
    return op.removeprefix("aten.").removesuffix(".default")


def format_bytes(n: int | None) -> str:
    """Binary units, three significant digits: 1536 -> "1.5 KiB", 2**40 -> "1,024 GiB"."""
    if n is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:,.0f} {unit}" if abs(value) >= 1000 else f"{value:.3g} {unit}"
    return f"{n} B"


def article(name: str) -> str:
    """"an" before a name read letter by letter from a vowel sound (an H100, an L4), else "a"
    (a B200)."""
    return "an" if name[:1].upper() in "AEFHILMNORSX" else "a"
