"""`RunEnvironment`: what one run happens in, assembled once and in one order.

A run is a setting (its dtypes, autocast, matmul precision, target device), real or predicted,
on this machine's device or emulated. Every command that runs a model (`trace`, `run`, each
rank of `run --nproc`, `fit`, `fit --gpus`, `memory --measure`, the distributed step) builds
one `RunEnvironment` and asks it for each context, instead of assembling them itself:

    env = RunEnvironment(setting, predict=True)
    lm = env.load("gpt2")                       # built on the same virtual device it runs on
    with env.applied(lm.module):                # global state saved, the setting applied,
        capture = env.capture(lm.module, ...)   # the emulation in place
        with env.predicting(), env.recording(capture):  # the fake mode; the capture, and
            ...                                 # the virtual device over it
    notes = env.emulation_notes(trace, workload) + env.device_notes()

The order is fixed here, and why: the setting's working copies of the weights are made before
the emulation's modes (a copy is no norm and no autocast region, and each mode would see every
copy), the fake mode is entered inside them (a predicted run's copies are fake), and the
virtual device is entered last, inside the capture, so that the capture's storage tracker
answers `torch.cuda.memory_allocated()`.

A speed trick that fails is one exception type, `tricks.TrickFailed`; `exact_retry` reruns the
attempt on the exact path in one place.

Known limitations: a script run (`script/`) enters the environment's contexts one by one
(`emulated`, the capture's `recording`, `device_active`) between its own (its workers, its
files, its modules as they are made); a real multi-rank run's ranks are never emulated (a
real process group needs the real device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from torch import nn

from ampscope.hardware import Accelerator
from ampscope.hardware.device_types import device_type
from ampscope.models.loading import load
from ampscope.precision import Setting, applied, device_available
from ampscope.runs.session import Capture, CaptureOptions
from ampscope.runtime.attention_choice import CudaTarget
from ampscope.runtime.emulation import Emulation
from ampscope.runtime.predict import check_matmul_dtypes, fake_mode, gc_enabled, predicting
from ampscope.runtime.virtual_autocast import target_default_dtype
from ampscope.runtime.virtual_device import VirtualDevice
from ampscope.tricks import TrickFailed, exact, exact_path

if TYPE_CHECKING:
    from ampscope.models.base import LoadedModel
    from ampscope.records import SettingRecord, Trace
    from ampscope.torchcompat.fake import FakeTensorMode

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)

T = TypeVar("T")


class RunEnvironment:
    """One run's environment: the setting, real or predicted, the target device (emulated
    where this machine lacks it), and everything each of those enters, in one order.

    `setting`: what the run applies (its device is the target). `predict`: fake tensors.
    `device`: for a run with no setting of its own (a user's script, `capture`), the device
    its code should believe it has, emulated where missing; `virtual` forces the virtual
    device where the device exists (to compare the two). `gpu`: the accelerator (`--gpu`: a
    name of the hardware table, or its entry) an emulated cuda device is, its capability
    followed by the virtual device's answers and the emulation's kernel choices alike; None,
    or a device that is real or names no accelerator: the default (an H100 for cuda)."""

    def __init__(self, setting: Setting | None = None, *, predict: bool = False,
                 device: str | None = None, virtual: bool | None = None,
                 gpu: str | Accelerator | None = None) -> None:
        self.setting = setting
        target = device if setting is None else setting.device
        if setting is not None:
            emulated = setting.emulated
        else:
            emulated = target is not None and (not device_available(target) if virtual is None
                                               else virtual)
        self.device = target  # the device the run's code believes it has (None: this one)
        self.target = target if emulated else None  # the device emulated here, if one is
        self.predict = predict  # decided later for a run that plans first (api/preparation.py)
        self._fake: FakeTensorMode | None = None
        # One virtual device for loading and running: a model built under it keeps its tags.
        # Only a device type that reports an accelerator (cuda) takes the asked one.
        self.virtual = VirtualDevice(
            target, accelerator=gpu if device_type(target).accelerator is not None else None
        ) if emulated and target is not None else None
        # The GPU whose kernels the emulation chooses: the one the virtual device reports.
        self.gpu = CudaTarget(self.virtual.accelerator.name.upper(), self.virtual.capability) \
            if self.virtual is not None and self.virtual.accelerator is not None \
            and self.virtual.capability is not None else None
        self.emulation: Emulation | None = None  # set while applied

    @property
    def fake(self) -> FakeTensorMode | None:
        """A predicted run's one fake mode (made on first use), None for a real run."""
        if self.predict and self._fake is None:
            self._fake = fake_mode()
        return self._fake if self.predict else None

    @property
    def gpu_name(self) -> str | None:
        """The GPU the run stands for, by its hardware-table name (SettingRecord.gpu): the
        virtual device's; None on a real device or one without an accelerator."""
        if self.virtual is None or self.virtual.accelerator is None:
            return None
        return self.virtual.accelerator.name

    def setting_record(self) -> SettingRecord:
        """The setting's record, with the GPU the run stands for."""
        assert self.setting is not None
        return dataclasses.replace(self.setting.record(), gpu=self.gpu_name)

    # -- loading
    def load(self, model, *, device: str | None = None, have_inputs: bool = False
             ) -> LoadedModel:
        """`model` (a spec, a module, a LoadedModel) built for this run: a spec's own code runs
        on the virtual device, backed by `device` (meta to count before building)."""
        assert self.setting is not None  # (only runs with a setting load a model)
        return load(model, device=device or self.setting.run_device, have_inputs=have_inputs,
                    target_device=self.target, virtual=self.virtual)

    # -- running
    @contextlib.contextmanager
    def applied(self, model: nn.Module | None = None) -> Iterator[RunEnvironment]:
        """The setting applied to `model` (its working copies, fake in a predicted run;
        torch's global state and the model as they were afterwards, also on error) and the
        emulation in place."""
        assert self.setting is not None  # (a script run enters through its own contexts)
        with applied(self.setting, model, fake=self.fake, gpu=self.gpu) as emulation:
            self.emulation = emulation  # kept after the run: its notes read what it chose
            yield self

    def predicting(self, *, collecting: bool = True) -> contextlib.AbstractContextManager:
        """A predicted run's fake mode and what goes with it (runtime/predict.py); a real
        run's garbage collector as the caller had it (`collecting`)."""
        if self.fake is not None:
            return predicting(self.fake)
        return gc_enabled(collecting)

    def capture(self, model: nn.Module | None, **options) -> Capture:
        """A `Capture` of `model` for this run (`options`: CaptureOptions fields) with what
        this run decides: the setting's record, the dtype check a fake run's meta kernels
        lack, and block replay where the speed tricks are on."""
        if self.setting is not None:
            options.setdefault("setting", self.setting_record())
        else:  # the setting is observed (runs/observed.py)
            options.setdefault("gpu", self.gpu_name)
        if self.fake is not None:
            options["values"] = False  # a fake tensor has none
            options.setdefault("op_check", check_matmul_dtypes)
            if model is not None:
                options.setdefault("replay_blocks", not exact())
        return Capture(model, CaptureOptions(**options))

    @contextlib.contextmanager
    def recording(self, capture: Capture) -> Iterator[None]:
        """`capture` recording, and the virtual device over it (its memory calls answered by
        the capture's storage tracker)."""
        with capture.recording(), self.device_active(capture):
            yield

    def device_active(self, capture: Capture | None = None
                      ) -> contextlib.AbstractContextManager:
        """The virtual device, where this run has one (else nothing)."""
        if self.virtual is None:
            return contextlib.nullcontext()
        return self.virtual.active(memory=capture.memory_now if capture is not None else None)

    @contextlib.contextmanager
    def emulated(self) -> Iterator[Emulation | None]:
        """The target's emulation alone (kernels and autocast policy), for a run without a
        setting of its own (with a setting, `applied` enters it); kept for the notes."""
        if self.target is None:
            yield None
            return
        with Emulation(self.target, target_default_dtype(self.target), self.gpu) as emulation:
            self.emulation = emulation
            yield emulation

    def emulation_notes(self, trace: Trace, workload: str | None = None) -> list[str]:
        """What the emulation assumed (the target's policy, the kernels it chose as the
        device would), for the trace's notes; `workload` None: a script's run, whose
        evaluation passes count too, and whose policy the setting line already names."""
        if self.emulation is None:
            return []
        phases = ("forward",) if workload is not None else ("forward", "evaluation")
        ops = [o.op for o in trace.ops if o.phase in phases]
        calls = sum(1 for c in trace.calls if c.phase in phases
                    and c.func == "torch.nn.functional.scaled_dot_product_attention")
        if workload is None:
            return self.emulation.kernel_notes(ops, calls)
        return self.emulation.notes(workload, ops, calls)

    def device_notes(self) -> list[str]:
        """What the run's code asked of the virtual device, where it had one."""
        return self.virtual.notes() if self.virtual is not None else []


def exact_retry(attempt: Callable[[], T], *, what: str = "the run") -> T:
    """`attempt()`, and where a speed trick failed in it (`TrickFailed`), `attempt()` again on
    the exact path, every trick off: the one place a run falls back."""
    try:
        return attempt()
    except TrickFailed as failed:
        if exact():
            raise
        log.info("a speed trick could not be trusted (%s): %s again on the exact path",
                 failed, what)
        with exact_path():
            return attempt()
