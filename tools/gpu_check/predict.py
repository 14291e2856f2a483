"""What ampscope predicts for each item gpu_check measures, through ampscope's public API only.

- every item: the accelerator table's peak (`ampscope.hardware.peak_flops`, the bandwidth), and
  the measurement as a fraction of it;
- training steps: the predicted step's allocated peak (`ampscope.memory` of a predicted
  trace: live storage, and with CUDA's block rounding), and where this ampscope has them, the
  allocator replay's reserved peak and the step-time model's time.

A prediction this ampscope cannot make is left out (None), with one line saying so: never a
figure made up here. `ratio` is always measured / predicted.
"""

from __future__ import annotations

import importlib.util

import ampscope
from ampscope import hardware
from ampscope.hardware import Accelerator
from gpu_check.timing import Box, log

MATMUL_FIGURE = {"fp32": ("float32", "highest"), "tf32": ("float32", "high"),
                 "bf16": ("bfloat16", "highest"), "fp16": ("float16", "highest")}


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """measured / predicted; None when either is unknown (or the prediction is zero)."""
    if measured is None or not predicted:
        return None
    return measured / predicted


def available(module: str) -> bool:
    """Whether this ampscope has `module` (a model another part of ampscope adds)."""
    return importlib.util.find_spec(module) is not None


def accelerator(device_info: dict, gpu: str | None) -> tuple[Accelerator | None, str]:
    """The accelerator predictions are made for, and how it was chosen: `--gpu NAME`, else the
    entry of the table that the device's name matches."""
    if gpu:
        return hardware.by_name(gpu), f"--gpu {gpu}"
    found = hardware.lookup(device_info["name"]) if device_info["device_type"] == "cuda" else None
    how = (f"matched {device_info['name']!r}" if found else
           f"no entry of ampscope's table matches {device_info['name']!r}")
    return found, how


def against_peaks(results: dict, acc: Accelerator | None) -> None:
    """Add the table's peak and the fraction of it to each matmul, attention and bandwidth row."""
    for row in results["matmuls"]:
        dtype, precision = MATMUL_FIGURE[row["mode"]]
        peak = hardware.peak_flops(acc, dtype, precision) if acc else None
        row["peak_tflops"] = peak / 1e12 if peak else None
        row["of_peak"] = ratio(row.get("tflops"), row["peak_tflops"])
    for row in results["attention"]:
        peak = hardware.peak_flops(acc, "bfloat16" if row["dtype"] == "bf16" else "float32") \
            if acc else None
        row["peak_tflops"] = peak / 1e12 if peak else None
        row["of_peak"] = ratio(row.get("tflops"), row["peak_tflops"])
    bandwidth = acc.bandwidth_bytes_per_s if acc else None
    for row in results["bandwidth"]:
        row["peak_bytes_per_s"] = bandwidth
        row["of_peak"] = ratio(row.get("bytes_per_s"), bandwidth)


def _allocator_replay(trace: ampscope.Trace) -> int | None:
    from ampscope.analysis.allocator import replay_storages

    return replay_storages(trace.storages, len(trace.ops)).reserved_peak


def training_steps(rows: list[dict], device_type: str, box: Box) -> list[str]:
    """Each measured step's predictions, from one predicted trace of the same step (same model,
    setting on the same device type, batch and sequence). Returns the lines saying what could not
    be predicted."""
    missing = []
    replay = available("ampscope.analysis.allocator")
    if not replay:
        missing.append("reserved peak: this ampscope has no allocator replay "
                       "(ampscope.analysis.allocator); the predicted reserved column is left out")
    for row in rows:
        row["predicted"] = {"allocated": None, "allocated_rounded": None, "reserved": None,
                            "seconds": None}
        if row.get("seconds") is None:
            continue
        if box.over():
            row["predicted"]["skipped"] = "time box spent"
            continue
        trace = ampscope.trace(row["model"], setting=f"{device_type}:{row['setting']}",
                               workload="train", batch=row["batch"], seq=row["seq"], predict=True)
        peak = ampscope.memory(trace).peak
        predicted = row["predicted"]
        predicted["allocated"] = peak.bytes
        predicted["allocated_rounded"] = peak.rounded_bytes
        if replay:
            predicted["reserved"] = _allocator_replay(trace)
        first = row["first_step_peak"]
        row["ratio"] = {
            "allocated": ratio(first["allocated"], predicted["allocated_rounded"]
                               or predicted["allocated"]),
            "reserved": ratio(first["reserved"], predicted["reserved"]),
            "seconds": ratio(row["seconds"], predicted["seconds"]),
        }
        log(f"predicted {row['setting']}: allocated peak {peak.bytes / 2**20:,.1f} MiB")
    return missing


def predictions(results: dict, gpu: str | None, box: Box) -> None:
    """Fill in every prediction this ampscope makes; `results["not_predicted"]` lists the rest."""
    acc, how = accelerator(results["device"], gpu)
    results["accelerator"] = {"name": acc.name if acc else None, "title": acc.title if acc else None,
                              "chosen": how}
    log(f"accelerator for the predictions: {acc.title if acc else 'none'} ({how})")
    against_peaks(results, acc)
    missing = training_steps(results["steps"], results["device"]["device_type"], box)
    if not available("ampscope.analysis.step_time"):
        missing.append("time: this ampscope has no step-time model (ampscope.analysis.step_time);"
                       " the predicted time columns are left out")
    for line in missing:
        log(f"not predicted: {line}")
    results["not_predicted"] = missing
