"""Which collective a rank of `ampscope run --nproc` is in: for the one line that names, when
the job's deadline passes, where each rank still running waits (script/ranks.py).

A rank hangs in a collective its peers never reach (rank 0 all-reduces while rank 1 waits in a
barrier, or never calls one): the c10d op is dispatched at once and the rank then blocks in
`work.wait()`, which torch.distributed's Python functions call before they return. So a
collective is "entered" when the script calls one of those functions and "left" when it
returns (or raises): `watched(path)` wraps each of them, for the length of the run, in both
`torch.distributed` and its implementation module (where the public names are defined and
`init_device_mesh` and torch's own code find them), and on entry and exit writes one small
JSON state to `path` that the parent reads when the deadline passes:

    {"in": true, "kind": "all_reduce", "dtype": "float32", "bytes": 16, "line": "train.py:7",
     "async": false}

Only entry and exit write, one `pwrite` each over the same bytes of an open file: a watched
call costs about 15 µs more (a one-rank gloo all-reduce of 4 elements: 13 µs plain, 26 µs
watched, on this project's 2-core CPU machine), and no op pays anything. A call nested in
another watched one (`all_gather_object` calls `all_gather`) is the outer call's: the
script's line names the outer one. A call made with
`async_op=True` returns at once with a Work: it is left at once, and marked `async` (where
the rank later waits on that Work, or DDP's reducer on its own from C++, is not seen here).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ampscope.patches import patched
from ampscope.runtime.user_frames import _users
from ampscope.torchcompat.distributed import c10d_module

# torch.distributed's blocking collectives and point-to-point calls, each with the parameter
# that holds its payload (the whole of a gather or scatter, as distributed/report.py counts
# it), or None where the payload is no tensor (a barrier, a pickled object).
PAYLOAD: dict[str, str | None] = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
    "all_gather": "tensor_list", "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",
    "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "all_to_all": "input_tensor_list", "all_to_all_single": "input",
    "gather": "tensor", "scatter": "tensor",
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
    "barrier": None, "monitored_barrier": None,
    "all_gather_object": None, "broadcast_object_list": None, "gather_object": None,
    "scatter_object_list": None,
}


class _Watch:
    """The state file of one rank, written on entry to and exit from each outermost call."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.lock = threading.Lock()
        self.longest = 0  # bytes of the longest state written: each covers the one before
        self.depth = threading.local()  # calls of this thread now inside a watched one

    def write(self, state: dict) -> None:
        """The state over the one before, in one `pwrite` at the file's start, padded with
        spaces to the longest yet: under a microsecond, where a new file renamed into place
        per call (write_atomic, with its fsync) took hundreds. The parent reads it while the
        rank waits in a collective, when nothing writes."""
        data = json.dumps(state).encode("ascii")
        # A state that cannot be written (a full disk) costs the job's error its detail,
        # never the script its collective.
        with self.lock, contextlib.suppress(OSError):
            self.longest = max(self.longest, len(data))
            os.pwrite(self.fd, data.ljust(self.longest), 0)

    def close(self) -> None:
        with self.lock:
            os.close(self.fd)

    def wrapped(self, name: str, original: Callable) -> Callable:
        parameter = PAYLOAD[name]
        position = _position(original, parameter)
        watch = self

        @functools.wraps(original)
        def collective(*args, **kwargs):
            depth = getattr(watch.depth, "n", 0)
            if depth:  # inside a watched call: that call is the script's
                return original(*args, **kwargs)
            state = {"in": True, "kind": name, **_payload(position, parameter, args, kwargs),
                     "line": _script_line(), "async": False}
            watch.write(state)
            watch.depth.n = 1
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                watch.depth.n = 0
                # A Work returned (async_op=True): the rank waits on it later, elsewhere.
                state.update({"in": False, "async": hasattr(result, "wait")})
                watch.write(state)

        return collective


def _position(function: Callable, parameter: str | None) -> int | None:
    """Where `parameter` is among `function`'s positional parameters; None where it is not
    one (or the function has no signature Python can read)."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(parameter) if parameter in names else None


def _payload(position: int | None, parameter: str | None, args: tuple, kwargs: dict) -> dict:
    """`dtype` and `bytes` of the call's payload tensor (or tensors); empty where it has none.
    Read by position or keyword, not by binding the signature: a watched call stays cheap."""
    if parameter is None:
        return {}
    value = args[position] if position is not None and position < len(args) else \
        kwargs.get(parameter)
    tensors = [t for t in (value if isinstance(value, (list, tuple)) else [value])
               if isinstance(t, torch.Tensor)]
    if not tensors:
        return {}
    return {"dtype": str(tensors[0].dtype).removeprefix("torch."),
            "bytes": sum(t.numel() * t.element_size() for t in tensors)}


_script_file = functools.lru_cache(maxsize=1024)(_users)  # asked per frame of every call


def _script_line() -> str | None:
    """`file.py:line` of the innermost frame of the caller's stack in the user's code."""
    frame = inspect.currentframe()
    while frame is not None:
        if _script_file(frame.f_code.co_filename):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


@contextlib.contextmanager
def watched(path: str) -> Iterator[None]:
    """Every collective function of torch.distributed writes its state to `path` on entry and
    exit while the body runs."""
    watch = _Watch(path)
    owners = list(dict.fromkeys((dist, c10d_module() or dist)))
    with contextlib.ExitStack() as stack:
        stack.callback(watch.close)
        for name in PAYLOAD:
            original = getattr(dist, name, None)
            if original is None:  # not on this build
                continue
            wrapper = watch.wrapped(name, original)
            for owner in owners:
                if getattr(owner, name, None) is original:
                    stack.enter_context(patched(owner, name, wrapper))
        yield


def read_state(path: str) -> dict | None:
    """The state a rank last wrote to `path`; None before its first collective."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def describe(state: dict | None, *, many: bool = False) -> str:
    """What a rank was doing, in words after "rank K ": "waits in all_reduce (float32, 16 B)
    at train.py:7", or "was not in a collective (last: barrier at train.py:5)"; after
    "ranks K, L " with `many`."""
    waits, was = ("wait", "were") if many else ("waits", "was")
    if state is None:
        return f"{was} not in a collective (it had entered none)"
    call = str(state.get("kind", "a collective"))
    if "dtype" in state and "bytes" in state:
        call += f" ({state['dtype']}, {int(state['bytes']):,} B)"
    if state.get("line"):
        call += f" at {state['line']}"
    if state.get("in"):
        return f"{waits} in {call}"
    return f"{was} not in a collective (last: {call}{', async' if state.get('async') else ''})"
