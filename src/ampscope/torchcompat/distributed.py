"""Distributed details: the fake process group's store, DDP's compression hook, storage ids."""

from __future__ import annotations

import torch

from ampscope.torchcompat.features import Feature


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


def features() -> list[Feature]:
    try:
        fake_store()
        ok, why = True, "torch's fake process group store"
    except Exception as e:  # not built with distributed support
        ok, why = False, f"not on this build ({type(e).__name__})"
    return [Feature("fake process group", ok, why)]
