"""The user's own figures: a TOML table merged over `KNOWN` (`table()`), and `--peak-flops` /
`--memory` figures given on a command line (`with_figures`); `lookup` and `by_name` find an
accelerator in the merged table."""

from __future__ import annotations

import math
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TypedDict

from ampscope.errors import AmpscopeError
from ampscope.hardware.device_types import DEVICE_TYPES
from ampscope.hardware.kernels import check_overrides
from ampscope.hardware.known import DTYPES, KNOWN, Accelerator

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, released apart before 3.11
    import tomli as tomllib

# Short dtype names people write ("bf16=989e12"), beside the names of `DTYPES`.
DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "tf32": "tf32", "bf16": "bfloat16",
                 "fp16": "float16", "fp8": "float8"} | {d: d for d in DTYPES}
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9][0-9_.]*(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_USER_KEYS = {"title", "patterns", "peak_flops", "memory", "bandwidth", "tf32_matmuls",
              "multiprocessors", "capability", "kernels"}
_CAPABILITY = re.compile(r"\s*([0-9]+)\.([0-9]+)\s*")


def user_table_path() -> Path:
    """`AMPSCOPE_HARDWARE` when set, else ampscope/hardware.toml in the user's config folder
    ($XDG_CONFIG_HOME, by default ~/.config)."""
    explicit = os.environ.get("AMPSCOPE_HARDWARE")
    if explicit:
        return Path(explicit).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "ampscope" / "hardware.toml"


def table() -> tuple[Accelerator, ...]:
    """`KNOWN` with the user's file merged over it: an entry named like a built-in one replaces
    the figures it gives (peaks dtype by dtype) and keeps the others; a new name is added. The
    user's entries come first, so their patterns are matched before the built-in ones."""
    path = user_table_path()
    named = bool(os.environ.get("AMPSCOPE_HARDWARE"))
    # Named by the variable, the path is quoted as the user set it; else the default place.
    where = f"AMPSCOPE_HARDWARE={str(path)!r}" if named else str(path)
    text = _table_text(path, where)
    if text is None:
        if named:
            raise AmpscopeError(f"{where}: no such file")
        return KNOWN
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise AmpscopeError(f"the hardware table {path} is not valid TOML: {e} (fix it, or "
                            "remove it)") from None
    builtin = {a.name: a for a in KNOWN}
    user = tuple(_user_entry(path, name.lower(), entry, builtin.get(name.lower()))
                 for name, entry in data.items())
    names = {a.name for a in user}
    return (*user, *(a for a in KNOWN if a.name not in names))


# What a path that is there but no regular file is, by its stat mode (`_table_text`).
_NOT_REGULAR = ((stat.S_ISDIR, "a folder, not a TOML file"),
                (stat.S_ISFIFO, "a FIFO, not a regular file"),
                (stat.S_ISCHR, "a character device, not a regular file"),
                (stat.S_ISBLK, "a block device, not a regular file"),
                (stat.S_ISSOCK, "a socket, not a regular file"))


def _table_text(path: Path, where: str) -> str | None:
    """The text of the user's table; None when there is no file at `path`. Anything else that
    is there (a folder, a FIFO, a device) is refused in one line naming it (`where`). It is
    opened non-blocking and checked on the open descriptor, not by its name first: opening or
    reading a FIFO would otherwise wait for a writer, and the name could change in between."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:  # where a folder cannot be opened at all
        raise AmpscopeError(f"{where}: a folder, not a TOML file") from None
    except OSError as e:
        raise AmpscopeError(f"cannot read the hardware table {path}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # (a file object refuses a folder's descriptor: checked first)
        os.close(fd)
        what = next((w for test, w in _NOT_REGULAR if test(mode)), "not a regular file")
        raise AmpscopeError(f"{where}: {what}")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise AmpscopeError(f"cannot read the hardware table {path}: {e}") from None


class _Figures(TypedDict):
    """The fields of an `Accelerator` that a user's entry sets or inherits (`_user_entry`): typed
    apart from `name` so that they can be passed to `Accelerator` and `replace` alike."""

    peak_flops: Mapping[str, float]
    memory_bytes: int | None
    bandwidth_bytes_per_s: float | None
    sources: Mapping[str, str]
    patterns: tuple[str, ...]
    title: str
    tf32_matmuls: bool
    multiprocessors: int | None
    capability: tuple[int, int] | None
    kernels: Mapping[str, float]


def _user_entry(path: Path, name: str, entry: object, base: Accelerator | None) -> Accelerator:
    where = f"{path}: [{name}]"
    if not isinstance(entry, dict):
        # A plain string (no f-prefix): its braces are printed as written, single.
        raise AmpscopeError(f"{where} must be a table of figures, e.g. [{name}] with "
                            "memory = \"48GiB\" and peak_flops = { bf16 = 155e12 }")
    unknown = sorted(set(entry) - _USER_KEYS)
    if unknown:
        raise AmpscopeError(f"{where}: unknown key {unknown[0]!r}; known: "
                            f"{', '.join(sorted(_USER_KEYS))}")
    try:
        peaks = _peaks(entry.get("peak_flops", {}))
        memory = parse_size(str(entry["memory"])) if "memory" in entry else None
        bandwidth = _positive(entry["bandwidth"], "bandwidth") if "bandwidth" in entry else None
        patterns = entry.get("patterns", [])
        if not (isinstance(patterns, list) and all(isinstance(p, str) for p in patterns)):
            raise AmpscopeError("patterns must be a list of regular expressions")
        for pattern in patterns:
            re.compile(pattern)
        kernels = entry.get("kernels", {})
        if not isinstance(kernels, dict):
            raise AmpscopeError("kernels must be a table, e.g. { gemm_bfloat16 = 0.9 }")
        kernels = check_overrides(kernels)
        capability = _capability(entry["capability"]) if "capability" in entry else None
    except (AmpscopeError, re.error) as e:
        raise AmpscopeError(f"{where}: {e}") from None
    if base is None and (memory is None or not peaks):
        raise AmpscopeError(f"{where}: a new accelerator needs memory and peak_flops")
    given = [*(f for f in ("memory", "bandwidth", "capability") if f in entry), *peaks,
             *(f"kernels.{k}" for k in kernels)]
    # (A new accelerator, base None, has a memory: refused above otherwise.)
    figures: _Figures = {
        "peak_flops": {**(base.peak_flops if base else {}), **peaks},
        "memory_bytes": memory if memory is not None or base is None else base.memory_bytes,
        "bandwidth_bytes_per_s": bandwidth if bandwidth is not None or base is None
        else base.bandwidth_bytes_per_s,
        "sources": {**(base.sources if base else {}), **dict.fromkeys(given, str(path))},
        "patterns": tuple(patterns) or (base.patterns if base else ()),
        "title": str(entry.get("title", base.title if base else name)),
        "tf32_matmuls": bool(entry.get("tf32_matmuls", base.tf32_matmuls if base else False)),
        "multiprocessors": entry.get("multiprocessors", base.multiprocessors if base else None),
        # Optional: without one, a new entry is no virtual cuda device (runtime/virtual_device.py).
        "capability": capability if capability is not None or base is None else base.capability,
        "kernels": {**(base.kernels if base else {}), **kernels},
    }
    return replace(base, **figures) if base else Accelerator(name=name, **figures)


def _capability(value: object) -> tuple[int, int]:
    """A compute capability as a user writes it, "8.0" or [8, 0], as (8, 0)."""
    match = _CAPABILITY.fullmatch(value) if isinstance(value, str) else None
    if match:
        return int(match.group(1)), int(match.group(2))
    if isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return value[0], value[1]
    raise AmpscopeError(f"capability must be \"MAJOR.MINOR\" or [MAJOR, MINOR], e.g. \"8.0\" "
                        f"or [8, 0], not {value!r}")


def _positive(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise AmpscopeError(f"{what} must be a positive number, not {value!r}")
    return float(value)


def _peaks(peaks: object) -> dict[str, float]:
    if not isinstance(peaks, dict):
        raise AmpscopeError("peak_flops must be a table, e.g. { bf16 = 989e12, fp32 = 67e12 }")
    out = {}
    for dtype, value in peaks.items():
        if dtype.lower() not in DTYPE_ALIASES:
            raise AmpscopeError(f"unknown dtype {dtype!r} in peak_flops; known: "
                                f"{', '.join(DTYPE_ALIASES)}")
        out[DTYPE_ALIASES[dtype.lower()]] = _positive(value, f"peak_flops {dtype}")
    return out


def parse_peak_flops(text: str) -> dict[str, float]:
    """"bf16=989e12,fp32=67e12" -> {"bfloat16": 9.89e14, "float32": 6.7e13} (FLOP/s)."""
    peaks = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        dtype, sep, value = item.partition("=")
        if not sep:
            raise AmpscopeError(f"--peak-flops {text!r}: write DTYPE=FLOPS pairs, e.g. "
                                "bf16=989e12,fp32=67e12")
        try:
            peaks[dtype.strip()] = float(value)
        except ValueError:
            raise AmpscopeError(f"--peak-flops {text!r}: {value.strip()!r} is not a number of "
                                "FLOP/s (write e.g. 989e12)") from None
    if not peaks:
        raise AmpscopeError("--peak-flops needs DTYPE=FLOPS pairs, e.g. bf16=989e12,fp32=67e12")
    try:
        return _peaks(peaks)
    except AmpscopeError as e:
        raise AmpscopeError(f"--peak-flops {text!r}: {e}") from None


def parse_size(text: str) -> int:
    """"80GiB" -> 85899345920: bytes, with B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB
    (powers of 1024; what nvidia-smi's "MiB" and a GPU's "80GB" mean)."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    try:
        size = float(match.group(1)) * _SIZE_UNITS[unit or "b"] if match else math.nan
    except (KeyError, ValueError):
        size = math.nan
    if not (math.isfinite(size) and size >= 1):
        raise AmpscopeError(f"{text!r} is not a size: write e.g. 80GiB, 40GB or 1e9 (bytes; "
                            "units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(size)


def with_figures(base: Accelerator | None, *, peak_flops: Mapping[str, float] | None = None,
                 memory_bytes: int | None = None) -> Accelerator | None:
    """`base` with the figures given on a command line put over its own (peaks dtype by dtype);
    without a base, an accelerator of only these figures, named "custom"."""
    if not peak_flops and memory_bytes is None:
        return base
    given = dict.fromkeys([*(peak_flops or {}), *(["memory"] if memory_bytes else [])],
                          "the command line")
    if base is None:
        return Accelerator(name="custom", title="the given accelerator", patterns=(),
                           peak_flops=dict(peak_flops or {}), memory_bytes=memory_bytes,
                           bandwidth_bytes_per_s=None, sources=given)
    return replace(base, peak_flops={**base.peak_flops, **(peak_flops or {})},
                   memory_bytes=base.memory_bytes if memory_bytes is None else memory_bytes,
                   sources={**base.sources, **given})


def lookup(device_name: str) -> Accelerator | None:
    """The accelerator `torch.cuda.get_device_name()` names, or None when it is not in the table.

    Entries are tried in `table()` order (the user's first, then `KNOWN`), so the first match is
    the most specific one.
    """
    name = device_name.strip()
    for accelerator in table():
        if any(re.search(p, name, re.IGNORECASE) for p in accelerator.patterns):
            return accelerator
    return None


def by_name(name: str) -> Accelerator:
    """The accelerator with this short name ("h100", "a100-40gb", "rtx4090"), for `--gpu`."""
    known = {a.name: a for a in reversed(table())}  # a user entry wins over a built-in one
    try:
        return known[name.strip().lower()]
    except KeyError:
        raise AmpscopeError(f"unknown accelerator {name!r}; known: {', '.join(sorted(known))} "
                            f"(add your own to {user_table_path()})") from None


def stood_for(device: str, gpu: str | None) -> Accelerator | None:
    """The accelerator a run on `device` stood for: `gpu` (a setting's record of it) where the
    table has it, else the device type's default (a trace recorded where a hardware.toml named
    one, read where none does); None for a device type without one."""
    if gpu:
        try:
            return by_name(gpu)
        except AmpscopeError:
            pass
    kind = DEVICE_TYPES.get(device.partition(":")[0])
    return by_name(kind.accelerator) if kind is not None and kind.accelerator else None
