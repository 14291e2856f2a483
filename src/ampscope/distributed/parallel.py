"""What a distributed run is: the strategy, the number of ranks and the mixed-precision policy.

`--mp-policy param=bf16,reduce=fp32` names the fields of FSDP2's
`MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype)`. Under DDP only `reduce` has a
meaning: the dtype its gradient buckets are all-reduced in, as DDP's `fp16_compress_hook` and
`bf16_compress_hook` do (parameters stay in the setting's dtype: DDP never casts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampscope.errors import AmpscopeError
from ampscope.records import dtype_name

STRATEGIES = ("ddp", "fsdp")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_FIELDS = {"param": "param_dtype", "reduce": "reduce_dtype", "output": "output_dtype"}


@dataclass(frozen=True)
class Parallel:
    """One distributed configuration. A dtype left None is FSDP2's default: no cast (the
    parameters' own dtype)."""

    strategy: str  # "ddp" or "fsdp"
    world_size: int
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise AmpscopeError(f"unknown strategy {self.strategy!r}; choose ddp or fsdp")
        if self.world_size < 1:
            raise AmpscopeError("the number of ranks must be positive")
        if self.strategy == "ddp" and (self.param_dtype or self.output_dtype):
            raise AmpscopeError("DDP keeps parameters in the setting's dtype (choose it with "
                                "--setting); of --mp-policy only reduce= applies to DDP")

    def policy_dict(self) -> dict:
        return {field: dtype_name(d) if (d := getattr(self, field)) is not None else None
                for field in _FIELDS.values()}

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "world_size": self.world_size,
                "mp_policy": self.policy_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> Parallel:
        policy = {k: getattr(torch, v) for k, v in data["mp_policy"].items() if v}
        return cls(data["strategy"], data["world_size"], **policy)

    def fsdp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                                    output_dtype=self.output_dtype)


def parse_mp_policy(text: str | None) -> dict[str, torch.dtype]:
    """"param=bf16,reduce=fp32" -> {"param_dtype": torch.bfloat16, "reduce_dtype": ...}."""
    policy: dict[str, torch.dtype] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in _FIELDS or value not in _DTYPES:
            raise AmpscopeError(
                f"bad --mp-policy entry {part.strip()!r}; write e.g. param=bf16,reduce=fp32 "
                f"(fields: {', '.join(_FIELDS)}; dtypes: fp32, bf16, fp16)")
        policy[_FIELDS[key]] = _DTYPES[value]
    return policy
