"""torch.distributed's own buffers in a predicted script run (`run --predict`, each predicted
rank of `run --nproc N --predict`).

The script's weights become fake tensors as its modules register them, and its data stays
real. FSDP2 then all-gathers each parameter's fake shards into a buffer it makes itself
(`torch.empty(..., device=...)` in torch.distributed's code), and the unsharded parameter the
forward pass uses is a view of that buffer; DTensor's redistributions and FSDP2's gradient
reductions make theirs the same way. Made real, those buffers would hold whole weights in this
machine's memory and the model would run for real beside its fake shards (on a 70B model, out
of memory; on any model, real activations that fake ones later meet and that PyTorch's fake
mode cannot take in when autograd recorded them). `DistributedBuffers` makes every factory op
that FSDP's or DTensor's code calls a fake tensor on the run's fake mode: fake weights stay
fake through sharding, the script's own tensors stay real (and c10d's object collectives,
which read the tensors they make, keep real ones).
"""

from __future__ import annotations

import os
import sys

import torch

from ampscope.runtime.user_frames import NOT_USERS
from ampscope.torchcompat.dispatch import TorchDispatchMode, higher_order, run_decomposed
from ampscope.torchcompat.fake import FakeTensorMode

_aten = torch.ops.aten
# The factory ops torch.distributed makes its buffers with (no tensor argument: nothing
# else tells them apart from the script's).
FACTORIES = frozenset((_aten.empty, _aten.empty_strided, _aten.zeros, _aten.ones, _aten.full))

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# FSDP2 and DTensor: the parts of torch.distributed that hold weights. Not c10d itself, whose
# object collectives (`all_gather_object`, DDP's parameter checks) read the values of the
# tensors they make.
_WEIGHT_HOLDERS = tuple(os.path.join(_TORCH, "distributed", *part) + os.sep
                        for part in (("fsdp",), ("tensor",)))


def called_from_distributed(frame) -> bool:
    """Whether the Python code that made the current call is FSDP's or DTensor's: outwards
    from `frame`, past ampscope's frames and torch's dispatch machinery, a frame of theirs
    comes before any frame outside torch."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_WEIGHT_HOLDERS):
            return True
        if not path.startswith(NOT_USERS):  # neither torch's nor ampscope's
            return False
        frame = frame.f_back
    return False


class DistributedBuffers(TorchDispatchMode):
    """`with DistributedBuffers(fake):` a factory op called from FSDP's or DTensor's code makes
    a fake tensor on `fake`; every other op goes on as it is."""

    supports_higher_order_operators = True

    def __init__(self, fake: FakeTensorMode) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if higher_order(func):  # flex_attention: its aten ops come through one by one
            return run_decomposed(self, func, args, kwargs)
        if func.overloadpacket in FACTORIES and called_from_distributed(sys._getframe(1)):
            with self.fake:
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
