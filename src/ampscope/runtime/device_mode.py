"""Tensors that say they are on the target device while they live on the CPU: `DeviceMode`.

A TorchFunctionMode that rewrites the target device in factory calls
(`torch.zeros(..., device="cuda")`) and moves (`.to("cuda")`, `.cuda()`, `.cpu()`) to the
backing device, and answers `tensor.device`, `.is_cuda`, `.get_device()` from a tag: a tensor
is on the target unless it was made on the CPU on purpose (a factory without a device,
`torch.from_numpy`, `.cpu()`), and an op's result is on the CPU only when all its tensor
inputs are. `VirtualDevice` (virtual_device.py) enters it with the rest of the emulated
device's API.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ampscope.nested import tensors_in
from ampscope.torchcompat import devices
from ampscope.torchcompat.dispatch import (
    TorchDispatchMode,
    active_fake_mode,
    higher_order,
    no_torch_function,
    run_decomposed,
)
from ampscope.torchcompat.fake import FakeTensor

# Any: its members are read as the descriptors they are (`.device.__get__`), which torch's stubs,
# declaring them as instance attributes, do not describe.
_TensorBase: Any = devices.tensor_base()
_GETTERS = {  # attribute reads that say where a tensor is
    _TensorBase.device.__get__: "device",
    _TensorBase.is_cuda.__get__: "is_cuda",
    _TensorBase.is_cpu.__get__: "is_cpu",
    _TensorBase.is_mps.__get__: "is_mps",
    _TensorBase.is_xpu.__get__: "is_xpu",
}
_DATA_SET = _TensorBase.data.__set__
_MOVES = {getattr(_TensorBase, name) for name in ("to", "cuda", "cpu", "mps", "xpu")
          if hasattr(_TensorBase, name)}
_NO_OPS = {_TensorBase.pin_memory, _TensorBase.is_pinned}
_PARSE_TO = devices.parse_to()
# Calls that only name a device: handed on with the target's name unchanged (`module.to(
# torch.device("cuda"))` reads its arguments with the parser, then moves each tensor there).
_NAMING = frozenset({torch.device, _PARSE_TO})
# Every call DeviceMode answers itself rather than handing on as is.
_SPECIAL = frozenset({*_GETTERS, _DATA_SET, _TensorBase.get_device, *_NO_OPS, *_MOVES,
                      *_NAMING})


# Factories that follow the default device (`torch.zeros`, `torch.arange`, ...).
_CONSTRUCTORS = devices.device_constructors()

_METHOD_WRAPPER = type(_TensorBase.grad.__get__)
_NOT_TENSORS = frozenset({bool, int, float, type(None)})


class _CpuTags:
    """The tensors put on the CPU on purpose, weakly held. Most tensors of an emulated run are
    on the target, and asking a weak-keyed dictionary costs a weak reference per question: a set
    of ids answers "no" at once for a tensor never tagged (the id of a tensor gone, reused, only
    sends the question on to the dictionary)."""

    def __init__(self) -> None:
        self._tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # The ids of every tensor ever tagged: an id not in it is never tagged (read directly
        # on the hot paths, where the method call would cost as much as the answer).
        self.ids: set[int] = set()

    def __contains__(self, t: object) -> bool:
        return id(t) in self.ids and t in self._tags

    def add(self, t: torch.Tensor) -> None:
        self._tags[t] = True
        self.ids.add(id(t))

    def discard(self, t: torch.Tensor) -> bool:
        """Untag `t` (its weak reference goes with it); whether it was tagged."""
        return self._tags.pop(t, None) is not None


class _Getter(Protocol):
    """A property that has a getter (`FakeTensor.device`): `property`'s own type allows none."""

    @property
    def fget(self) -> Callable[[Any], Any]: ...
    @property
    def fset(self) -> Callable[[Any, Any], None] | None: ...


class DeviceMode(TorchFunctionMode):
    """Tensors on the target device, as user code sees them (see the module docstring)."""

    def __init__(self, target: str, backing: str = "cpu") -> None:
        super().__init__()
        self.target = target  # "cuda", "mps", "xpu"
        self.backing = torch.device(backing)  # where tensors really are: cpu or meta
        self.on_cpu = _CpuTags()  # tensors the user put on cpu
        self.unsupported: list[str] = []
        self.index = 0  # the current device (`torch.cuda.set_device`): what tensors report
        # The storages the torch.load in progress restored on the target, by id (held, so that
        # their ids stay theirs until it ends): tensors set on them are on the target.
        self._restored: dict[int, object] = {}

    # -- devices as arguments
    def is_target(self, device: Any) -> bool:
        """Whether `device` (a torch.device or its name) names the target device."""
        if isinstance(device, torch.device):
            return device.type == self.target
        if isinstance(device, str):
            return device.split(":")[0] == self.target
        return False

    def _real(self, device: Any) -> Any:
        """A device argument as the backing device sees it."""
        return self.backing if self.is_target(device) else device

    def default_device(self) -> torch.device:
        """The default device the script set (`torch.set_default_device("cuda")`, whose mode
        torch keeps below this one), "cuda" as the current device: found without the empty
        tensor `torch.get_default_device()` makes, which would reach that mode and the real,
        missing device."""
        given = devices.default_device_given()
        if given.type == self.target and given.index is None:
            return torch.device(self.target, self.index)
        return given

    def _virtual(self, t: torch.Tensor) -> torch.device:
        return torch.device("cpu") if t in self.on_cpu else torch.device(self.target,
                                                                         self.index)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SPECIAL:  # one lookup for the rare calls about devices (most are not)
            return self._special(func, args, kwargs or {})
        if type(func) is _METHOD_WRAPPER and func.__name__ == "__get__":
            # An attribute read (`p.grad`, `x.T`), a dozen per parameter in an optimizer's
            # loop: its result is where the tensor read is, which is on the target unless
            # tagged.
            out = func(*args)
            if id(args[0]) in self.on_cpu.ids and args[0] in self.on_cpu:
                self._tag(out, args, {}, None)
            return out
        device = kwargs.get("device") if kwargs else None
        if device is None and func in _CONSTRUCTORS:
            # `with torch.device("cuda"):` puts its mode at the bottom of the stack, below this
            # one: the target default device is made explicit (and real) here.
            default = self.default_device()
            if default.type == self.target:
                device = default
        if device is not None:
            kwargs = dict(kwargs or {}, device=self._real(device))
        elif kwargs is None:
            kwargs = {}
        for a in args:
            if type(a) is torch.device:
                args = tuple(self._real(a) if isinstance(a, torch.device) else a for a in args)
                break
        out = func(*args, **kwargs)
        if self._restored:  # only while a torch.load restores storages on the target
            self._claim_restored(args)
        self._tag(out, args, kwargs, device)
        return out

    def _special(self, func, args: tuple, kwargs: dict) -> Any:
        getter = _GETTERS.get(func)
        if getter is not None:
            device = self._virtual(args[0])
            if getter == "device":
                return device
            return device.type == getter.removeprefix("is_")
        if func == _DATA_SET:  # param.data = moved: the parameter is where its data is
            out = func(*args, **kwargs)
            self.tag_like_value(args[0], args[1])
            return out
        if func is _TensorBase.get_device:
            return -1 if args[0] in self.on_cpu else 0
        if func in _NO_OPS:  # pinned memory is a CUDA host allocation: nothing to do here
            return args[0] if func is _TensorBase.pin_memory else True
        if func in _MOVES:
            return self._move(func, args, kwargs)
        return func(*args, **kwargs)  # _NAMING: naming a device is not using it

    def _claim_restored(self, args: tuple) -> None:
        """During a torch.load: a tensor on a storage it restored on the target is on the
        target. torch.load makes each tensor on the backing device (`torch.empty(...,
        device=storage.device)`, tagged) and sets it on its storage with `Tensor.set_`, which
        no function mode sees; the next call on it (`tensor.requires_grad = ...`, which every
        rebuild makes) is where the mode learns where it is."""
        t = args[0] if args else None
        if not isinstance(t, torch.Tensor) or id(t) not in self.on_cpu.ids:
            return
        with no_torch_function():
            storage = t.untyped_storage()
        if self._restored.get(id(storage)) is storage:
            self.on_cpu.discard(t)

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """For a torch.load: the storages it restores on the target are known until it ends."""
        outer, self._restored = self._restored, {}
        try:
            yield
        finally:
            self._restored = outer

    def restored_on_target(self, storage: object) -> None:
        """`storage`, restored on the backing device, stands for one on the target."""
        self._restored[id(storage)] = storage

    def _tag(self, out: Any, args: tuple, kwargs: dict, device: Any) -> None:
        """Results are on the CPU when the call put them there: an explicit CPU device, a
        factory on the default (CPU) device, or inputs that are all on the CPU."""
        if type(out) in _NOT_TENSORS:  # .item(), is_complex(): most calls in a predicted step
            return
        if device is None and args and isinstance(args[0], torch.Tensor) \
                and id(args[0]) not in self.on_cpu.ids:
            return  # an input on the target (most calls): not all of them are on the CPU
        results = [out] if isinstance(out, torch.Tensor) else tensors_in(out)
        if not results:
            return
        if device is not None:
            on_cpu = torch.device(device).type == "cpu"
        else:
            inputs = tensors_in((args, kwargs))
            if inputs:
                on_cpu = all(t in self.on_cpu for t in inputs)
            else:
                on_cpu = self.default_device().type == "cpu"
        if on_cpu:
            for t in results:
                if t.device == self.backing or t.device.type == "cpu":
                    self.on_cpu.add(t)

    def _move(self, func, args: tuple, kwargs: dict) -> Any:
        t = args[0]
        forced_copy = False
        if func is _TensorBase.cpu:
            to_cpu = True
            rest_args, rest_kwargs = (), {k: v for k, v in kwargs.items() if k == "memory_format"}
        elif func is _TensorBase.to:
            kwargs = dict(kwargs)
            copy = kwargs.pop("copy", False)
            device, dtype, non_blocking, memory_format = _PARSE_TO(*args[1:], **kwargs)
            other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
            if other is not None:  # .to(other): other's device and dtype, as the user sees it
                device = self._virtual(other)
            if device is None:  # a dtype change only
                out = func(*args, **kwargs, copy=copy)
                self.tag_like_value(out, t)
                return out
            to_cpu = device.type == "cpu"
            forced_copy = copy
            rest_args = ()
            rest_kwargs = {"dtype": dtype, "non_blocking": non_blocking,
                           "memory_format": memory_format or torch.preserve_format}
        else:  # .cuda(), .mps(), .xpu()
            name = func.__name__
            if name != self.target:
                self.unsupported.append(f"Tensor.{name}()")
                return func(*args, **kwargs)
            to_cpu = False
            rest_args, rest_kwargs = (), {}
        already = (t in self.on_cpu) == to_cpu and not (func is _TensorBase.to and forced_copy)
        kwargs = {k: v for k, v in rest_kwargs.items() if v is not None}
        if already:
            out = t.to(**kwargs) if kwargs.get("dtype") not in (None, t.dtype) else t
        else:  # a copy to the other device: a new tensor, as a device copy makes
            out = t.to(*rest_args, copy=True, **kwargs)
        if to_cpu:
            self.on_cpu.add(out)
        elif out is not t:
            self.on_cpu.discard(out)
        return out

    def parameter(self, original: Callable) -> Callable:
        """`nn.Parameter.__new__` that puts the parameter where its data is (a Parameter is a
        new tensor object made in C++, which no function mode sees)."""
        mode = self

        def __new__(cls, data=None, requires_grad=True):
            param = original(cls, data, requires_grad)
            if data is not None and data in mode.on_cpu or data is None and mode.default_device().type == "cpu":
                mode.on_cpu.add(param)
            return param

        return __new__

    def tensor_device(self) -> property:
        """`Tensor.device`, answered from the tag for every reader but PyTorch's private
        internals (its underscored modules, whose kernels must see where the tensor really
        is) and ampscope's own code. A property rather than the mode's getter alone: PyTorch's own Python
        functions (`torch.norm` takes another path on MPS) read the device inside a torch
        function the mode handed on, with the mode off its stack, and must still see the
        target, as on the device."""
        mode = self
        getter = _TensorBase.device.__get__
        disabled = no_torch_function  # the C context manager: no Python frame between

        def device(t: torch.Tensor) -> torch.device:
            with disabled():
                real = getter(t)
            reader = sys._getframe(1).f_globals.get("__name__", "")
            if real != mode.backing or reader.startswith(_INTERNAL):
                return real
            return mode._virtual(t)

        return property(device)

    def fake_device(self, original: _Getter) -> property:
        """`FakeTensor.device`, which a fake tensor answers in Python without a torch function
        call: answered from the tag, as the TensorBase getter is (also inside a PyTorch Python
        function the mode handed on, as `tensor_device` does), except to PyTorch's private
        internals (FakeTensorMode's device propagation and cache keys, decompositions, meta
        kernels), which run inside ops that may be dispatched straight from C++ with the mode
        still on the stack (`nn.Parameter(...)`), and to ampscope's own code: both must see
        where the fake tensor really is."""
        mode = self

        def device(t: FakeTensor) -> torch.device:
            if t.fake_mode.in_kernel_invocation:
                return original.fget(t)
            reader = sys._getframe(1).f_globals.get("__name__", "")
            if reader.startswith(("torch._", "ampscope.")):
                return original.fget(t)
            return mode._virtual(t)

        return property(device, original.fset)

    def tag_like_value(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """`t` is where `value` is, as user code sees it (also for a stand-in ampscope made for
        `value` without a torch function call: a predicted script's fake weight for a real one)."""
        if value in self.on_cpu:
            self.on_cpu.add(t)
        else:
            self.on_cpu.discard(t)


# Readers of a tensor's device that must see where it really is: ampscope's own code,
# PyTorch's private internals, and functional collectives, whose AsyncCollectiveTensor wraps
# its result on the result's device (tensor parallelism's redistributions return one through an
# autograd Function: one made on the target device would send the autograd engine to the
# target's device guard, which a CPU build does not have). DTensor's and FSDP2's modules are
# left to see the target: they move local tensors to their mesh's device when they differ.
_INTERNAL = ("torch._", "ampscope.", devices.FUNCTIONAL_COLLECTIVES_MODULE)


class BackingFactories(TorchDispatchMode):
    """The target device in an aten factory call, made the backing device: for the calls
    `DeviceMode` cannot see. The autograd engine runs backward hooks and custom backward
    functions without torch-function modes, so a `torch.empty(..., device="cuda:1")` made there
    (FSDP2's gradient reduction makes its buffers so) reaches the dispatcher with the target
    device; dispatch modes still see it, and this one hands it on with the backing device. The
    tensor made is untagged, so `DeviceMode` says it is on the target. Under a FakeTensorMode
    the call goes on as it is: fake tensors keep the target device themselves."""

    supports_higher_order_operators = True

    def __init__(self, device_mode: DeviceMode) -> None:
        super().__init__()
        self.device_mode = device_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if higher_order(func):  # flex_attention: its aten ops come through one by one
            return run_decomposed(self, func, args, kwargs)
        device = kwargs.get("device") if kwargs else None
        if device is not None and self.device_mode.is_target(device) and \
                active_fake_mode() is None:
            kwargs = dict(kwargs, device=self.device_mode.backing)
        # Handed on below this mode only: an op is no user-level call for the torch-function
        # modes above (the recorders' call log, DeviceMode) to see again.
        with no_torch_function():
            return func(*args, **(kwargs or {}))
