"""Where the user's code raised: the line an error message names, for errors a model's code
raises while ampscope runs it (a factory of `ampscope trace`, its forward, its step)."""

from __future__ import annotations

import os
import sysconfig
import traceback

import torch


def _folder(path: str) -> str:
    return os.path.abspath(path) + os.sep


# Frames that are never the user's: PyTorch's, ampscope's own and the standard library's (the
# `with` blocks, runpy and importlib between the user's line and the error), but for the
# installed packages a system Python keeps inside the standard library's folder.
NOT_USERS = (_folder(os.path.dirname(torch.__file__)),
             _folder(os.path.dirname(os.path.dirname(__file__))))
_STDLIB = _folder(sysconfig.get_paths()["stdlib"])
_INSTALLED = tuple(_folder(sysconfig.get_paths()[key]) for key in ("purelib", "platlib"))


def _users(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(NOT_USERS) or filename.startswith("<frozen "):
        return False
    return not path.startswith(_STDLIB) or path.startswith(_INSTALLED)


def user_line(e: BaseException) -> str | None:
    """`file.py:line` of the innermost frame of `e`'s traceback in the user's code; None when
    every frame is PyTorch's, ampscope's or the standard library's."""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if _users(frame.filename):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return None
