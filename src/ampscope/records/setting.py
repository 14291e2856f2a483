"""`SettingRecord`: the setting a trace ran under, as plain data.

`precision.Setting` is the live form (torch dtypes, an autocast context); a trace keeps this
record of it instead, so every layer above capture reads typed fields and the JSON stays the
same `setting` object it always was.

Namesakes, the same concern at another layer: `precision/setting.py`."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SettingRecord:
    name: str  # canonical spelling, e.g. "cuda:fp32+amp-bf16"; "as-run" for capture()
    device: str  # the device the run stands for: "cpu", "cuda", "mps", "xpu"
    emulated: bool  # True: the device was absent and its autocast emulated on the CPU
    param_dtype: str | None  # dtype holding most parameter elements; None: no float parameter
    autocast_dtype: str | None  # None: autocast off
    matmul_precision: str  # "highest" or "high" (TF32)
    # The PyTorch build whose autocast policy the run followed (emulated or not): the policy
    # changes between releases (precision/policy_history.json). None in traces written before.
    torch: str | None = None
    fp8: str | None = None  # torchao float8 recipe ("tensorwise", "rowwise", ...); None: no fp8
    # An as-run model sharded by FSDP2 with a MixedPrecisionPolicy: the dtypes its unsharded
    # parameters compute in and its gradients are reduced in (None: no such policy).
    fsdp_param_dtype: str | None = None
    fsdp_reduce_dtype: str | None = None
    # The GPU an emulated device stood for (`--gpu`, or the device type's default), by its
    # name in ampscope's hardware table; None: a real device, or a device type without one.
    gpu: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SettingRecord:
        return cls(
            name=data.get("name", "?"),
            device=data.get("device", "cpu"),
            emulated=bool(data.get("emulated", False)),
            param_dtype=data.get("param_dtype"),
            autocast_dtype=data.get("autocast_dtype"),
            matmul_precision=data.get("matmul_precision", "highest"),
            torch=data.get("torch"),
            fp8=data.get("fp8"),
            fsdp_param_dtype=data.get("fsdp_param_dtype"),
            fsdp_reduce_dtype=data.get("fsdp_reduce_dtype"),
            gpu=data.get("gpu"),
        )


UNKNOWN_SETTING = SettingRecord("?", "cpu", False, None, None, "highest")
