"""A script's process group on gloo, whatever backend it names: the ranks of `ampscope run
--nproc` are CPU processes (their tensors live on the CPU, also on the virtual device), and
gloo is the backend that runs collectives on CPU tensors in every PyTorch build.

`dist.init_process_group("nccl")`, `("cuda:nccl,cpu:gloo")` or with no backend at all becomes
`init_process_group("gloo")`: every device type of the group maps to gloo, so a collective on a
tensor the script believes is on "cuda:k" (really on the CPU) runs, with its dtype and shape
as the script made them. A `device_id=` argument is dropped: it binds the group to a CUDA
device (eager NCCL initialisation) that does not exist here. `new_group(backend=...)`, which
`init_device_mesh` and user code call for sub-groups, is substituted the same way.

`FakeGroups` does the same for a predicted rank (`ampscope run --nproc N --predict`): every
group is PyTorch's fake process group, made with the fake store
(torchcompat/distributed.py) and the rank and world size torchrun's environment gives, so a
collective returns at once with its real shapes and dtypes and no peer needs to exist.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

import torch.distributed as dist

from ampscope.errors import AmpscopeError
from ampscope.patches import patched
from ampscope.torchcompat.distributed import c10d_module, mesh_module

log = logging.getLogger(__name__)

BACKEND = "gloo"
FAKE = "fake"


class GlooGroups:
    """`with GlooGroups().active():` every process group the script makes runs on gloo;
    `asked` lists the backends the script named, for the note."""

    backend = BACKEND

    def __init__(self) -> None:
        self.asked: list[str] = []  # as the script wrote them; "none named" when it named none

    def _init_kwargs(self, kwargs: dict) -> dict:
        """init_process_group's other arguments, as this backend takes them."""
        kwargs.pop("device_id", None)
        return kwargs

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
                kwargs = groups._init_kwargs(kwargs)
            return original(*args, backend=groups.backend, **kwargs)

        substituted.__name__ = getattr(original, "__name__", "substituted")
        substituted.__doc__ = original.__doc__
        return substituted

    @contextlib.contextmanager
    def active(self) -> Iterator[GlooGroups]:
        """The substitution for the body (the names in `torch.distributed` and in its
        `distributed_c10d` module, where `init_device_mesh` finds them)."""
        implementation = c10d_module() or dist  # a build without it: the public names only
        init = self._substituted(implementation.init_process_group, init=True)
        new = self._substituted(implementation.new_group, init=False)
        with contextlib.ExitStack() as stack:
            # DeviceMesh calls the names it imported: its own `new_group(backend=None)` would
            # make an NCCL group on a CUDA build once `torch.cuda.is_available()` says yes.
            for owner in dict.fromkeys((dist, implementation, mesh_module())):
                for name, value in (("init_process_group", init), ("new_group", new)):
                    if owner is not None and hasattr(owner, name):
                        stack.enter_context(patched(owner, name, value))
            yield self
            # A group the script left open is closed after a run that ended well; after a
            # failure the rank's process ends moments later, which closes it.
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # a peer may be gone already
                    dist.destroy_process_group()

    def notes(self) -> list[str]:
        """What was substituted, in plain words."""
        named = [b for b in dict.fromkeys(self.asked) if b != self.backend]
        if not named:
            return []
        note = (f"The script's process group ({', '.join(repr(b) for b in named)}) ran on "
                f"{self._why()}")
        log.info("%s", note)
        return [note]

    def _why(self) -> str:
        return (f"{BACKEND}: every rank is a CPU process here, and {BACKEND} runs the "
                "collectives on CPU tensors with the dtypes and shapes the script gave them.")


class FakeGroups(GlooGroups):
    """`with FakeGroups().active():` every process group is PyTorch's fake one: the rank and
    world size from torchrun's environment (RANK, WORLD_SIZE) unless the script gives them,
    the fake store for whatever rendezvous it names (no peer is there to meet)."""

    backend = FAKE

    def _init_kwargs(self, kwargs: dict) -> dict:
        from ampscope.torchcompat.distributed import fake_store

        for rendezvous in ("device_id", "init_method", "store"):
            kwargs.pop(rendezvous, None)
        kwargs["store"] = fake_store()
        kwargs.setdefault("rank", int(os.environ.get("RANK", "0")))
        kwargs.setdefault("world_size", int(os.environ.get("WORLD_SIZE", "1")))
        return kwargs

    @contextlib.contextmanager
    def active(self) -> Iterator[GlooGroups]:
        """The substitution, and DDP's gradient all-reduce as a comm hook of ours. DDP's
        reducer calls the group's all-reduce from C++ and reads the reduced bucket from the
        work's future, which the fake group leaves empty: the hook all-reduces the bucket
        through `dist.all_reduce` (the same collective, recorded as DDP's own is) and hands
        the bucket back itself. A hook of the script's own would meet the empty future:
        refused in one line."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        original_init, original_register = DDP.__init__, DDP.register_comm_hook

        def __init__(ddp, *args, **kwargs):
            original_init(ddp, *args, **kwargs)
            original_register(ddp, ddp.process_group, _all_reduce_hook)

        def register_comm_hook(ddp, state, hook):
            raise AmpscopeError("a DDP comm hook of the script's own cannot run on the fake "
                                "process group of a predicted rank: leave out --predict")

        with patched(DDP, "__init__", __init__), \
                patched(DDP, "register_comm_hook", register_comm_hook), \
                super().active() as groups:
            yield groups

    def _why(self) -> str:
        return ("PyTorch's fake process group, where every collective returns at once with "
                "the shapes and dtypes the script gave it (no peer runs).")


def _all_reduce_hook(group, bucket):
    """DDP's default reduction of one bucket (divide by the world size, all-reduce), with the
    bucket handed back in a done future."""
    import torch

    tensor = bucket.buffer()
    tensor.div_(group.size())
    dist.all_reduce(tensor, group=group)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    return done
