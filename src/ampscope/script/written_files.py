"""The files a script writes, watched while it runs.

Three jobs, one place: what it wrote (through Python's `open`, which `np.save`, `json.dump`,
loggers and `torch.distributed.checkpoint` use, and the C-level savers `open` does not see),
what it left open, and what a predicted run must not write; what the notes then say, and why,
in docs/cli.md (the paragraph "The script's files are its own"). The file objects it opened are
kept (weakly) so that, when the run stops, the ones still open are flushed and closed as the
interpreter would at exit: a log it wrote before `--steps` stopped it is on disk, complete.

The savers are looked up when the run starts: a script that imports safetensors or
`torch.distributed.checkpoint` itself gets the watched functions, as they are module attributes.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import io
import os
import stat
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ampscope.nested import tensors_in
from ampscope.patches import patched
from ampscope.render.style import format_bytes
from ampscope.runs.source import user_source
from ampscope.torchcompat.fake import FakeTensor

# Savers that write tensors to a path from C or Rust, unseen by `open`: (module, function,
# the keyword of the object saved, which each takes first, that of the path, which each takes
# second). Only modules already importable are watched, and only while the script runs.
# How each is named in the report comes last.
_SAVERS: tuple[tuple[str, str, str, str, str], ...] = (
    ("torch", "save", "obj", "f", "torch.save"),
    ("safetensors.torch", "save_file", "tensors", "filename", "save_file"),
    ("safetensors.torch", "save_model", "model", "filename", "save_model"),
    ("torch.distributed.checkpoint", "save", "state_dict", "checkpoint_id", "dcp.save"),
    ("torch.distributed.checkpoint", "save_state_dict", "state_dict", "storage_writer",
     "dcp.save_state_dict"),
)


@dataclass
class Written:
    """One file the script wrote, and how."""

    path: str
    how: str  # "created", "replaced", "appended to", "modified"


@dataclass
class Skipped:
    """A save of fake tensors that a predicted run did not perform."""

    call: str  # "torch.save(..., 'ckpt.pt')"
    where: str | None  # the script's line
    by_dtype: dict[str, int]  # the bytes it held


@dataclass
class ScriptFiles:
    """What the script wrote, left open, and (predicted) was kept from writing."""

    predict: bool
    written: list[Written] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    opened: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    _seen: set[str] = field(default_factory=set)
    # Paths are shown relative to where the run started, whatever folder the script moved to.
    _cwd: str = field(default_factory=os.getcwd)

    def wrote(self, path: object, how: str) -> None:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return  # a file descriptor or a file object: no name to show
        name = os.path.abspath(os.fsdecode(os.fspath(path)))
        if name in self._seen or _not_the_users(name):
            return
        self._seen.add(name)
        self.written.append(Written(name, how))

    def close_what_is_open(self) -> None:
        """Flush and close the files the script left open, as the interpreter does at exit."""
        for f in list(self.opened):
            if f in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                continue
            with contextlib.suppress(Exception):  # as at exit: a failing close is not ours
                if not f.closed:
                    f.close()

    def notes(self) -> list[str]:
        lines = []
        for s in self.skipped:
            dtypes = ", ".join(f"{d} {format_bytes(n)}" for d, n in
                               sorted(s.by_dtype.items(), key=lambda kv: -kv[1]))
            at = f" at {s.where}" if s.where else ""
            lines.append(f"{s.call}{at} was not written: it held "
                         f"{format_bytes(sum(s.by_dtype.values()))} of fake tensors ({dtypes}), "
                         "which have no values (predict mode); a file already there was left "
                         "as it was.")
        # A temporary file the script (or a library) removed again is not listed.
        self.written = [w for w in self.written if os.path.exists(w.path)]
        if self.written:
            listed = "; ".join(f"{_shown(w.path, self._cwd)} ({w.how})" for w in self.written[:20])
            more = f"; and {len(self.written) - 20} more" if len(self.written) > 20 else ""
            lines.append(f"The script wrote {_count(len(self.written))}: {listed}{more}.")
        return lines


def _count(n: int) -> str:
    return "1 file" if n == 1 else f"{n:,} files"


def _shown(path: str, cwd: str) -> str:
    relative = os.path.relpath(path, cwd)
    return path if relative.startswith(os.pardir) else relative


# Folders of caches that libraries keep on the script's behalf (compiled kernels, bytecode):
# not what a user means by the files a script wrote.
_CACHES = ("__pycache__", ".cache", ".triton")


def _not_the_users(path: str) -> bool:
    """Special files (a FIFO, a device, /proc) and caches: not listed."""
    if path.startswith(("/proc/", "/sys/", "/dev/")):
        return True
    parts = path.split(os.sep)
    if any(p in _CACHES or p.startswith("torchinductor_") for p in parts):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False  # not there yet: it is about to be created


def _how(path: object, mode: str) -> str | None:
    """How opening `path` in `mode` changes it; None for reading."""
    if not any(c in mode for c in "wax+"):
        return None
    try:
        exists = isinstance(path, (str, bytes, os.PathLike)) and os.path.exists(path)
    except (TypeError, ValueError):
        exists = False
    if not exists:
        return "created"
    if "w" in mode:
        return "replaced"
    return "appended to" if "a" in mode else "modified"


@contextlib.contextmanager
def watched(files: ScriptFiles) -> Iterator[None]:
    """While the script runs: its `open` calls and tensor savers are seen by `files`."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_watched_open(files))
        for module_name, name, obj_kw, path_kw, shown in _SAVERS:
            module = _importable(module_name, files.predict)
            if module is not None and callable(getattr(module, name, None)):
                saver = _watched_saver(files, shown, getattr(module, name), obj_kw, path_kw)
                stack.enter_context(patched(module, name, saver))
        yield


def _importable(name: str, predict: bool):
    """The module, if it is already imported or can be imported here. The distributed
    checkpoint takes most of a second to import, and writes through `open` (seen anyway): it is
    imported only for a predicted run, which must keep it from writing fake tensors."""
    if name in sys.modules:
        return sys.modules[name]
    if name == "torch.distributed.checkpoint":
        if not predict:
            return None
        import torch.distributed

        if not torch.distributed.is_available():
            return None
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - not installed, or broken: the script cannot call it either
        return None


@contextlib.contextmanager
def _watched_open(files: ScriptFiles) -> Iterator[None]:
    """`open` (builtins and io, which pathlib and os.fdopen call) noting what it writes and
    keeping each file object it returns."""
    original = io.open

    def open_(file, mode="r", *args, **kwargs):
        how = _how(file, mode) if isinstance(mode, str) else None
        f = original(file, mode, *args, **kwargs)
        if how is not None:
            files.wrote(file, how)
        with contextlib.suppress(TypeError):  # a file type that takes no weak reference
            files.opened.add(f)
        return f

    with patched(builtins, "open", open_), patched(io, "open", open_):
        yield


def _watched_saver(files: ScriptFiles, short: str, saver: Callable, obj_kw: str,
                   path_kw: str) -> Callable:
    def save(*args, **kwargs):
        obj = args[0] if args else kwargs.get(obj_kw)
        path = args[1] if len(args) > 1 else kwargs.get(path_kw)
        if files.predict:
            tensors = tensors_in([_tensors_of(obj)])
            if any(isinstance(t, FakeTensor) for t in tensors):
                named = (f"{short}(..., {os.fspath(path)!r})"
                         if isinstance(path, (str, os.PathLike)) else f"{short}(...)")
                files.skipped.append(Skipped(named, user_source(skip=2), _held(tensors)))
                return None
        how = _how(path, "w") if isinstance(path, (str, os.PathLike)) else None
        result = saver(*args, **kwargs)
        if how is not None:
            files.wrote(path, how)
        return result

    return save


def _tensors_of(obj: object) -> object:
    """What a saver writes: a module's state_dict for `save_model`, else the object."""
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and not isinstance(obj, dict):
        with contextlib.suppress(Exception):
            return state_dict()
    return obj


def _held(tensors: list) -> dict[str, int]:
    """Bytes of the storages `tensors` hold, each storage once (tied weights share one), by
    dtype."""
    seen: dict[int, object] = {}  # storage objects kept alive so their ids stay theirs
    by_dtype: dict[str, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if id(storage) in seen:
            continue
        seen[id(storage)] = storage
        n = storage.nbytes()
        dtype = str(t.dtype).removeprefix("torch.")
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return by_dtype
