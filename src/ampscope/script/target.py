"""The script or module a run starts, as `python SCRIPT ARGS` or `python -m MODULE ARGS` would,
and the one line that names where it failed."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import runpy
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ampscope.errors import AmpscopeError
from ampscope.patches import patched


def nth(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def runner(target: str, argv: Sequence[str], module: bool) -> tuple[str, Callable[[], None]]:
    """What runs the script, and how messages name it; a target that cannot run is refused
    here, before anything else is set up."""
    if module:
        # `python -m` puts the working folder first on sys.path: a package there is found
        # whatever the caller's own path holds.
        folder = os.getcwd()
        if not _findable(target, folder):
            raise AmpscopeError(f"no module named {target!r} (run from the folder that holds "
                                "its package, or give a script's path)")

        def run_module() -> None:
            with _first_on_path(folder), patched(sys, "argv", [target, *argv]):
                runpy.run_module(target, run_name="__main__", alter_sys=True)

        return f"python -m {target}", run_module
    path = Path(target)
    if path.exists() and not path.is_file():  # a folder, or a FIFO that would block
        raise AmpscopeError(f"{target}: not a regular file; give the path of a .py file, or -m "
                            "package.module")
    if not path.is_file():
        raise AmpscopeError(f"no script at {target} (give the path of a .py file, or -m "
                            "package.module)")

    def run_path() -> None:
        with _first_on_path(str(path.resolve().parent)), patched(sys, "argv", [str(path), *argv]):
            runpy.run_path(str(path), run_name="__main__")

    return path.name, run_path


def _findable(target: str, folder: str) -> bool:
    """Whether `python -m target` run in `folder` finds the module. Finding a submodule
    imports its parent packages: those of the folder are forgotten again, so the run imports
    them afresh, under the device and modes it runs in. A parent that raises on import counts
    as found: the run raises it as the script's own error, with its line."""
    with _first_on_path(folder):
        try:
            return importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            return False
        except Exception:  # noqa: BLE001 - the package's own error, raised again by the run
            return True


def _installed() -> tuple[str, ...]:
    """Folders of installed code: the interpreter's and its environment's packages. A module
    from one of them is never forgotten, even when the environment lies in the script's folder
    (a project's own .venv): torch's modules must not be imported twice in one process."""
    paths = sysconfig.get_paths()
    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix,
               *(paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return tuple(os.path.abspath(f) + os.sep for f in folders if f)


@contextlib.contextmanager
def _first_on_path(first_path: str) -> Iterator[None]:
    """`first_path` first on `sys.path` for the block, as `python` puts the script's folder (or,
    with -m, the working folder); afterwards the path as it was, and the modules imported from
    that folder in the block forgotten, so the next run imports them again, their import-time
    device checks included (never installed code, nor ampscope's own: torch's modules must not
    be imported twice in one process)."""
    saved_path, saved_modules = sys.path[:], set(sys.modules)
    folder = os.path.abspath(first_path) + os.sep
    kept = _installed() + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
    sys.path.insert(0, first_path)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            path = os.path.abspath(getattr(sys.modules[name], "__file__", None) or "")
            if path.startswith(folder) and not path.startswith(kept):
                del sys.modules[name]


def user_line(e: BaseException) -> str | None:
    """`file.py:line` of the innermost frame of the traceback in the script's code (or a
    library's: not PyTorch's, ampscope's or the standard library's, so `os.environ[...]`
    names the script's line); for a syntax error, where the error is."""
    from ampscope.runtime.user_frames import user_line as innermost_users

    if isinstance(e, SyntaxError) and e.filename:
        return f"{os.path.basename(e.filename)}:{e.lineno}"
    return innermost_users(e)
