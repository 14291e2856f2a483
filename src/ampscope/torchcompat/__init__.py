"""Every private PyTorch detail ampscope uses, in one place, each feature-detected once.

"Private" is any module path component or attribute under `torch` that starts with `_`
(`torch._C._get_dispatch_mode`, `torch._subclasses.fake_tensor`, `FakeTensorMode._cache_key`).
Outside this package ampscope reaches none: tests/test_torch_private.py reads the source and
fails on any use elsewhere. Each module here wraps one family of details in small typed
functions, finds out once (by signature, attribute or behaviour) whether this build has them,
and says so in `features()`; what a missing detail disables is stated where it is used, and
`ampscope --version -v` lists the lot for the running torch.

Allowed everywhere: other libraries' privates, which are not torch's (the standard library's
`sys._getframe` and `os._exit`, transformers' `config._attn_implementation`, torchao's patch
flag `_PATCHED`).

Stable for years but private all the same, and so reached through here too: nn.Module's own
containers and hook dicts (`modules.py`), an op's schema (`dispatch.op_schema`), the
underscored ATen ops (`ops.py`: `aten._to_copy`, the fused attention kernels), and the names
that live under private module paths but are the supported way to write a dispatch mode or a
fake-tensor tool (`TorchDispatchMode`, `FakeTensorMode`, `FakeTensor`, `OpOverload`, …),
re-exported so that a move between modules is fixed once.

The modules: `features.py` (what this build offers, for `ampscope --version -v`),
`dispatch.py` (modes and their stack), `dynamo.py` (TorchDynamo kept out), `fake.py`
(FakeTensor internals the speed tricks use), `autograd.py` (the engine's state),
`optim.py` (optimizers' lists and hooks), `modules.py` (nn.Module's own dicts),
`ops.py` (underscored ATen ops), `devices.py` (what the virtual device needs),
`attention.py` (the SDPA switches), `autocast_regions.py` (how an autocast region enters), `rnn.py` (cuDNN's RNN ops), `policy.py` (dispatcher details of autocast policies),
`flops.py` (torch's FLOP formulas), `distributed.py`, `inductor.py`, `workers.py` (what a
forked DataLoader worker drops to leave a run).
"""

from __future__ import annotations

from ampscope.torchcompat.features import Feature, features, torch_build

__all__ = ["Feature", "features", "torch_build"]
