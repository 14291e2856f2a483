"""A TorchDispatchMode base whose handler TorchDynamo never compiles, at no cost per op.

PyTorch wraps every dispatch mode's `__torch_dispatch__` in `torch._dynamo.disable` (recursive),
so that a `torch.compile`d function running while the mode is active does not try to compile
the handler or anything it calls. The wrapper does that on every op: two Python frames that
switch the eval-frame callback off and back on, about 1 µs (0.6 ms of a gpt2-tiny train
step's 567 ops, benchmarks/bench_overhead.py). `UncompiledDispatchMode` asks the same of TorchDynamo once per
handler instead: the handler's code object is marked to run, with every frame it calls,
without the callback (torchcompat/dynamo.py), and PyTorch is told not to wrap it
(`_should_skip_dynamo`, the opt-out it gives dispatch modes). Where this build of PyTorch
cannot mark code, PyTorch's wrapper stays. tests/test_modes.py traces a compiled model under
it: the eager model's ops, and no frame compiled.
"""

from __future__ import annotations

from ampscope.torchcompat import dynamo
from ampscope.torchcompat.dispatch import TorchDispatchMode


class UncompiledDispatchMode(TorchDispatchMode):
    """A TorchDispatchMode whose subclasses' handlers TorchDynamo skips (see the module)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # True makes PyTorch wrap the handler in torch._dynamo.disable; not needed when the
        # handler's code is marked below.
        return not dynamo.can_skip_frames()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        if handler is not None:
            dynamo.skip_frames_of(handler)
