"""What a script run in the caller's process may change there, saved before and put back after.

Whatever a script run with `run_script(..., in_process=True)` sets for its own process would
otherwise stay set in the caller (the list: docs/api.md, "Where it runs"). `ProcessState.save()`
reads all of it through public APIs, and `restore()` puts back each value that differs, one at
a time, so one that cannot be set (a setting this torch build lacks) never keeps the others
from coming back.

Tests compare the whole of it against tests/helpers.py's `torch_state()` after runs that fail in
every way (tests/test_state.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from ampscope.precision import GlobalState
from ampscope.torchcompat.devices import default_device_context


def _flag(owner: object, name: str) -> tuple[Callable[[], object], Callable[[object], None]]:
    """A settable module attribute (torch.backends.cudnn.benchmark) as a getter and a setter."""
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _settings() -> dict[str, tuple[Callable[[], object], Callable[[object], None]]]:
    """Each of torch's process-wide settings a training script commonly changes, as a getter and
    a setter (the ones GlobalState keeps are not repeated here). Built at each save: a setting
    this build lacks is simply not listed."""
    backends = torch.backends
    found: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {
        "anomaly": ((lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())),
                    (lambda v: torch.set_anomaly_enabled(*v))),  # type: ignore[misc]
        "deterministic": ((lambda: (torch.are_deterministic_algorithms_enabled(),
                                    torch.is_deterministic_algorithms_warn_only_enabled())),
                          (lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]))),  # type: ignore[index]
        "deterministic_debug": (torch.get_deterministic_debug_mode,
                                torch.set_deterministic_debug_mode),  # type: ignore[dict-item]
        "warn_always": (torch.is_warn_always_enabled, torch.set_warn_always),  # type: ignore[dict-item]
        "autocast_cache": (torch.is_autocast_cache_enabled,
                           torch.set_autocast_cache_enabled),  # type: ignore[dict-item]
        "num_threads": (torch.get_num_threads, torch.set_num_threads),  # type: ignore[dict-item]
        "cudnn.enabled": _flag(backends.cudnn, "enabled"),
        "cudnn.benchmark": _flag(backends.cudnn, "benchmark"),
        "cudnn.deterministic": _flag(backends.cudnn, "deterministic"),
        "mkldnn.enabled": _flag(backends.mkldnn, "enabled"),
        "opt_einsum.enabled": _flag(backends.opt_einsum, "enabled"),
    }
    deterministic = getattr(torch.utils, "deterministic", None)
    if deterministic is not None and hasattr(deterministic, "fill_uninitialized_memory"):
        found["fill_uninitialized_memory"] = _flag(deterministic, "fill_uninitialized_memory")
    future = torch.__future__  # how module.to() converts parameters (swap_tensors, or not)
    for name in ("overwrite_module_params_on_conversion", "swap_module_params_on_conversion"):
        if hasattr(future, f"set_{name}"):
            found[name] = (getattr(future, f"get_{name}"), getattr(future, f"set_{name}"))
    mha = getattr(backends, "mha", None)
    if mha is not None and hasattr(mha, "set_fastpath_enabled"):
        found["mha_fastpath"] = (mha.get_fastpath_enabled, mha.set_fastpath_enabled)
    for name in ("flash", "mem_efficient", "math", "cudnn"):  # scaled-dot-product kernels
        if hasattr(backends.cuda, f"enable_{name}_sdp"):
            found[f"sdp.{name}"] = (getattr(backends.cuda, f"{name}_sdp_enabled"),
                                    getattr(backends.cuda, f"enable_{name}_sdp"))
    return found


def _default_device() -> str | None:
    """The default device `torch.set_default_device` set, as it was given ("cuda", "cuda:1"),
    None when none is (torch itself answers "cpu" for both). Read off its mode, not from
    `torch.get_default_device()`, which makes a tensor there: after a run on the virtual
    device, a script's "cuda" is a device this build lacks, and must still be put back."""
    context = default_device_context()
    if context is None:
        return None
    device = getattr(context, "device", None)
    return str(device) if device is not None else str(torch.get_default_device())


@dataclass
class ProcessState:
    """The caller's process as it was before a script ran in it."""

    torch_state: GlobalState
    settings: dict[str, object]
    default_device: str | None
    argv: list[str]
    path: list[str]
    cwd: str
    environ: dict[str, str]
    streams: tuple[object, object, object]
    signals: dict[int, object] = field(default_factory=dict)
    warning_filters: Sequence[tuple] = field(default_factory=list)
    showwarning: object = None
    excepthook: object = None
    root_handlers: list[logging.Handler] = field(default_factory=list)
    root_level: int = logging.WARNING
    process_group: bool = False  # torch.distributed's default group existed

    @classmethod
    def save(cls) -> ProcessState:
        settings = {}
        for name, (get, _) in _settings().items():
            try:
                settings[name] = get()
            except Exception:  # noqa: BLE001 - a setting this build cannot read: not restored either
                continue
        root = logging.getLogger()
        return cls(
            torch_state=GlobalState.save(),
            settings=settings,
            default_device=_default_device(),
            argv=sys.argv[:],
            path=sys.path[:],
            cwd=os.getcwd(),
            environ=dict(os.environ),
            streams=(sys.stdin, sys.stdout, sys.stderr),
            signals=_signal_handlers(),
            warning_filters=warnings.filters[:],
            showwarning=warnings.showwarning,
            excepthook=sys.excepthook,
            root_handlers=root.handlers[:],
            root_level=root.level,
            process_group=_process_group(),
        )

    def restore(self) -> None:
        """Put back everything that differs; each item on its own, so one failure never keeps
        the rest from coming back."""
        steps: list[Callable[[], None]] = [
            self.torch_state.restore, self._restore_settings, self._restore_default_device,
            self._restore_process, self._restore_logging, self._end_process_group,
        ]
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - an unusual state ampscope cannot set back: keep restoring
                continue

    def _restore_settings(self) -> None:
        for name, (get, set_) in _settings().items():
            if name not in self.settings:
                continue
            try:
                if get() != self.settings[name]:
                    set_(self.settings[name])
            except Exception:  # noqa: BLE001 - one setting that cannot be set back: the others still are
                continue

    def _restore_default_device(self) -> None:
        if _default_device() != self.default_device:
            torch.set_default_device(self.default_device)

    def _restore_process(self) -> None:
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        sys.stdin, sys.stdout, sys.stderr = self.streams
        # warnings.filters is a list, which typeshed types as a Sequence (not to be mutated).
        cast(list, warnings.filters)[:] = self.warning_filters
        warnings.showwarning = self.showwarning  # type: ignore[assignment]
        sys.excepthook = self.excepthook  # type: ignore[assignment]
        if threading.current_thread() is threading.main_thread():
            for number, handler in self.signals.items():
                if signal.getsignal(number) is not handler:
                    try:
                        signal.signal(number, handler)  # type: ignore[arg-type]
                    except (OSError, TypeError, ValueError):
                        continue

    def _end_process_group(self) -> None:
        """A default process group the script made (`init_process_group`) and left: destroyed,
        as the script's process would have ended it, so that the next run can make its own."""
        if _process_group() and not self.process_group:
            import torch.distributed as dist

            dist.destroy_process_group()

    def _restore_logging(self) -> None:
        """The root logger's handlers and level as they were (`logging.basicConfig` in the
        script adds one). A handler the script added has been flushed and closed by then."""
        root = logging.getLogger()
        root.handlers[:] = self.root_handlers
        root.setLevel(self.root_level)


def _process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _signal_handlers() -> dict[int, object]:
    """The Python-level handler of every signal that has one (only the main thread may set
    them, so only there are they saved and restored)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers: dict[int, object] = {}
    for number in signal.valid_signals():
        try:
            handler = signal.getsignal(number)
        except (OSError, ValueError):
            continue
        if handler is not None:
            handlers[number] = handler
    return handlers
