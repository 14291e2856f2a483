"""The accelerator table: device-name lookup, the sourced figures, TF32 selection and MFU."""

from __future__ import annotations

import os
import re
import threading

import pytest

from ampscope import hardware
from ampscope.errors import AmpscopeError
from ampscope.hardware import GiB, by_name, describe, lookup, mfu, peak_flops

pytestmark = pytest.mark.fast

# Strings `torch.cuda.get_device_name()` returns, and the entry each must find.
DEVICE_NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"),
    ("NVIDIA A10", "a10"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("Tesla V100-SXM2-16GB", "v100-16gb"),
    ("Tesla V100-SXM2-32GB", "v100"),
    ("Tesla V100-PCIE-16GB", "v100-pcie-16gb"),
    ("Tesla V100-PCIE-32GB", "v100-pcie"),
    ("Tesla T4", "t4"),
    ("AMD Instinct MI300X", "mi300x"),
]

# Parts whose figures differ from every entry (or are not sourced): they must not borrow one.
UNKNOWN_NAMES = [
    "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA GB200", "NVIDIA A10G", "NVIDIA L40",
    "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4090 D", "Tesla V100S-PCIE-32GB",
    "NVIDIA GeForce RTX 5090", "Apple M2 Max", "cpu", "",
]


@pytest.mark.parametrize(("device_name", "expected"), DEVICE_NAMES)
def test_lookup_finds_the_entry_a_device_name_belongs_to(device_name, expected):
    assert lookup(device_name).name == expected


def test_lookup_ignores_case_and_surrounding_space():
    assert lookup("  nvidia h100 pcie ") is hardware.H100_PCIE


def test_h100_pcie_does_not_get_the_sxm_figures():
    assert lookup("NVIDIA H100 PCIe") is not hardware.H100
    assert peak_flops(lookup("NVIDIA H100 PCIe"), "bfloat16") == 756e12


@pytest.mark.parametrize("device_name", UNKNOWN_NAMES)
def test_unknown_device_is_none(device_name):
    assert lookup(device_name) is None


def test_the_issue_figures_exactly():
    h100 = by_name("h100")
    assert dict(h100.peak_flops) == {
        "bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "tf32": 495e12,
        "float32": 67e12, "float64": 67e12}
    a100 = by_name("a100")
    for name in ("a100", "a100-40gb", "a100-pcie"):
        acc = by_name(name)
        assert (acc.peak_flops["bfloat16"], acc.peak_flops["float16"], acc.peak_flops["tf32"],
                acc.peak_flops["float32"]) == (312e12, 312e12, 156e12, 19.5e12)
    assert (a100.memory_bytes, by_name("a100-40gb").memory_bytes) == (80 * GiB, 40 * GiB)


def test_h200_is_h100_compute_with_its_own_memory():
    h100, h200 = by_name("h100"), by_name("h200")
    assert h200.peak_flops == h100.peak_flops
    assert h200.memory_bytes == 141 * GiB and h100.memory_bytes == 80 * GiB
    assert h200.bandwidth_bytes_per_s == 4.8e12 and h100.bandwidth_bytes_per_s == 3.35e12


def test_float32_matmuls_get_tf32_only_when_allowed_and_available():
    h100 = by_name("h100")
    assert peak_flops(h100, "float32") == 67e12
    assert peak_flops(h100, "float32", "high") == 495e12
    assert peak_flops(h100, "float32", "medium") == 495e12
    assert peak_flops(h100, "torch.float32", "high") == 495e12
    # Volta has no TF32: "high" changes nothing.
    assert peak_flops(by_name("v100"), "float32", "high") == 15.7e12
    # ROCm needs HIPBLASLT_ALLOW_TF32 for TF32; by default float32 runs at the float32 rate.
    assert peak_flops(by_name("mi300x"), "float32", "high") == 163.4e12
    # The 3090 runs TF32, but its TF32 rate is not in the table: unknown, not the fp32 rate.
    assert peak_flops(by_name("rtx3090"), "float32", "high") is None
    assert peak_flops(by_name("rtx3090"), "float32") == 35.6e12


def test_bfloat16_on_volta_and_turing_is_unknown():
    assert peak_flops(by_name("v100"), "bfloat16") is None
    assert peak_flops(by_name("t4"), "bfloat16") is None
    assert peak_flops(by_name("v100"), "float16") == 125e12


def test_float8_variants_share_one_peak_and_other_dtypes_have_none():
    h100 = by_name("h100")
    assert peak_flops(h100, "float8_e4m3fn") == peak_flops(h100, "float8_e5m2") == 1979e12
    assert peak_flops(h100, "int8") is None
    assert peak_flops(by_name("a100"), "float8_e4m3fn") is None


def test_unknown_matmul_precision_is_an_error():
    with pytest.raises(AmpscopeError, match="highest, high, medium"):
        peak_flops(by_name("h100"), "float32", "tf32")


def test_mfu_of_a_single_dtype_step():
    # 989e12 bf16 FLOPs take 1 s at the H100's bf16 peak; done in 2 s, that is 50%.
    assert mfu({"bfloat16": 989e12}, 2.0, by_name("h100")) == pytest.approx(0.5)


def test_mfu_holds_each_dtype_to_its_own_peak():
    h100 = by_name("h100")
    # 1 s of ideal bf16 work and 1 s of ideal fp32 work in a 4 s step: 50%.
    assert mfu({"bfloat16": 989e12, "float32": 67e12}, 4.0, h100) == pytest.approx(0.5)
    # Against the bf16 peak alone the same step would read ~27%.
    naive = (989e12 + 67e12) / 4.0 / 989e12
    assert naive == pytest.approx(0.267, abs=1e-3)
    # With TF32 allowed, the float32 matmuls are held to the TF32 peak instead.
    assert mfu({"bfloat16": 989e12, "float32": 495e12}, 4.0, h100, "high") == pytest.approx(0.5)


def test_mfu_is_none_when_a_needed_peak_or_the_device_is_unknown():
    v100 = by_name("v100")
    assert mfu({"bfloat16": 1e12, "float32": 1e12}, 1.0, v100) is None
    assert mfu({"bfloat16": 0, "float16": 125e12}, 1.0, v100) == pytest.approx(1.0)
    assert mfu({"bfloat16": 1e12}, 1.0, lookup("NVIDIA GeForce RTX 5090")) is None
    assert mfu({}, 1.0, v100) == 0.0


def test_mfu_rejects_a_step_without_duration():
    with pytest.raises(AmpscopeError, match="positive"):
        mfu({"bfloat16": 1e12}, 0.0, by_name("h100"))


def test_by_name_errors_list_the_known_names():
    assert by_name(" H100 ") is hardware.H100
    with pytest.raises(AmpscopeError) as info:
        by_name("h1000")
    message = str(info.value)
    assert "'h1000'" in message
    for acc in hardware.KNOWN:
        assert acc.name in message


def test_every_figure_has_a_source_with_a_url():
    for acc in hardware.KNOWN:
        figures = set(acc.peak_flops) | {"memory", "bandwidth"}
        if acc.multiprocessors is not None:
            figures.add("multiprocessors")
        if acc.capability is not None:
            figures.add("capability")
        assert set(acc.sources) == figures, acc.name
        for source in acc.sources.values():
            assert re.search(r", https://\S+$", source), (acc.name, source)


def test_table_is_consistent():
    names = [a.name for a in hardware.KNOWN]
    assert len(names) == len(set(names))
    for acc in hardware.KNOWN:
        assert set(acc.peak_flops) <= set(hardware.DTYPES), acc.name
        assert all(v > 0 for v in acc.peak_flops.values()), acc.name
        assert acc.memory_bytes > 0 and acc.bandwidth_bytes_per_s > 0, acc.name
        assert all(re.compile(p) for p in acc.patterns), acc.name


def test_table_is_read_only():
    with pytest.raises(TypeError):
        hardware.H100.peak_flops["bfloat16"] = 1.0
    assert hash(hardware.H100) != hash(hardware.H200)


def test_describe_is_one_line_with_figures_and_sources():
    line = describe(by_name("h100"))
    assert "\n" not in line
    assert line.startswith("h100: NVIDIA H100 SXM5 80GB: bfloat16 989, float16 989, float8 1979")
    assert "80 GiB at 3.35 TB/s" in line
    assert "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet" in line
    assert "bfloat16" not in describe(by_name("v100"))


# --- the user's table: what is at its path -------------------------------------------------


def _refusal(capsys) -> str:
    """`ampscope flops --gpu h100` with the table as set: its exit code must be 2, its stderr one
    line; that line, less the prefix."""
    from ampscope.cli import main

    code = main(["flops", "gpt2-tiny", "--gpu", "h100"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("ampscope: error: "), err
    return err.removeprefix("ampscope: error: ").rstrip("\n")


def test_a_folder_named_as_the_table_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(tmp_path))
    message = f"AMPSCOPE_HARDWARE={str(tmp_path)!r}: a folder, not a TOML file"
    with pytest.raises(AmpscopeError) as e:
        hardware.table()
    assert str(e.value) == message
    assert _refusal(capsys) == message


def test_a_folder_at_the_default_place_is_refused_too(tmp_path, monkeypatch):
    monkeypatch.delenv("AMPSCOPE_HARDWARE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "ampscope" / "hardware.toml").mkdir(parents=True)
    with pytest.raises(AmpscopeError) as e:
        hardware.table()
    assert str(e.value) == f"{tmp_path / 'ampscope' / 'hardware.toml'}: a folder, not a TOML file"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_as_the_table_is_refused_without_waiting_for_a_writer(tmp_path, monkeypatch,
                                                                           capsys):
    fifo = tmp_path / "hardware.toml"
    os.mkfifo(fifo)
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(fifo))
    outcome: list[BaseException | object] = []

    def look_up() -> None:
        try:
            outcome.append(hardware.table())
        except BaseException as e:  # noqa: BLE001 - whatever it is, handed to the test's thread
            outcome.append(e)

    reader = threading.Thread(target=look_up, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # it blocked in open(): a writer lets it go before the test fails
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading the table blocked on the FIFO")
    assert isinstance(outcome[0], AmpscopeError)
    message = f"AMPSCOPE_HARDWARE={str(fifo)!r}: a FIFO, not a regular file"
    assert str(outcome[0]) == message
    assert _refusal(capsys) == message


@pytest.mark.skipif(os.devnull != "/dev/null", reason="no /dev/null here")
def test_a_device_named_as_the_table_is_refused(monkeypatch):
    monkeypatch.setenv("AMPSCOPE_HARDWARE", os.devnull)
    with pytest.raises(AmpscopeError, match=r"^AMPSCOPE_HARDWARE='/dev/null': a character "
                                            r"device, not a regular file$"):
        hardware.table()


def test_an_entry_that_is_not_a_table_shows_the_toml_it_wants(tmp_path, monkeypatch, capsys):
    path = tmp_path / "hardware.toml"
    path.write_text("a6000 = 5\n")
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(path))
    message = (f"{path}: [a6000] must be a table of figures, e.g. [a6000] with "
               'memory = "48GiB" and peak_flops = { bf16 = 155e12 }')
    with pytest.raises(AmpscopeError) as e:
        hardware.table()
    assert str(e.value) == message  # single braces, as TOML writes an inline table
    assert _refusal(capsys) == message
