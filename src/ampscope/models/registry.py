"""Model specs: one string names any model ampscope can build (each form in docs/models.md).

The names are the entries of catalog.py, each built by the `load` of the module it names.
`resolve` builds the model reproducibly (seeded, in a forked RNG, so the caller's RNG state and
default dtype are as they were) and `list_models` describes the named ones, counting parameters
on the meta device so that listing allocates nothing (`ampscope models` reads the same facts
from the table in catalog.py, without building anything).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from ampscope.errors import AmpscopeError, named_line
from ampscope.models import catalog, hf
from ampscope.models.base import LoadedModel
from ampscope.models.catalog import ModelInfo, entry, installed, split_spec
from ampscope.runtime.user_frames import user_line


def model_names() -> list[str]:
    """Every named model of catalog.py, in listing order (read now: an entry is all it takes)."""
    return [e.name for e in catalog.MODELS]


def _load_named(name: str, device: str | torch.device,
                target_device: str | None = None) -> LoadedModel:
    loader = importlib.import_module(f"ampscope.models.{entry(name).module}").load
    return loader(name, device=device, target_device=target_device)


def _unknown_name(name: str) -> AmpscopeError:
    if Path(name).exists():
        return AmpscopeError(f"unknown model {name!r}; to load this path write 'hf:{name}'")
    close = difflib.get_close_matches(name, model_names(), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return AmpscopeError(
        f"unknown model {name!r}; {hint}`ampscope models` lists them, "
        "or give hf:PATH or package.module:factory"
    )


# --- user factories -----------------------------------------------------------------------


@contextlib.contextmanager
def _cwd_on_sys_path() -> Iterator[None]:
    """Let `mymodels:build` import from the working directory, as `python -m` would."""
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.path[:] = saved


def _find_factory(spec: str) -> Callable[[], object]:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise AmpscopeError(f"bad model spec {spec!r}; write package.module:factory")
    with _cwd_on_sys_path():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name or module_name.startswith(f"{e.name}."):  # it is missing
                raise AmpscopeError(
                    f"cannot import module {module_name!r} for {spec!r}; run from the folder "
                    "that contains it or install its package"
                ) from e
            raise AmpscopeError(f"importing {module_name!r} failed: {named_line(e)}") from e
        except SystemExit as e:
            raise AmpscopeError(f"importing {module_name!r} called sys.exit({e.code!r})") from e
        except Exception as e:
            raise AmpscopeError(f"importing {module_name!r} failed: {named_line(e)}") from e
    factory: object = module
    for part in attr_path.split("."):
        if not hasattr(factory, part):
            candidates = [n for n in dir(factory) if not n.startswith("_")]
            close = difflib.get_close_matches(part, candidates, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise AmpscopeError(f"{module_name!r} has no factory {attr_path!r}{hint}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise AmpscopeError(f"{spec!r} is a {type(factory).__name__}, not a callable factory")
    return factory


def wrap_module(module: nn.Module, spec: str) -> LoadedModel:
    """A factory's nn.Module as a LoadedModel: HF adapter, or the nanoGPT convention."""
    transformers = sys.modules.get("transformers")  # a PreTrainedModel means it is imported
    if transformers is not None and isinstance(module, transformers.PreTrainedModel):
        return hf.hf_loaded_model(module, name=spec, built_here=False)
    config = getattr(module, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    max_seq_len = getattr(config, "block_size", None) or getattr(config, "sequence_len", None)
    if not isinstance(vocab_size, int) or not isinstance(max_seq_len, int):
        raise AmpscopeError(
            f"{spec!r} returned a {type(module).__name__} without config.vocab_size and "
            "config.block_size (or sequence_len); return an ampscope LoadedModel instead"
        )
    return LoadedModel(name=spec, module=module, vocab_size=vocab_size, max_seq_len=max_seq_len)


def _load_factory(spec: str, device: torch.device) -> LoadedModel:
    factory = _find_factory(spec)
    try:
        with torch.device(device):  # factories that build on the default device build there
            built = factory()
    except SystemExit as e:
        raise AmpscopeError(f"{spec} called sys.exit({e.code!r}) instead of returning a "
                            "model") from e
    except Exception as e:
        where = user_line(e)  # the factory's own line, or its model's
        at = f" at {where}" if where else ""
        raise AmpscopeError(f"{spec} raised {type(e).__name__}{at}"
                            f"{named_line(e).removeprefix(type(e).__name__)}") from e
    if isinstance(built, nn.Module):
        built = wrap_module(built, spec)
    if not isinstance(built, LoadedModel):
        raise AmpscopeError(
            f"{spec} returned a {type(built).__name__}; return an nn.Module or an ampscope "
            "LoadedModel"
        )
    _move_keeping_ties(built.module, device)
    return built


def _move_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)`, re-tying shared parameters that the move split.

    Moving to or from meta replaces each Parameter per owning module, so a tied lm_head would
    become a second tensor (and be counted twice).
    """

    def already_there(t: torch.Tensor) -> bool:  # "cuda" means whichever cuda:N it is on
        return t.device.type == device.type and device.index in (None, t.device.index)

    if all(already_there(t) for t in [*module.parameters(), *module.buffers()]):
        return
    shared: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    module.to(device)
    for first, *others in (names for names in shared.values() if len(names) > 1):
        param = module.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, param)


# --- resolve --------------------------------------------------------------------------------


@contextlib.contextmanager
def _isolated_construction(seed: int, device: torch.device) -> Iterator[None]:
    """Seeded construction that leaves the caller's RNG states and default dtype untouched."""
    accelerator = device.type if device.type in ("cuda", "mps", "xpu") else None
    fork = (
        torch.random.fork_rng(devices=[device.index or 0], device_type=accelerator)
        if accelerator
        else torch.random.fork_rng(devices=[])
    )
    default_dtype = torch.get_default_dtype()
    try:
        with fork:
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_default_dtype(default_dtype)


def resolve(spec: str, *, device: str | torch.device = "cpu", seed: int = 0,
            target_device: str | None = None, build_device: str | None = None) -> LoadedModel:
    """Build the model a spec names, with weights seeded by `seed`, on `device`.

    `target_device` is the device an emulated run stands for: the reference models make their
    device-dependent choices (nanochat's bf16 embedding on CUDA) for it. `build_device` is the
    device a factory (`package.module:factory`) builds on and its model is moved to, when it
    differs from `device`: the emulated device, while a virtual device
    (runtime/virtual_device.py) makes it stand on `device`, so the factory's own device
    branches are taken as on the target.

    Raises AmpscopeError (one line, with what to do) for unknown names, unreadable paths,
    failing factories, and named models that clearly cannot fit in this machine's memory.
    """
    spec = spec.strip()
    device = torch.device(device)
    with _isolated_construction(seed, device):
        if spec.startswith("hf:"):
            return hf.load_local(spec.removeprefix("hf:"), device=device)
        if ":" in spec:
            return _load_factory(spec, torch.device(build_device) if build_device else device)
        base, changed = split_spec(spec)
        if base not in model_names():
            raise _unknown_name(base)
        if device.type != "meta":
            # Changed fields change the size: the count of the model built on meta.
            parameters = _load_named(spec, "meta").num_parameters if changed else \
                entry(base).parameters
            check_fits_in_memory(spec, parameters, device=device)
        return _load_named(spec, device, target_device)


# --- listing ---------------------------------------------------------------------------------


@functools.cache
def _model_info(name: str) -> ModelInfo:
    with _isolated_construction(0, torch.device("meta")):
        loaded = _load_named(name, "meta")
    return ModelInfo(name, loaded.family, loaded.num_parameters, entry(name).description)


def list_models() -> list[ModelInfo]:
    """Every model this installation can build, with its parameter count computed by building
    it on the meta device: the ground truth of catalog.py's counts (tested equal)."""
    return [_model_info(name) for name in model_names() if installed(name)]


# --- memory guard ----------------------------------------------------------------------------


_LIMIT_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def memory_limit(text: str) -> int | None:
    """`AMPSCOPE_MEMORY_LIMIT`'s value as bytes: a number of bytes, or one with a K, M or G
    suffix (binary); None when it is empty or blank, as when it is unset. Anything that is not
    one finite size of at least a byte is refused in one line quoting the value as given."""
    number = text.strip()
    if not number:
        return None
    scale = _LIMIT_UNITS.get(number[-1].upper(), 1)
    if scale > 1:
        number = number[:-1]  # one suffix only: "5GG" is not a size
    given = f"AMPSCOPE_MEMORY_LIMIT={text!r}"
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if math.isnan(value):  # garbage, a bare suffix, or "nan" itself
        raise AmpscopeError(f"{given} is not a size in bytes; write e.g. 16G, 512M or 8e9")
    if value <= 0:  # "-5G", "0", "-inf"
        raise AmpscopeError(f"{given} must be a positive size in bytes, e.g. 16G")
    if math.isinf(value):  # "inf", or a figure past any float ("1e400")
        what = "must be a finite size" if "inf" in number.lower() else "is too large to be a size"
        raise AmpscopeError(f"{given} {what} in bytes; write e.g. 16G, or unset it to use the "
                            "memory this machine has")
    if value < 1:  # it would round to a limit of 0 bytes
        raise AmpscopeError(f"{given} is less than one byte; write e.g. 16G or 512M")
    return int(value)


def available_memory_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """Memory available to a new process: MemAvailable on Linux, else physical memory, else None.
    `AMPSCOPE_MEMORY_LIMIT` (bytes, or with a K/M/G suffix) overrides it: a cap below what the
    machine has, for a shared machine or a test."""
    limit = memory_limit(os.environ.get("AMPSCOPE_MEMORY_LIMIT", ""))
    if limit is not None:
        return limit
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:  # macOS and other Unixes: total physical memory, an upper bound
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _device_memory_bytes(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)[0], f"{device}'s"
    if device.type == "cpu":
        return available_memory_bytes(), "this machine's"
    return None, ""


def _format_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _format_bytes(n: float) -> str:
    gb = n / 1e9
    return f"{gb:.0f} GB" if gb >= 10 else f"{gb:.1f} GB"


def memory_shortfall(
    name: str,
    parameters: int,
    *,
    bytes_per_parameter: float,
    available_bytes: int | None,
    what: str = "in float32",
    where: str = "this machine's",
) -> str | None:
    """The one-line refusal when `parameters` clearly cannot fit, else None (pure)."""
    needed = parameters * bytes_per_parameter
    if available_bytes is None or needed <= available_bytes:
        return None
    return (
        f"{name} has {_format_count(parameters)} parameters ({_format_bytes(needed)} {what}), "
        f"more than {where} {_format_bytes(available_bytes)} free; pick a smaller model "
        "or a lighter workload"
    )


def memory_needed_message(
    name: str,
    parameters: int,
    *,
    bytes_per_parameter: float = 4,
    what: str = "in float32",
    device: str | torch.device = "cpu",
) -> str | None:
    """The one-line refusal if the weights alone (times what a run needs per parameter) exceed
    the memory free on `device`, else None. An fp32 build needs 4 bytes per parameter; an fp32
    Adam train step at least 16 (weights, gradients, two moments)."""
    available, where = _device_memory_bytes(torch.device(device))
    return memory_shortfall(
        name,
        parameters,
        bytes_per_parameter=bytes_per_parameter,
        available_bytes=available,
        what=what,
        where=where,
    )


def check_fits_in_memory(name: str, parameters: int, **kwargs) -> None:
    """Raise AmpscopeError with `memory_needed_message` when there is one."""
    message = memory_needed_message(name, parameters, **kwargs)
    if message:
        raise AmpscopeError(message)
