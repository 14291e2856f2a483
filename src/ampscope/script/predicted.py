"""Predict mode for a script (`run --predict`): its model's weights become fake tensors as
they are registered, its data stays real, and what a fake run cannot do is answered or noted.

Also the modules a script makes (every run needs them to find the model by a parameter).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator

from ampscope.patches import patched
from ampscope.runs.session import Capture
from ampscope.runs.source import library_line, user_source
from ampscope.runtime.fake_buffers import DistributedBuffers
from ampscope.runtime.predict import (
    foreach_defaults_as_real,
    gc_paused,
    norm_stats_as_real,
    quiet_fake_tensor_log,
)
from ampscope.runtime.virtual_device import VirtualDevice
from ampscope.torchcompat.dispatch import inner_tensors, no_torch_function
from ampscope.torchcompat.fake import FakeTensor, FakeTensorMode


class Instances:
    """A set of objects by identity, each held weakly: the modules and optimizers a script
    makes. A `weakref.WeakSet` hashes its members, and a module may hash by state its
    `__init__` has not set yet when nn.Module's returns (torchmetrics' metrics), or not at all
    (a dataclass module with `eq=True`)."""

    def __init__(self) -> None:
        self._by_id: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()

    def add(self, obj: object) -> None:
        self._by_id[id(obj)] = obj

    def discard(self, obj: object) -> None:
        if obj in self:
            del self._by_id[id(obj)]

    def __contains__(self, obj: object) -> bool:
        return self._by_id.get(id(obj)) is obj

    def __iter__(self) -> Iterator:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)


@contextlib.contextmanager
def made(cls: type, into: Instances) -> Iterator[None]:
    """Every instance of `cls` the script makes while it runs, added to `into` (its
    `__init__` sees them all): its modules (nn.Module), its optimizers (Optimizer)."""
    original = vars(cls)["__init__"]  # its own: both classes define one

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        into.add(self)

    with patched(cls, "__init__", __init__):
        yield


@contextlib.contextmanager
def fake_model(fake: FakeTensorMode, virtual: VirtualDevice | None) -> Iterator[None]:
    """Predict mode for a script: every parameter and buffer a module registers becomes a fake
    tensor at once (each real one lives only until it is converted), while the script's data
    stays real; an op on a fake tensor and a real one runs on the fake mode. On a virtual
    device each fake one is where its real one was (on the CPU, until `model.to(device)`
    copies it, as on the device). The buffers torch.distributed makes of them (FSDP2's
    unsharded parameters) are fake too (runtime/fake_buffers.py)."""
    import torch
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    def fake_parameter(module, name, param):
        if param is None or _valueless(param):
            return None
        with no_torch_function():  # the conversion is ampscope's, not the script's
            data = placed(fake.from_tensor(param.detach()), param)
            return torch.nn.Parameter(data, requires_grad=param.requires_grad)

    def fake_buffer(module, name, buffer):
        if buffer is None or isinstance(buffer, FakeTensor):
            return None
        with no_torch_function():
            return placed(fake.from_tensor(buffer), buffer)

    def placed(stand_in, real):
        if virtual is not None:
            virtual.mode.tag_like_value(stand_in, real)
        return stand_in

    # `nn.Parameter(data)` makes a plain tensor a parameter in C++, unseen by function modes,
    # but a tensor subclass (a fake tensor) through `data.detach().requires_grad_()`: calls a
    # real run never makes (module.to() re-wraps every weight), kept out of the trace.
    make_parameter = torch.nn.Parameter.__new__

    def parameter(cls, data=None, requires_grad=True):
        with no_torch_function() if isinstance(data, FakeTensor) else contextlib.nullcontext():
            return make_parameter(cls, data, requires_grad)

    with contextlib.ExitStack() as stack:
        stack.callback(register_module_parameter_registration_hook(fake_parameter).remove)
        stack.callback(register_module_buffer_registration_hook(fake_buffer).remove)
        stack.enter_context(patched(torch.nn.Parameter, "__new__", parameter))
        stack.enter_context(quiet_fake_tensor_log())
        stack.enter_context(gc_paused())
        stack.enter_context(foreach_defaults_as_real())
        stack.enter_context(norm_stats_as_real())
        stack.enter_context(DistributedBuffers(fake))  # below the recorders: they see its ops
        yield


@contextlib.contextmanager
def fake_values(read: list[str], answered: list[str]) -> Iterator[None]:
    """`.item()` of a fake tensor (or a DTensor of fake shards; a loss printed for the log)
    returns NaN, and the line is noted in `read`. A truth test of a fake tensor inside torch or an installed library
    (`if not mask.any()` in `nn.init.trunc_normal_`, a trainer's `isnan(loss)` filter) is
    answered as the usual case — no element of `.any()`, every element of `.all()`, otherwise
    false: no value out of range, no NaN — which changes no dtype or shape; the library line
    is noted in `answered`. Any other read of a value in user code (`if loss < best`) still
    stops the run."""
    import torch
    from torch.overrides import TorchFunctionMode

    item, boolean = torch.Tensor.item, torch.Tensor.__bool__
    # Fake tensors made by .all() (or torch.all), by id: their truth is True in the usual
    # case. (By id, held weakly to tell a reused id: a tensor's == is elementwise.)
    every = {torch.Tensor.all, torch.all}
    made_by_all: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()

    class FakeValues(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is item and _valueless(args[0]):
                read.append(user_source(skip=2) or "an unknown line")
                return float("nan")
            if func is boolean and _valueless(args[0]):
                line = library_line(sys._getframe(1))
                if line is not None:
                    answered.append(line)
                    return made_by_all.get(id(args[0])) is args[0]
            out = func(*args, **(kwargs or {}))
            if func in every and _valueless(out):
                made_by_all[id(out)] = out
            return out

    with FakeValues():
        yield


def _valueless(t) -> bool:
    """A fake tensor, or a tensor subclass whose inner tensors are all fake, so that nothing in
    it is real: a DTensor of a predicted rank, whose `.item()` and truth reach its fake local
    shard below this mode; a wrapper of weights this mode converted (torchao's float8 training
    wraps a Linear's weight, fake by then, in a subclass of its own and registers the wrapper),
    which converted again would fake the fake inner tensors and fail on their metadata
    (requires_grad)."""
    if isinstance(t, FakeTensor):
        return True
    with no_torch_function():
        inner = inner_tensors(t)
    return bool(inner) and all(_valueless(i) for i in inner)


@contextlib.contextmanager
def swappable(capture: Capture, virtual: VirtualDevice | None,
               fake: FakeTensorMode | None) -> Iterator[None]:
    """`model.to(...)` in a fake run, or in a real one under
    `torch.__future__.set_swap_module_params_on_conversion(True)`: PyTorch swaps each parameter
    with its converted copy (`torch.utils.swap_tensors`), which refuses tensors that have weak
    references, and the recorders hold weak references to the tensors they name. For each
    swap, those references are dropped, the swap is made, and they are put back on the same
    objects (a parameter keeps its name; its device tag follows its new contents)."""
    import torch.utils

    original = torch.utils.swap_tensors
    registries = capture.name_registries()
    on_cpu = virtual.mode.on_cpu if virtual is not None else None
    memos = [fake.fake_tensor_converter.meta_converter.tensor_memo] if fake is not None else []

    def swap_tensors(t1, t2) -> None:
        # Names only: the popped weak references themselves must die before the swap.
        held = [(r, {i: r.pop(i)[1] for i in (id(t1), id(t2)) if i in r}) for r in registries]
        tags = (on_cpu.discard(t1), on_cpu.discard(t2)) if on_cpu is not None else None
        for memo in memos:  # the fake mode's memo of tensors it converted: weak values
            for key in [k for k, v in memo.items() if v is t1 or v is t2]:
                del memo[key]
        original(t1, t2)
        for registry, entries in held:
            for i, name in entries.items():
                t = t1 if i == id(t1) else t2
                registry[i] = (weakref.ref(t), name)
        if on_cpu is not None and tags is not None:
            if tags[1]:
                on_cpu.add(t1)
            if tags[0]:
                on_cpu.add(t2)

    with patched(torch.utils, "swap_tensors", swap_tensors):
        yield
