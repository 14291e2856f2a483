"""A script's process group on gloo, whatever backend it names: the ranks of `ampscope run
--nproc` are CPU processes (their tensors live on the CPU, also on the virtual device), and
gloo is the backend that runs collectives on CPU tensors in every PyTorch build.

`dist.init_process_group("nccl")`, `("cuda:nccl,cpu:gloo")` or with no backend at all becomes
`init_process_group("gloo")`: every device type of the group maps to gloo, so a collective on a
tensor the script believes is on "cuda:k" (really on the CPU) runs, with its dtype and shape
as the script made them. A `device_id=` argument is dropped: it binds the group to a CUDA
device (eager NCCL initialisation) that does not exist here. `new_group(backend=...)`, which
`init_device_mesh` and user code call for sub-groups, is substituted the same way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ampscope.patches import patched

log = logging.getLogger(__name__)

BACKEND = "gloo"


class GlooGroups:
    """`with GlooGroups().active():` every process group the script makes runs on gloo;
    `asked` lists the backends the script named, for the note."""

    def __init__(self) -> None:
        self.asked: list[str] = []  # as the script wrote them; "none named" when it named none

    def _substituted(self, original: Callable, *, init: bool) -> Callable:
        """`original` (init_process_group, or new_group whose first argument is its ranks)
        with gloo for whatever backend it was given."""
        groups = self

        def substituted(*args, **kwargs):
            backend = kwargs.pop("backend", None)
            if init and args:  # init_process_group's first parameter is the backend
                backend, args = args[0], args[1:]
            if init or backend is not None:
                groups.asked.append(str(backend) if backend is not None else "none named")
            if init:
                kwargs.pop("device_id", None)
            return original(*args, backend=BACKEND, **kwargs)

        substituted.__name__ = getattr(original, "__name__", "substituted")
        substituted.__doc__ = original.__doc__
        return substituted

    @contextlib.contextmanager
    def active(self) -> Iterator[GlooGroups]:
        """The substitution for the body (the names in `torch.distributed` and in its
        `distributed_c10d` module, where `init_device_mesh` finds them)."""
        init = self._substituted(c10d.init_process_group, init=True)
        new = self._substituted(c10d.new_group, init=False)
        with contextlib.ExitStack() as stack:
            for owner in (dist, c10d):
                stack.enter_context(patched(owner, "init_process_group", init))
                stack.enter_context(patched(owner, "new_group", new))
            yield self
            # A group the script left open is closed after a run that ended well; after a
            # failure the rank's process ends moments later, which closes it.
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # a peer may be gone already
                    dist.destroy_process_group()

    def notes(self) -> list[str]:
        """What was substituted, in plain words."""
        named = [b for b in dict.fromkeys(self.asked) if b != BACKEND]
        if not named:
            return []
        note = (f"The script's process group ({', '.join(repr(b) for b in named)}) ran on "
                f"{BACKEND}: every rank is a CPU process here, and {BACKEND} runs the "
                "collectives on CPU tensors with the dtypes and shapes the script gave them.")
        log.info("%s", note)
        return [note]
