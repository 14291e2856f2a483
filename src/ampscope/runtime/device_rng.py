"""The virtual device's random number generators: `torch.Generator(device="cuda")`,
`torch.cuda.manual_seed`, `torch.cuda.get_rng_state` and the rest, answered on the CPU.

The target's tensors live on the CPU, so every random op on them (dropout, `torch.randn(...,
device="cuda")`, `torch.multinomial`) draws from a CPU generator: the CPU's default generator
stands for the target's default one, and `torch.Generator(device="cuda")` is a CPU generator
that says it is on the target (`VirtualGenerator`). Seeding, reading and setting states work
as on the device, with the CPU generator's numbers (a GPU's Philox numbers cannot be had here;
a run's dtypes do not depend on them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ampscope.runtime.device_mode import DeviceMode

# The state a CUDA generator saves: its seed (8 bytes) and Philox offset (8 bytes), as
# CUDAGeneratorImpl::get_state writes it; a CPU generator's is its whole Mersenne Twister.
_PHILOX_STATE_BYTES = 16


def generator_type(mode: DeviceMode) -> type:
    """What `torch.Generator` is while the virtual device is in force: `Generator(device=target)`
    makes a CPU generator that reports the target as its device; any other device makes torch's
    own generator. `isinstance(g, torch.Generator)` stays true of every generator (torch's
    default ones included), so type checks in user code and libraries see no change."""
    target = mode.target
    real: Any = torch.Generator  # Any: subclassed, and its metaclass extended, below

    class _Meta(type(real)):  # type: ignore[misc]
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, real)

    class Generator(real, metaclass=_Meta):
        """A generator on the target device, as user code sees it; on the CPU, where the
        target's tensors live and its random ops run."""

        def __new__(cls, device: Any = None) -> Any:
            if not mode.is_target(device):
                return real() if device is None else real(device)
            return real.__new__(cls, device="cpu")

        @property
        def device(self) -> torch.device:
            return torch.device(target, 0)

    Generator.__module__ = "torch"
    Generator.__qualname__ = "Generator"
    return Generator


def _set_state(state: torch.Tensor) -> None:
    """The target's `set_rng_state`: the state of the default generator that stands for it. A
    Philox state (a real GPU's, or DTensor's per-shard one: its seed and offset) seeds it with
    the two mixed: the CPU generator cannot take a Philox offset, and each offset still draws
    its own stream."""
    state = torch.as_tensor(state)
    if state.numel() == _PHILOX_STATE_BYTES and state.dtype == torch.uint8:
        raw = bytes(state.tolist())
        seed, offset = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")
        torch.default_generator.manual_seed((seed + offset * 0x9E3779B97F4A7C15) % 2 ** 64)
        return
    torch.default_generator.set_state(state)


def _set_states(states: Iterable[torch.Tensor]) -> None:
    for state in states:  # one device: one state
        _set_state(state)


def rng_patches(mode: DeviceMode) -> list[tuple[object, str, object]]:
    """(owner, name, value) for the RNG API of the mode's target: `torch.Generator` and the
    seeding and state functions of `torch.<target>` this release has (each reaching, on a build
    without the device, a generator that does not exist)."""
    target = mode.target
    backend = getattr(torch, target)
    default = torch.default_generator

    def manual_seed(seed: int) -> None:
        default.manual_seed(int(seed))

    def seed() -> None:  # a random seed; torch.cuda.seed() returns nothing
        default.seed()

    answers: dict[str, object] = {
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
        "seed": seed,
        "seed_all": seed,
        "initial_seed": lambda: default.initial_seed(),
        "get_rng_state": lambda device=target: default.get_state(),
        "get_rng_state_all": lambda: [default.get_state()],
        "set_rng_state": lambda new_state, device=target: _set_state(new_state),
        "set_rng_state_all": _set_states,
        "default_generators": (default,),
    }
    patches: list[tuple[object, str, object]] = [(torch, "Generator", generator_type(mode))]
    patches += [(backend, name, value) for name, value in answers.items()
                if hasattr(backend, name)]
    return patches


def philox_state() -> torch.Tensor:
    """A Philox state (seed, offset 0; 16 bytes) for the virtual device's generator, for code
    that reads the device's state as Philox's (DTensor's random ops on shards)."""
    seed = torch.default_generator.initial_seed() % 2 ** 64
    raw = seed.to_bytes(8, "little") + (0).to_bytes(8, "little")
    return torch.tensor(list(raw), dtype=torch.uint8)
