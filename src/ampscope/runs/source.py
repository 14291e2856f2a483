"""Where in user code a torch call came from ("model.py:61"): the innermost stack frame that is
neither PyTorch's nor ampscope's own machinery (docs/how-it-works.md#source-locations).
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
from types import CodeType, FrameType

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AMPSCOPE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
# The reference models are model code like any user's; the rest of models/ (the HF adapter,
# the registry) is ampscope's own machinery.
_REFERENCE_MODELS = frozenset(
    os.path.join(_AMPSCOPE_DIR, "models", f) for f in ("gpt2.py", "nanochat.py")
)
_CONTEXTLIB = os.path.dirname(os.__file__) + os.sep + "contextlib.py"
# The virtual device (its function mode, and the torch.cuda and autocast answers it patches in)
# sits between user code and the recorders: a call passes through it as through PyTorch's own
# dispatch.
_PASS_THROUGH = frozenset({_CONTEXTLIB, *(os.path.join(_AMPSCOPE_DIR, "runtime", f)
                                          for f in ("virtual_device.py", "device_mode.py"))})

TORCH, AMPSCOPE, USER = 0, 1, 2
# Keyed by file name, not by code object: a code object's hash is worked out from its contents
# on every lookup (about 0.4 µs, for each frame of each walk), a string's is computed once.
_kind_cache: dict[str, int] = {}
# The user files seen, by the name a source label gives them ("train.py" -> its path).
_user_paths: dict[str, str] = {}


def _kind(code: CodeType) -> int:
    path = code.co_filename
    kind = _kind_cache.get(path)
    if kind is None:
        if path.startswith(_TORCH_DIR) or path in _PASS_THROUGH:
            kind = TORCH
        elif path.startswith(_AMPSCOPE_DIR) and path not in _REFERENCE_MODELS:
            kind = AMPSCOPE
        else:
            kind = USER
            _user_paths[os.path.basename(path)] = path  # the latest of that name
        _kind_cache[path] = kind
    return kind


def user_source(skip: int = 2) -> str | None:
    """`file.py:line` of the innermost frame outside PyTorch, if that frame is user code.

    When the innermost such frame is ampscope's own (a workload's `optimizer.step()`), there
    is no user line to name: None, rather than the line that called ampscope.
    """
    return source_from(sys._getframe(skip))


def source_from(frame: FrameType | None) -> str | None:
    """`user_source` from `frame` outwards. A frame that waits for a call to return still
    stands at the line that made it, so this can be asked after the call, and gives the same."""
    kinds = _kind_cache
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__torch_function__":
            # A function mode's handler passing the call on (a predicted script's, which reads
            # `.item()`): not where the call was made, whoever wrote the mode.
            frame = frame.f_back
            continue
        kind = kinds.get(code.co_filename)
        if kind is None:
            kind = _kind(code)
        if kind == USER:
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
        if kind == AMPSCOPE:
            return None
        frame = frame.f_back
    return None


def source_line(label: str) -> str | None:
    """The text of the user line a label names ("train.py:12"), where a run saw that file."""
    name, _, line = label.rpartition(":")
    path = _user_paths.get(name)
    if path is None or not line.isdigit():
        return None
    linecache.checkcache(path)  # a file edited since it was last read is read again
    return linecache.getline(path, int(line)) or None


# Where installed packages live: code there is a library's, not the user's own.
_LIBRARIES = tuple(dict.fromkeys(
    os.path.join(p, "") for p in (sysconfig.get_paths().get("purelib"),
                                  sysconfig.get_paths().get("platlib")) if p))


def library_line(frame: FrameType | None) -> str | None:
    """Where torch or an installed library runs the code at `frame` (outwards past ampscope's
    own frames): "torch/nn/init.py:119"; None where that code is the user's."""
    while frame is not None:
        code = frame.f_code
        kind = _kind(code)
        if kind == AMPSCOPE or code.co_name == "__torch_function__":
            frame = frame.f_back
            continue
        path = code.co_filename
        if kind == TORCH and path in _PASS_THROUGH:
            frame = frame.f_back
            continue
        for root in (os.path.dirname(os.path.dirname(_TORCH_DIR)) + os.sep, *_LIBRARIES):
            if kind == TORCH or path.startswith(root):
                return f"{os.path.relpath(path, root) if path.startswith(root) else path}:" \
                       f"{frame.f_lineno}"
        return None
    return None
