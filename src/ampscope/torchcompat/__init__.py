"""Every private PyTorch detail ampscope uses, in one place, each feature-detected once.

"Private" is any module path component or attribute under `torch` that starts with `_`
(`torch._C._get_dispatch_mode`, `torch._subclasses.fake_tensor`, `FakeTensorMode._cache_key`).
Outside this package ampscope reaches none: tests/test_torch_private.py reads the source and
fails on any use elsewhere. Each module here wraps one family of details in small typed
functions, finds out once (by signature, attribute or behaviour) whether this build has them,
and says so in `features()`; what a missing detail disables is stated where it is used, and
`ampscope --version -v` lists the lot for the running torch.

Allowed everywhere, and why (names stable for years, or part of torch's documented surface
despite the underscore):

- `torch.ops.<namespace>.<name>` with a leading underscore: those are ATen operator names
  (`aten._to_copy`), the dispatcher's public names, not Python privates. Ops that not every
  supported release has are looked up with `aten_op()` (ops.py), never by attribute.
- Other libraries' privates are not torch's: the standard library's (`sys._getframe`,
  `os._exit`), transformers' `config._attn_implementation`, torchao's patch flag `_PATCHED`.

nn.Module's own containers (`modules.py`) and an op's schema (`dispatch.op_schema`) are
stable for years but private too: they are reached through here as well. The names
re-exported here (`TorchDispatchMode`, `FakeTensorMode`, `FakeTensor`, `OpOverload`, …) live under private module paths but are the supported way to write a dispatch
mode or a fake-tensor tool; they are imported from this package so that a move between modules
is fixed once.
"""

from __future__ import annotations

from ampscope.torchcompat.features import Feature, features, torch_build

__all__ = ["Feature", "features", "torch_build"]
