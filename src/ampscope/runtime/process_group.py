"""A script's process groups on gloo (`ampscope run --nproc`), or on PyTorch's fake process group
for a predicted rank: docs/distributed.md says what a script gets ("The backend", "The process
group") and why PREMUL_SUM needs more on gloo.

`GlooGroups`: `init_process_group` and `new_group` (which `init_device_mesh` and user code call
for sub-groups) get gloo for every device type whatever backend they name, so a collective on a
tensor the script believes is on "cuda:k" (really on the CPU) runs, and `device_id=` is dropped (it binds the group to a CUDA device, eager NCCL initialisation, that
does not exist here). Gloo has no `ReduceOp.PREMUL_SUM`: a reducing collective given one runs as
SUM over its inputs multiplied by the factor first, outside the trace, as NCCL multiplies inside
its kernel. `FakeGroups` substitutes the same calls with the fake process group, made with the
fake store (torchcompat/distributed.py) and the rank and world size torchrun's environment gives.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator

import torch.distributed as dist

from ampscope.errors import AmpscopeError
from ampscope.patches import patched
from ampscope.torchcompat.dispatch import no_dispatch
from ampscope.torchcompat.distributed import (
    PremulFactorUnknown,
    c10d_module,
    forget_meshes,
    mesh_module,
    premul_factor,
)

log = logging.getLogger(__name__)

BACKEND = "gloo"
FAKE = "fake"

# The reducing collectives, each with the parameter holding what it reduces and whether it
# reduces in place (its payload is also its result).
REDUCING: dict[str, tuple[str, bool]] = {
    "all_reduce": ("tensor", True), "reduce": ("tensor", True),
    "all_reduce_coalesced": ("tensors", True), "reduce_scatter": ("input_list", False),
    "reduce_scatter_tensor": ("input", False), "reduce_scatter_single": ("input", False),
}


class GlooGroups:
    """`with GlooGroups().active():` every process group the script makes runs on gloo;
    `asked` lists the backends the script named, for the note."""

    backend = BACKEND
    premul_emulated = True  # gloo lacks PREMUL_SUM; PyTorch's fake group takes any op

    def __init__(self) -> None:
        self.asked: list[str] = []  # as the script wrote them; "none named" when it named none
        self.premuls = 0  # PREMUL_SUM collectives run as SUM of premultiplied inputs

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
        # DTensor's cache may hold meshes of a group made and destroyed before in this process:
        # their group names, reused or gone, would be what a collective names (forget_meshes).
        forget_meshes()
        with contextlib.ExitStack() as stack:
            stack.callback(forget_meshes)  # the meshes of this run's groups, once they end
            # DeviceMesh calls the names it imported: its own `new_group(backend=None)` would
            # make an NCCL group on a CUDA build once `torch.cuda.is_available()` says yes.
            for owner in dict.fromkeys((dist, implementation, mesh_module())):
                for name, value in (("init_process_group", init), ("new_group", new)):
                    if owner is not None and hasattr(owner, name):
                        stack.enter_context(patched(owner, name, value))
            if self.premul_emulated:
                for owner in dict.fromkeys((dist, implementation)):
                    for name, (payload, in_place) in REDUCING.items():
                        if callable(original := getattr(owner, name, None)):
                            stack.enter_context(patched(
                                owner, name, self._premultiplying(original, payload, in_place)))
            yield self
            # A group the script left open is closed after a run that ended well; after a
            # failure the rank's process ends moments later, which closes it.
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # a peer may be gone already
                    dist.destroy_process_group()

    def _premultiplying(self, original: Callable, payload: str, in_place: bool) -> Callable:
        """`original` (a reducing collective) that runs `ReduceOp.PREMUL_SUM(f)` as SUM over
        its payload multiplied by f: in place where the collective reduces in place (the
        payload is its result either way), on a copy where its input is the caller's."""
        signature = inspect.signature(original)
        groups = self

        @functools.wraps(original)
        def premultiplying(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            try:
                factor = premul_factor(bound.arguments.get("op"))
            except PremulFactorUnknown as e:
                raise AmpscopeError(f"{e}, which gloo cannot run: the ranks of `run --nproc` "
                                    "need it to run the script's PREMUL_SUM as a SUM") from e
            if factor is None:
                return original(*args, **kwargs)
            with no_dispatch():  # NCCL multiplies inside the collective: no op of the step
                bound.arguments[payload] = _scaled(bound.arguments[payload], factor, in_place)
            bound.arguments["op"] = dist.ReduceOp.SUM
            groups.premuls += 1
            return original(*bound.args, **bound.kwargs)

        return premultiplying

    def notes(self) -> list[str]:
        """What was substituted, in plain words."""
        named = [b for b in dict.fromkeys(self.asked) if b != self.backend]
        notes = []
        if named:
            notes.append(f"The script's process group ({', '.join(repr(b) for b in named)}) "
                         f"ran on {self._why()}")
        if self.premuls:
            notes.append(f"{self.premuls} collective(s) asked for ReduceOp.PREMUL_SUM, which "
                         f"{BACKEND} lacks: each ran as a SUM of its inputs multiplied by the "
                         "factor first (NCCL multiplies inside the collective; the values "
                         "agree to rounding, the dtypes and bytes are the same).")
        for note in notes:
            log.info("%s", note)
        return notes

    def _why(self) -> str:
        return (f"{BACKEND}: every rank is a CPU process here, and {BACKEND} runs the "
                "collectives on CPU tensors with the dtypes and shapes the script gave them.")


def _scaled(payload, factor, in_place: bool):
    """`payload` (a tensor or a list of them) multiplied by `factor`."""
    if isinstance(payload, (list, tuple)):
        return type(payload)(_scaled(t, factor, in_place) for t in payload)
    return payload.mul_(factor) if in_place else payload.mul(factor)


class FakeGroups(GlooGroups):
    """`with FakeGroups().active():` every process group is PyTorch's fake one: the rank and
    world size from torchrun's environment (RANK, WORLD_SIZE) unless the script gives them,
    the fake store for whatever rendezvous it names (no peer is there to meet)."""

    backend = FAKE
    premul_emulated = False

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
