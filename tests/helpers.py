"""What several test files share: hand-built records and the golden-file check.

Fixtures that build models live in conftest.py; this module holds plain helpers, imported as
`from tests.helpers import ...`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ampscope.records import ModuleCall, SettingRecord, TensorMeta

GOLDEN = Path(__file__).parent / "golden"

F32, BF16, I64 = TensorMeta("float32", (2, 4)), TensorMeta("bfloat16", (2, 4)), TensorMeta("int64", (2,))


def call(i, name, type_, depth, ins, outs, phase="forward"):
    return ModuleCall(i, name, type_, phase, depth, ins, outs)


def blocks(n, odd=None, order=None):
    """Calls of a model with n blocks h.i (each: Block > fc); block `odd` runs fc in fp32."""
    calls = [call(0, "", "Net", 0, (I64,), (F32,))]
    for i in order or range(n):
        out = F32 if i == odd else BF16
        calls.append(call(len(calls), f"h.{i}", "Block", 1, (F32,), (out,)))
        calls.append(call(len(calls), f"h.{i}.fc", "Linear", 2, (F32,), (out,)))
    calls.append(call(len(calls), "head", "Linear", 1, (F32,), (BF16,)))
    return calls



def setting_record(name: str = "fp32", *, device: str = "cpu", emulated: bool = False,
                   param_dtype: str | None = "float32", autocast_dtype: str | None = None,
                   matmul_precision: str = "highest") -> SettingRecord:
    """A setting as a trace records it, for hand-built traces."""
    return SettingRecord(name, device, emulated, param_dtype, autocast_dtype, matmul_precision)


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("AMPSCOPE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
