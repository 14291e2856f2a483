"""Distributed details: the collectives' op names, c10d's implementation module, the fake process
group's store, DDP's compression hook, storage ids."""

from __future__ import annotations

import torch

from ampscope.torchcompat.features import Feature

# The collectives' ops as the dispatcher shows them (c10d's in-place ops, some under underscored
# names, and the functional ones in the underscored `_c10d_functional` namespace), by what
# they do: an op's name without namespace and overload → its kind.
KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
}
FUNCTIONAL_NAMESPACE = "_c10d_functional"
NAMESPACES = ("c10d", FUNCTIONAL_NAMESPACE)
FUNCTIONAL_PREFIX = FUNCTIONAL_NAMESPACE + "."


def c10d_module():
    """torch.distributed's implementation module, where `init_process_group` and `new_group`
    live beside their re-exports (`init_device_mesh` calls them there); None on a build
    without it."""
    import torch.distributed as dist

    return getattr(dist, "distributed_c10d", None)


def mesh_module():
    """`torch.distributed.device_mesh`, whose module-level `new_group` (imported by name)
    DeviceMesh calls for its subgroups; None where this build lacks it or cannot import it."""
    try:
        import torch.distributed.device_mesh as mesh
    except ImportError:
        return None
    return mesh


def fake_store():
    """The store torch's fake process group ("fake" backend) is initialised with."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def compress_hook(dtype: torch.dtype, bucket):
    """DDP's compression hook body: all-reduce the bucket in `dtype`, then copy back."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _compress_hook

    # None is the default group: torch's body handles it, its annotation says ProcessGroup only.
    return _compress_hook(dtype, None, bucket)  # type: ignore[arg-type]


def storage_id(t: torch.Tensor) -> int:
    """An id of `t`'s storage that every tensor object on it shares (a DTensor makes a new
    local tensor object on every call)."""
    return t.untyped_storage()._cdata


# The collectives a predicted rank dispatches on fake tensors (FSDP2's, DDP's, DeviceMesh's).
_COLLECTIVES = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allreduce_",
                "c10d::broadcast_")


def fake_collectives() -> bool:
    """Whether this build's c10d collectives run on fake tensors (they have Meta kernels: torch
    2.11 and later); without them a rank cannot be predicted."""
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if not callable(has_kernel):
        return False
    try:
        import torch.distributed as _  # noqa: F401 - registers the c10d ops

        return all(has_kernel(op, "Meta") for op in _COLLECTIVES)
    except (RuntimeError, ImportError):  # an op this build does not define
        return False


def no_fake_collectives(what: str) -> str | None:
    """The one line that says `what` cannot run on this build (None where it can)."""
    if fake_collectives():
        return None
    return (f"{what} needs PyTorch's collectives to run on fake tensors, which torch "
            f"{torch.__version__} lacks (they came in 2.11): run the ranks for real (`ampscope "
            "run --nproc N` without --predict, up to 8), or use torch 2.11 or later")


def features() -> list[Feature]:
    try:
        fake_store()
        ok, why = True, "torch's fake process group store"
    except Exception as e:  # not built with distributed support
        ok, why = False, f"not on this build ({type(e).__name__})"
    collectives = fake_collectives()
    return [Feature("fake process group", ok, why),
            Feature("collectives on fake tensors", collectives,
                    "c10d's Meta kernels" if collectives else
                    "not on this build: no rank can be predicted (run --nproc --predict, "
                    "trace --distributed --predict, fit --gpus)")]
