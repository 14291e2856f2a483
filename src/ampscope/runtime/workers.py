"""DataLoader workers of a traced script: they leave the run, and their batches are where the
device puts them.

A DataLoader with `num_workers > 0` forks its workers (the default start method on Linux), and a
forked process inherits everything of its parent's: ampscope's function and dispatch modes (the
recorders, the virtual device's `DeviceMode`, predict mode's fake values), every attribute a
run replaced (`torch.cuda.is_available`, `nn.Parameter.__new__`, `Tensor.device`) and the global
module hooks (predict mode's, which make every registered weight a fake tensor). A worker would
then trace ops no one reads, answer that its own tensors are on the target, and, predicted,
build fake weights in a transform of the dataset. Under `python` on this machine a worker is a
plain CPU process: `leaving_workers()` makes it one again. It replaces the function every
worker starts in with `worker_loop`, which, in a process forked from the run, undoes every
replacement (`patches.undo_all`), takes ampscope's modes off the stacks and its global hooks
out, turns the garbage collector back on if predict mode paused it, and then runs torch's loop.
The user's own modes and hooks stay, as they would under `python`. What stays of the run in a
worker: the autocast kernels the emulation registered (runtime/emulation.py), which only an
autocast region inside the dataset's code would meet.

`pinned(mode)` is DataLoader's batch pinning on the virtual device: pinned memory is host
memory, so a pinned batch is on the CPU as user code sees it, also when it was unpickled from a
worker in the pin-memory thread, which the device mode of the main thread does not reach.

Namesakes, the same concern at another layer: `torchcompat/workers.py`."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ampscope import patches
from ampscope.runtime.device_mode import DeviceMode
from ampscope.torchcompat import workers

# The run in progress in this process, copied into its forked workers: "pid" (the run's
# process), "loop" (torch's worker loop), "gc" (whether the collector was on before the run).
_run: dict[str, Any] = {}


@contextlib.contextmanager
def leaving_workers() -> Iterator[None]:
    """While entered, each DataLoader worker forked from this process leaves the run before it
    loads a batch. A build without the worker loop where this expects it leaves them as they
    are (see `torchcompat.workers.features`)."""
    slot = workers.worker_loop_slot()
    if slot is None or _run:  # nested: the outer run's already does it
        yield
        return
    module, name = slot
    _run.update(pid=os.getpid(), loop=getattr(module, name), gc=gc.isenabled())
    try:
        with patches.patched(module, name, worker_loop):
            yield
    finally:
        _run.clear()


def worker_loop(*args: Any, **kwargs: Any) -> Any:
    """Torch's worker loop, in a process that first leaves the run it was forked from. Defined
    at module level: a DataLoader with a spawn context pickles it by name, and a spawned worker,
    which inherits nothing, finds torch's own loop unreplaced."""
    pid = _run.get("pid")
    if pid is not None and os.getpid() != pid:
        leave_run()
    loop = _run.get("loop")
    if loop is None:
        slot = workers.worker_loop_slot()
        assert slot is not None  # this function is only ever installed where the slot is
        loop = getattr(*slot)
    return loop(*args, **kwargs)


def _ours(thing: object) -> bool:
    """A mode (its class) or a hook (its function) of ampscope's own."""
    return str(getattr(thing, "__module__", "") or "").startswith("ampscope.")


def leave_run() -> None:
    """This forked process is no longer part of the run (see the module docstring)."""
    _run.pop("pid", None)  # once: the worker's own forks are not the run's
    gc_was_on = _run.pop("gc", gc.isenabled())
    patches.undo_all()
    with contextlib.suppress(Exception):  # a build whose stacks differ: the worker runs traced
        workers.drop_modes(_ours)
        workers.drop_global_hooks(_ours)
    if gc_was_on:
        gc.enable()


def pinned(mode: DeviceMode) -> Callable[..., Any]:
    """DataLoader's `pin_memory(data, device)` on the virtual device: the batch as it is (no
    host memory to pin on this machine), each of its tensors on the CPU as user code sees it."""

    def tag(data: Any) -> None:
        # What torch's own pinning walks: mappings (a transformers BatchEncoding is a
        # UserDict), lists and tuples (named ones too).
        if isinstance(data, torch.Tensor):
            mode.on_cpu.add(data)
        elif isinstance(data, Mapping):
            for value in data.values():
                tag(value)
        elif isinstance(data, (list, tuple)):
            for value in data:
                tag(value)

    def pin_memory(data: Any, device: Any = None) -> Any:
        tag(data)
        return data

    return pin_memory
