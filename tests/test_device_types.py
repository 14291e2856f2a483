"""The device table (hardware/device_types.py) and the per-device autocast state of the
virtual device, against the build's own answers.

Ground truth: a fresh thread's `torch.get_autocast_dtype(device)` is the build's default for
that device type, and the build's own autocast kernels, run on fake CUDA tensors (PyTorch's
fake device guard, as in tests/test_fake_cuda_truth.py), show which autocast region casts a
CUDA tensor. The virtual CUDA device must give the same answers on CPU tensors.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ampscope.hardware import by_name
from ampscope.hardware.device_types import DEVICE_TYPES, device_type
from ampscope.precision import DEVICES, GlobalState
from ampscope.runtime.emulation import Emulation
from ampscope.runtime.virtual_device import VirtualDevice
from tests.test_fake_cuda_truth import fake_device_guard  # noqa: F401 - a fixture used below


def _build_default(device: str) -> torch.dtype:
    """The build's default autocast dtype for `device`, from a thread that changed nothing."""
    out: list[torch.dtype] = []
    thread = threading.Thread(target=lambda: out.append(torch.get_autocast_dtype(device)))
    thread.start()
    thread.join()
    return out[0]


def _on_virtual(target: str = "cuda"):
    """The virtual device with its emulation, as an emulated run has them."""
    return Emulation(target, _build_default(target)), VirtualDevice(target).active()


def _regions(linear: nn.Module) -> dict[str, torch.dtype]:
    """Output dtypes of a Linear on CUDA under the regions user code writes."""
    x = torch.randn(2, 4, device="cuda")
    out = {"default dtype outside": torch.get_autocast_dtype("cuda")}
    with torch.autocast("cuda"):
        out["autocast(cuda)"] = linear(x).dtype
        with torch.autocast("cpu", enabled=False):  # says nothing about CUDA tensors
            out["autocast(cuda) > autocast(cpu, enabled=False)"] = linear(x).dtype
    with torch.autocast("cpu"):
        out["autocast(cpu)"] = linear(x).dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["autocast(cpu, bf16) > enabled(cpu)"] = torch.tensor(float(
            torch.is_autocast_enabled("cpu"))).item()  # as the user's code reads it
        out["autocast(cpu, bf16) > enabled(cuda)"] = torch.tensor(float(
            torch.is_autocast_enabled("cuda"))).item()
    return out


def _ground_truth(monkeypatch) -> dict[str, torch.dtype]:
    """The same regions on fake CUDA tensors, through the build's own `torch.autocast` and
    Autocast kernels (told CUDA is there, which its constructor checks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    linear = nn.Linear(4, 4, device="meta")  # moved inside the mode, as fake CUDA tensors
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": the guard is fake
        saved = GlobalState.save()
        try:
            return _regions(linear.to_empty(device="cuda"))
        finally:
            saved.restore()
            monkeypatch.undo()


pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the fake device guard would replace the real one")


@pytest.mark.fast
def test_every_device_of_the_grammar_has_one_entry():
    assert tuple(DEVICE_TYPES) == DEVICES
    assert device_type("cuda:1") is DEVICE_TYPES["cuda"]
    for entry in DEVICE_TYPES.values():
        if entry.accelerator is not None:
            assert by_name(entry.accelerator).name == entry.accelerator
        if entry.autocast_dtype is not None:
            assert isinstance(getattr(torch, entry.autocast_dtype), torch.dtype)


def test_virtual_cuda_autocast_answers_as_the_build_on_cuda_tensors(
        fake_device_guard, monkeypatch):  # noqa: F811
    truth = _ground_truth(monkeypatch)
    assert truth["autocast(cuda)"] == torch.float16
    assert truth["default dtype outside"] == torch.float16  # what a GPU says, for the record
    assert truth["autocast(cpu)"] == torch.float32
    emulation, virtual = _on_virtual()
    saved = GlobalState.save()
    try:
        with emulation, virtual:
            emulated = _regions(nn.Linear(4, 4).to("cuda"))
    finally:
        saved.restore()
    assert emulated == truth


@pytest.mark.fast
def test_the_virtual_device_leaves_the_cpus_autocast_state_as_it_was():
    saved = GlobalState.save()
    try:
        torch.set_autocast_dtype("cpu", torch.float16)
        emulation, virtual = _on_virtual()
        with emulation, virtual:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert torch.get_autocast_dtype("cpu") == torch.float16
            assert torch.get_autocast_dtype("cuda") == torch.float16
        assert torch.get_autocast_dtype("cpu") == torch.float16
        assert not torch.is_autocast_enabled("cpu")
    finally:
        saved.restore()


@pytest.mark.fast
def test_a_device_is_one_entry(monkeypatch):
    """A test-only CUDA whose autocast defaults to bfloat16: one table entry changes what
    `torch.autocast("cuda")` without a dtype runs in, and what the device reports."""
    variant = dataclasses.replace(DEVICE_TYPES["cuda"], autocast_dtype="bfloat16",
                                  accelerator="a100", capability=(8, 0))
    monkeypatch.setitem(DEVICE_TYPES, "cuda", variant)
    emulation, virtual = _on_virtual()
    saved = GlobalState.save()
    try:
        with emulation, virtual as vd:
            linear, x = nn.Linear(4, 4).to("cuda"), torch.randn(2, 4, device="cuda")
            with torch.autocast("cuda"):
                assert linear(x).dtype == torch.bfloat16
            assert torch.cuda.get_device_name() == by_name("a100").title
            assert torch.cuda.get_device_capability() == (8, 0)
        assert "A100" in vd.notes()[0] and "8.0" in vd.notes()[0]
    finally:
        saved.restore()


@pytest.mark.fast
def test_a_device_without_an_accelerator_names_none():
    """An emulated MPS run no longer says it saw an H100."""
    saved = GlobalState.save()
    try:
        with VirtualDevice("mps").active() as vd:
            pass
    finally:
        saved.restore()
    (note,) = [n for n in vd.notes() if "saw mps" in n]
    assert "H100" not in note and "one mps device" in note


@pytest.mark.fast
def test_the_json_schemas_name_every_device_type():
    """The documents' device fields are enums in the shipped JSON Schemas: a new entry in the
    table must be named there too (this test lists where), or its runs' JSON would not
    validate."""
    import json
    from importlib import resources

    def enums(node, out: list) -> list:
        if isinstance(node, dict):
            for key in ("enum",):
                values = node.get(key)
                if isinstance(values, list) and {"cpu", "cuda"} <= set(values):  # a list of all
                    out.append(values)
            for value in node.values():
                enums(value, out)
        elif isinstance(node, list):
            for value in node:
                enums(value, out)
        return out

    schemas = resources.files("ampscope") / "schemas"
    found = {}
    for path in schemas.iterdir():
        if path.name.endswith(".schema.json"):
            for values in enums(json.loads(path.read_text()), []):
                found.setdefault(path.name, []).append(
                    [v for v in values if v not in ("op", None)])
    assert found  # the schemas do hold device enums
    for name, lists in found.items():
        for values in lists:
            if name == "bench.schema.json" and sorted(values) == ["cpu", "cuda", "mps"]:
                continue  # the reference trainer's own devices, run for real (cli/train.py)
            assert sorted(values) == sorted(DEVICE_TYPES), name


@pytest.mark.fast
def test_a_build_whose_regions_cannot_be_retargeted_falls_back_and_says_so(monkeypatch, capsys):
    """Where a CPU-built autocast region does not enter as the device type it is given, the
    virtual device keeps one autocast state (as before the two were told apart): the target's
    regions still run its default dtype, and `--version -v` says what is off."""
    from ampscope.cli.version import print_environment
    from ampscope.torchcompat import autocast_regions

    monkeypatch.setattr(autocast_regions, "retarget", lambda region, device, dtype: None)
    autocast_regions.retargetable.cache_clear()
    try:
        assert autocast_regions.retargetable()[0] is False
        emulation, virtual = _on_virtual()
        saved = GlobalState.save()
        try:
            with emulation, virtual:
                linear, x = nn.Linear(4, 4).to("cuda"), torch.randn(2, 4, device="cuda")
                with torch.autocast("cuda"):
                    assert linear(x).dtype == torch.float16
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    assert linear(x).dtype == torch.bfloat16  # one state: the old answer
        finally:
            saved.restore()
        print_environment()
        line = next(x for x in capsys.readouterr().out.splitlines() if "autocast regions" in x)
        assert line.lstrip().startswith("no") and "off: torch.autocast(\"cpu\") kept apart" in line
    finally:
        monkeypatch.undo()
        autocast_regions.retargetable.cache_clear()
    assert autocast_regions.retargetable()[0] is True
