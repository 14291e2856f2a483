"""Writing output files so that a failed write never leaves a cut-off file behind.

Every file ampscope writes (`--json PATH`, `report -o`, `bench --out`, `Trace.to_json(path)`)
goes to a temporary file in the same folder first and is renamed over the target only when it
is complete: a full disk or a size limit leaves the old file as it was. Only a regular file is
replaced so: a symlink is followed (its target is written, the link stays), and a FIFO, a
device or a terminal (`/dev/stdout`, `/dev/null`) is written in place, as a shell's `>` would. `unwritable` tells,
before a long run starts, whether a path could be written at all; `unwritable_folder` the same
for a folder a command creates (`train --out`, `bench --out`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` all at once, or not at all (a regular file;
    anything else that exists is written in place, see the module)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if _special(path):  # (stat follows every link, /proc's fd links included)
        with open(path, "wb") as f:
            f.write(payload)
        return
    path = _followed(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # keep the permissions the file had
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _followed(path: str | Path) -> Path:
    """A symlink's final target, however many links deep (the link itself is never
    replaced); any other path as given, so that messages name it as the user did."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)


def _special(path: str | Path) -> bool:
    """An existing target that is not a regular file: a FIFO, a device, a socket."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def unwritable(path: str | Path) -> str | None:
    """Why `path` cannot be written as a file, in a few words, or None when it can."""
    if not str(path):
        return "no path given"
    if _special(Path(path)):  # written in place: only its own permission counts
        return None if os.access(path, os.W_OK) else "it is not writable"
    path = _followed(path)
    if path.is_dir():
        return "it is a folder"
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return f"no folder {folder}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is read-only"
    return None


def unwritable_folder(path: str | Path) -> str | None:
    """Why a folder could not be created (with its parents) or written into, or None."""
    if not str(path):
        return "no path given"
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            return "it is a file, not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else "the folder is not writable"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the folder {parent} is not writable"
    return None
