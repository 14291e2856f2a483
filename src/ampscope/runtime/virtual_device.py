"""The virtual device: during an emulated run, user code that asks which device it is on gets the
target's answer, while its tensors really live on the CPU (or on meta, or are fake).

`VirtualDevice` gives, for the duration of a `with` block, the answers docs/emulation.md lists
("The virtual device": `x.device`, `torch.cuda.*` or `torch.mps.*`, `torch.xpu.*`,
`torch.accelerator.*`, autocast, `torch.compile`, ...) and undoes every change on exit: tensors
report the target through `DeviceMode` (device_mode.py), each device type keeps its own autocast
state (virtual_autocast.py), and the rest is patched here. What cannot be virtual still fails,
and the API turns the failure into one line naming the call and the user's line
(`device_api_error`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import types
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import cast

import torch

from ampscope import hardware
from ampscope.hardware.device_types import device_type
from ampscope.patches import patched
from ampscope.runtime import workers
from ampscope.runtime.compiled import COMPILE_NOTE
from ampscope.runtime.cuda_graphs import GraphUse, graph_pool_handle
from ampscope.runtime.device_internals import internal_patches
from ampscope.runtime.device_load import load_patches
from ampscope.runtime.device_mode import BackingFactories, DeviceMode
from ampscope.runtime.device_rng import rng_patches
from ampscope.runtime.virtual_autocast import AutocastSlots
from ampscope.torchcompat import devices
from ampscope.torchcompat.distributed import dtensor_rng_op
from ampscope.torchcompat.fake import FakeTensor

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)

# --- torch.cuda and friends ------------------------------------------------------------------


class _Properties:
    """What `torch.cuda.get_device_properties()` returns, for the emulated GPU."""

    def __init__(self, accelerator: hardware.Accelerator, capability: tuple[int, int]) -> None:
        self.name = accelerator.title
        # Memory None is only a command line's accelerator: `hardware.by_name`'s always have it.
        self.total_memory = cast(int, accelerator.memory_bytes)
        self.major, self.minor = capability
        self.multi_processor_count = accelerator.multiprocessors or 0
        self.is_integrated = False
        self.is_multi_gpu_board = False

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // 2**20}MB, "
                f"multi_processor_count={self.multi_processor_count}) (emulated)")


class _Event:
    """A CUDA event whose timings are the CPU's wall clock (the run is synchronous)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.time: float | None = None

    def record(self, stream=None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end.time - self.time) * 1e3


class _Stream:
    """A CUDA stream on a device that runs everything in order."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device = device
        self.priority = priority
        self.device_index = 0
        self.stream_id = 0  # the default stream's id on a real device
        # What `torch.Stream` says of itself (FSDP2 passes it to an op of its own): the
        # emulated device's type (CUDA's without a device), as the number c10 gives it (CUDA's 1).
        kind = torch.device(device).type if isinstance(device, (str, torch.device)) else "cuda"
        types = torch.autograd.DeviceType
        self.device_type: int = (getattr(types, kind.upper(), None) or types.CUDA).value

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record()
        return event

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        """No CUDA graph is ever being captured (capture itself is refused): optimizers ask
        before every step."""
        return False

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        pass


class _DeviceIndex:
    """`torch.accelerator.device_index(i)`: switching to the one device is switching nothing."""

    def __init__(self, device: int | None, /) -> None:
        self.idx = device

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


class VirtualDevice:
    """`with VirtualDevice("cuda"):` user code sees one emulated `cuda` device.

    `memory` answers `torch.cuda.memory_allocated()` and `max_memory_allocated()`: a callable
    returning (live bytes, peak bytes) since the last reset, given by a capture's storage
    tracker; without one both are 0 (and a note says so). Re-enterable: a model built under one
    `with` and run under another keeps its tensors' tags.

    `count` is the number of devices `device_count()` reports. None: `LOCAL_WORLD_SIZE` where
    the process is a rank of a torchrun-style job (`ampscope run --nproc` sets it; torchrun
    starts one rank per GPU, so a rank's `set_device(LOCAL_RANK)` must find its device), else 1.
    `set_device(k)` makes `current_device()` k and tensors on the target report `cuda:k`; every
    index is backed by the same CPU.

    `accelerator` (a name of the hardware table, or an entry) is the GPU the device reports:
    its title, memory, SM count and compute capability, which every capability-dependent choice
    then follows (bf16 support here; the SDPA kernel, runtime/attention_choice.py, through the
    `Emulation` the run gives the same capability). None: the device type's default (an H100
    for cuda). An accelerator without a compute capability (an AMD MI300X, a hardware.toml
    entry that gives none) cannot stand in for a CUDA device: the default stays, and a note
    says so (`declined`).
    """

    def __init__(self, target: str, *, accelerator: str | hardware.Accelerator | None = None,
                 count: int | None = None) -> None:
        self.target = target
        if count is None:  # LOCAL_WORLD_SIZE, 1 outside a job (see the class docstring)
            try:
                count = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            except ValueError:
                count = 1
        self.count = count
        entry = device_type(target)  # what the device reports, unless the caller says
        asked = hardware.by_name(accelerator) if isinstance(accelerator, str) else accelerator
        self.declined: hardware.Accelerator | None = None  # asked, but with no capability
        if asked is not None and asked.capability is None and entry.capability is not None:
            self.declined, asked = asked, None
        self.accelerator = asked or (hardware.by_name(entry.accelerator)
                                     if entry.accelerator is not None else None)
        self.capability = (asked.capability if asked is not None else None) or entry.capability
        self.autocast = AutocastSlots(target)
        self.mode = DeviceMode(target)
        self.memory: Callable[[], tuple[int, int]] | None = None
        self.used: set[str] = set()  # which virtual answers the run asked for, for the notes
        self.graphs = GraphUse()  # CUDA graphs, run eagerly
        self._peak_base = 0

    @contextlib.contextmanager
    def active(self, backing: str = "cpu", *,
               memory: Callable[[], tuple[int, int]] | None = None) -> Iterator[VirtualDevice]:
        """The virtual device for the body, with tensors backed by `backing` (cpu, or meta
        while a model for a predicted run is built); `memory` as the class docstring says."""
        self.mode.backing = torch.device(backing)
        if memory is not None:
            self.memory = memory
        with contextlib.ExitStack() as stack:
            for owner, name, value in self._patches():
                stack.enter_context(patched(owner, name, value))
            # Checkpointing caches the device type it first finds: here, the target's.
            stack.enter_context(devices.checkpoint_cache_kept())
            # A script picks NCCL because the virtual device says CUDA is there; torch's warning
            # that this build lacks NCCL concerns the emulation, not the user's code (torch's
            # error, reported in one line, follows).
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", category=UserWarning,
                                    module=r"torch\.distributed\.distributed_c10d",
                                    message="Attempted to get default timeout for nccl backend")
            stack.enter_context(self.autocast.active())
            stack.enter_context(self.mode)
            stack.enter_context(BackingFactories(self.mode))
            yield self

    # -- what is patched
    def _patches(self) -> list[tuple[object, str, object]]:
        backend = getattr(torch, self.target)
        # What torch.<target> and torch.accelerator answer alike.
        shared: dict[str, object] = {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "synchronize": self._note("synchronize", lambda device=None: None),
            "empty_cache": lambda: None,
            "memory_allocated": self._note("memory", lambda device=None: self._live()),
            "max_memory_allocated": self._note("memory", lambda device=None: self._peak()),
            "memory_reserved": lambda device=None: self._live(),
            "max_memory_reserved": lambda device=None: self._peak(),
            "reset_peak_memory_stats": lambda device=None: self._reset_peak(),
        }
        patches: list[tuple[object, str, object]] = [*self.autocast.patches(),
            *((backend, name, value) for name, value in shared.items()),
            (backend, "is_initialized", lambda: True),
            (backend, "init", lambda: None),
            (backend, "reset_max_memory_allocated", lambda device=None: self._reset_peak()),
            (torch, "compile", self._compile),
            (torch.nn.Parameter, "__new__", self.mode.parameter(torch.nn.Parameter.__new__)),
            (FakeTensor, "device", self.mode.fake_device(FakeTensor.__dict__["device"])),
            (torch.Tensor, "device", self.mode.tensor_device()),
        ]
        if hasattr(backend, "is_current_stream_capturing"):
            # Optimizers before 2.13 ask it before every step (CUDA or XPU graph capture).
            patches.append((backend, "is_current_stream_capturing", lambda: False))
        if self.target == "cuda":
            accelerator, capability = self.accelerator, self.capability
            assert accelerator is not None and capability is not None  # (the table's cuda has both)
            patches += [
                (backend, "current_device", lambda: self.mode.index),
                (backend, "set_device", self._set_device),
                (backend, "get_device_name", lambda device=None: accelerator.title),
                (backend, "get_device_capability", lambda device=None: capability),
                (backend, "get_device_properties",
                 lambda device=None: _Properties(accelerator, capability)),
                (backend, "is_bf16_supported", partial(_bf16_supported, capability)),
                (backend, "Event", _Event),
                (backend, "Stream", _Stream),
                (backend, "current_stream", lambda device=None: _Stream()),
                (backend, "default_stream", lambda device=None: _Stream()),
                (backend, "stream", lambda stream=None: contextlib.nullcontext()),
                (backend, "mem_get_info",
                 lambda device=None: (cast(int, accelerator.memory_bytes) - self._live(),
                                      accelerator.memory_bytes)),  # by_name's: never None
                # Profiler ranges mark nothing here.
                (backend.nvtx, "range_push", lambda msg: 0),
                (backend.nvtx, "range_pop", lambda: 0),
                (backend.nvtx, "mark", lambda msg: None),
                (backend.nvtx, "range", lambda msg, *args, **kwargs: contextlib.nullcontext()),
                (torch.backends.cuda, "is_built", lambda: True),
                (torch.backends.cudnn, "is_available", lambda: True),
                # CUDA graphs, run eagerly (runtime/cuda_graphs.py).
                (backend, "CUDAGraph", self.graphs.graph_class()),
                (backend, "graph", self.graphs.graph_context()),
                (backend, "graph_pool_handle", graph_pool_handle),
                (backend, "make_graphed_callables", self.graphs.make_graphed_callables()),
            ]
            patches += [(backend, name, _refusing(backend, name)) for name in _REFUSED
                        if hasattr(backend, name)]
        elif self.target == "mps":
            patches += [(torch.backends.mps, "is_available", lambda: True),
                        (torch.backends.mps, "is_built", lambda: True)]
        return (patches + rng_patches(self.mode) + load_patches(self.mode)
                + self._accelerator_patches(shared) + self._torch_internal_patches())

    def _accelerator_patches(self, shared: dict[str, object]) -> list[tuple[object, str, object]]:
        """`torch.accelerator.*`, which torch's own optimizers, DataLoader, checkpointing and
        serialization ask (a CPU build answers "no accelerator", a CUDA build without a GPU
        fails in the driver): the answers of one target device, `shared` with torch.<target>
        among them. Only the functions this release has are patched."""
        target = self.target
        answers: dict[str, object] = {
            **shared,
            "current_accelerator": lambda check_available=False: torch.device(target),
            "current_device_index": lambda: self.mode.index,
            "current_device_idx": lambda: self.mode.index,  # the older, deprecated names
            "set_device_index": self._set_device,
            "set_device_idx": self._set_device,
            "device_index": _DeviceIndex,
            "current_stream": lambda device=None: _Stream(device),
            "set_stream": lambda stream: None,
        }
        if self.accelerator is not None:
            memory = cast(int, self.accelerator.memory_bytes)  # by_name's: never None
            answers["get_memory_info"] = lambda device=None: (memory - self._live(), memory)
        return [(torch.accelerator, name, value) for name, value in answers.items()
                if hasattr(torch.accelerator, name)]

    def _torch_internal_patches(self) -> list[tuple[object, str, object]]:
        """What torch asks below the public device API: the module of the current accelerator,
        the accelerator and tensor subclasses (runtime/device_internals.py), and the pinning
        of DataLoader batches (done in a thread of its own, which the device
        mode does not reach)."""
        get_device_module = torch.get_device_module  # its default: the target's module
        patches: list[tuple[object, str, object]] = [(torch, "get_device_module",
            lambda device=None: get_device_module(self.target if device is None else device))]
        patches += internal_patches(self.mode, self.target)
        rng_op = dtensor_rng_op()
        if rng_op is not None:
            # A shard's random op at its offset of CUDA's Philox generator: the virtual
            # device's generator is the CPU's, which has no offsets; the op runs on it.
            patches.append((*rng_op, self._note(
                "dtensor_rng", lambda start, end, op, *args, **kwargs: op(*args, **kwargs))))
        pinning = devices.dataloader_pinning()
        if pinning is not None:
            patches.append((pinning, "pin_memory", workers.pinned(self.mode)))
        return patches

    def _set_device(self, device) -> None:
        """`set_device(k)` (an index, "cuda:k" or a torch.device): the current device becomes
        k, refused as CUDA refuses it when k is not one of the `count` devices."""
        if isinstance(device, str | torch.device):
            device = torch.device(device)
            if device.type != self.target:
                raise ValueError(f"Expected a {self.target} device, but got: {device}")
            device = device.index
        if device is None or device < 0:  # CUDA ignores a negative index
            return
        if device >= self.count:
            raise RuntimeError(f"{self.target} error: invalid device ordinal {device} (the "
                               f"virtual device has {self.count})")
        self.mode.index = int(device)

    def _note(self, what: str, fn: Callable) -> Callable:
        def noted(*args, **kwargs):
            self.used.add(what)
            return fn(*args, **kwargs)

        return noted

    def _compile(self, model=None, **kwargs):
        self.used.add("compile")
        if model is None:  # @torch.compile(...) as a decorator factory
            return lambda fn: fn
        return model

    # -- memory, from the capture's storage tracker
    def _live(self) -> int:
        return self.memory()[0] if self.memory is not None else 0

    def _peak(self) -> int:
        if self.memory is None:
            return 0
        return max(self.memory()[1] - self._peak_base, self._live())

    def _reset_peak(self) -> None:
        if self.memory is not None:
            live, peak = self.memory()
            self._peak_base = peak - live

    def notes(self) -> list[str]:
        """What the run's code asked of the virtual device, in plain words."""
        count = 'one' if self.count == 1 else f'{self.count} ×'
        what = f"{count} {self.target} device" if self.accelerator is None else \
            f"{count} {self.accelerator.title}"
        if self.capability is not None:
            what += f", compute capability {self.capability[0]}.{self.capability[1]}"
        notes = [f"Code that asked which device it was on saw {self.target} ({what}): tensors "
                 "really lived on the CPU."]
        if self.declined is not None:
            notes.append(f"The virtual {self.target} device is not the asked {self.declined.title}"
                         f" ({self.declined.name}): the hardware table gives it no CUDA compute "
                         "capability, which every kernel choice depends on, so it kept its "
                         "default.")
        if "compile" in self.used:
            notes.append(COMPILE_NOTE)
        notes += self.graphs.notes(self.target)
        if "dtensor_rng" in self.used:
            notes.append("DTensor's random ops (nn.init on sharded parameters) drew from each "
                         "rank's CPU generator: a GPU's Philox offsets per shard are not "
                         "emulated, so the values differ; dtypes and shapes do not.")
        if "synchronize" in self.used:
            notes.append(f"torch.{self.target}.synchronize() returned at once: the run is "
                         "synchronous on the CPU, and its timings are the CPU's.")
        if "memory" in self.used:
            source = ("ampscope's storage tracker, in 512-byte blocks" if self.memory is not None
                      else "nothing (no capture was tracking storages): 0")
            notes.append(f"torch.{self.target}.memory_allocated() and max_memory_allocated() "
                         f"answered from {source}.")
        for call in dict.fromkeys(self.mode.unsupported):
            notes.append(f"{call} ran on the CPU: only {self.target} is virtual here.")
        for note in notes:
            log.info("%s", note)
        return notes


# torch.cuda calls a virtual device cannot answer truthfully, which a CUDA build without a GPU
# would run as silent no-ops (it was never initialized): refused by name instead.
_REFUSED = ("ipc_collect",)


def _bf16_supported(capability: tuple[int, int], including_emulation: bool = True) -> bool:
    """`torch.cuda.is_bf16_supported()` as torch's own answers on a GPU of `capability`: True
    from compute capability 8.0 (Ampere); below it, True only while `including_emulation`,
    because there torch tries to make a bfloat16 tensor on the device, which an older GPU does
    (CUDA emulates its arithmetic in float32), so a plain call says True even on a V100 or T4."""
    return capability >= (8, 0) or including_emulation


def _refusing(backend: types.ModuleType, name: str) -> Callable:
    """`backend.name` run as the real thing: with CUDA's initialization no longer answered,
    it fails inside torch.cuda on this GPU-less machine, which `device_api_error` turns into
    the one-line refusal naming `torch.cuda.<name>()` and the user's line."""
    original = getattr(backend, name)
    real_is_initialized = backend.is_initialized

    def refused(*args, **kwargs):
        with patched(backend, "is_initialized", real_is_initialized):
            original(*args, **kwargs)
        raise RuntimeError(f"torch.{backend.__name__.removeprefix('torch.')}.{name}() "
                           "cannot be emulated: it needs the real device")

    refused.__name__ = name
    return refused
