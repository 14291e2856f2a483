"""Autocast that does not do what it looks like: a region for another device than its tensors'
(AMP801), one in which nothing was cast (AMP802), autocast turned off or switched inside a
region (AMP803), and a float16 region that never named its dtype (AMP804).

The rules read `Trace.autocast_regions` (records/autocast_regions.py): one record per entry of a
region, its counts those of the ops that ran while it was the innermost one. A line entered
many times (a region in the training loop) is judged once, over all its entries. Regions
ampscope enters itself (a setting's autocast) have no user line and are not judged.

Namesakes, the same concern at other layers: `analysis/autocast.py` (autocast's policies side
by side) and `render/autocast.py` (their view).
"""

from __future__ import annotations

from collections.abc import Iterator

from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import UNSCALE, UPDATE_SCALE, count, named, trains
from ampscope.records import Trace
from ampscope.records.autocast_regions import AutocastRegion


def _lines(trace: Trace) -> dict[tuple, list[AutocastRegion]]:
    """The user's regions that ran ops, by the line that entered them and what it asked."""
    found: dict[tuple, list[AutocastRegion]] = {}
    for r in trace.autocast_regions:
        if r.source is not None and r.ops:
            key = (r.source, r.device_type, r.dtype, r.enabled, r.enabled_asked, r.dtype_given)
            found.setdefault(key, []).append(r)
    return found


def _entries(regions: list[AutocastRegion]) -> str:
    return "" if len(regions) == 1 else f" (over its {len(regions)} entries)"


def _ops_and_casts(regions: list[AutocastRegion]) -> tuple[int, int]:
    return sum(r.ops for r in regions), sum(r.casts for r in regions)


def _around(trace: Trace, region: AutocastRegion) -> Iterator[AutocastRegion]:
    """The regions `region` was entered in, the nearest first."""
    at = region.parent
    while at is not None:
        yield trace.autocast_regions[at]
        at = trace.autocast_regions[at].parent


def _enclosing(trace: Trace, region: AutocastRegion) -> AutocastRegion | None:
    """The nearest region around `region` for the same device type, if any."""
    return next((o for o in _around(trace, region) if o.device_type == region.device_type), None)


def _on(region: AutocastRegion) -> bool:
    """Whether the region is for the device its tensors are on (or took no tensor)."""
    return not region.devices or region.device_type in region.devices


@rule("AMP801", "autocast-wrong-device", "warning",
      "an autocast region for another device than its tensors'")
def wrong_device(trace: Trace) -> Iterator[Hit]:
    for regions in _lines(trace).values():
        first = regions[0]
        devices = sorted({d for r in regions for d in r.devices})
        if not devices or first.device_type in devices:
            continue
        where = " and ".join(devices)
        ops, casts = _ops_and_casts(regions)
        if first.enabled_asked:
            message = (f"{first.label} at {first.source} is for {first.device_type}, but the "
                       f"tensors inside it are on {where}: it casts none of them.")
            consequence = (f"{first.device_type} autocast only touches {first.device_type} "
                           f"tensors: on {where} every op in the region runs in its inputs' "
                           f"dtype ({', '.join(first.input_dtypes) or 'as they are'}), with "
                           "the speed and memory of no autocast at all")
            fix = (f"name the tensors' device: torch.autocast(device_type=x.device.type, "
                   f"dtype=torch.{first.dtype}) (here \"{devices[0]}\")")
        else:
            outer = [r for r in trace.autocast_regions if r.device_type in devices and r.enabled
                     and any(r in _around(trace, e) for e in regions)]
            if not outer:
                continue  # off for a device nothing ran on, inside no autocast: nothing to undo
            message = (f"{first.label} at {first.source} turns off {first.device_type} "
                       f"autocast, but the tensors inside it are on {where}, whose autocast "
                       f"stays on (entered at {outer[0].source or 'an unknown line'}).")
            consequence = (f"the ops inside still run under {where} autocast in "
                           f"{outer[0].dtype}: what the region was meant to keep in float32 "
                           "is not")
            fix = (f"turn off the tensors' device's autocast: torch.autocast(device_type="
                   f"x.device.type, enabled=False) (here \"{devices[0]}\")")
        yield Hit(
            message,
            (f"{first.label} entered at {first.source}{_entries(regions)}: device "
             f"{first.device_type}",
             f"{count(ops, 'op')} ran inside it, on tensors on {where}",
             f"{casts or 'none'} cast by autocast"
             + ("" if first.enabled or not first.enabled_asked else
                f" (torch turned the region off: no {first.device_type} device here)")),
            consequence, fix, first.source)


@rule("AMP802", "autocast-nothing-cast", "note",
      "an autocast region in which nothing was cast")
def nothing_cast(trace: Trace) -> Iterator[Hit]:
    nesting = {r.parent for r in trace.autocast_regions if r.parent is not None}
    for regions in _lines(trace).values():
        first = regions[0]
        # Conservative: enabled, on its tensors' device, to a 16-bit dtype, no region inside
        # it, and only float32 inputs (a region whose inputs are already 16-bit needs no cast).
        if not all(r.enabled and _on(r) and r.casts == 0 and r.index not in nesting
                   and r.input_dtypes == ("float32",) for r in regions):
            continue
        if first.dtype == "float32":
            continue
        ops, _ = _ops_and_casts(regions)
        yield Hit(
            f"{first.label} at {first.source} cast nothing: the {count(ops, 'op')} inside it "
            f"took float32 inputs and none of them is one autocast runs in {first.dtype}.",
            (f"{first.label} entered at {first.source}{_entries(regions)}",
             f"{count(ops, 'op')} ran inside it, all on float32 inputs",
             "none cast by autocast"),
            "everything in the region runs in float32, as without it: autocast lowers only the "
            "ops on its list (matmuls, linear layers, convolutions, attention), and casts "
            "others up to float32 or leaves them as they are",
            "put the region around the model's forward pass (where its matmuls run), or drop "
            "it if the float32 is meant",
            first.source)


@rule("AMP803", "autocast-disabled-inside", "note",
      "autocast turned off or switched inside an autocast region")
def disabled_inside(trace: Trace) -> Iterator[Hit]:
    for regions in _lines(trace).values():
        first = regions[0]
        outer = next((o for r in regions if _on(r)
                      for o in [_enclosing(trace, r)] if o is not None and o.enabled), None)
        if outer is None or (first.enabled and first.dtype == outer.dtype):
            continue
        ops, _ = _ops_and_casts(regions)
        dtypes = sorted({d for r in regions for d in r.input_dtypes})
        inside = (f"turns {first.device_type} autocast off" if not first.enabled else
                  f"switches {first.device_type} autocast to {first.dtype}")
        runs = ("run in their inputs' dtypes" if not first.enabled else f"run in {first.dtype}")
        yield Hit(
            f"{first.label} at {first.source} {inside} inside the {outer.dtype} region "
            f"entered at {outer.source or 'an unknown line'}: its {count(ops, 'op')} {runs}.",
            (f"{first.label} entered at {first.source}{_entries(regions)}, inside "
             f"{outer.label} at {outer.source or 'an unknown line'}",
             f"{count(ops, 'op')} ran inside it, on {', '.join(dtypes) or 'no floating'} inputs"),
            "deliberate in many codebases (a loss, a softmax or rotary tables computed in "
            "float32): what runs inside costs float32's time and memory, and tensors made in the "
            "region around come in 16-bit unless cast",
            "nothing, if meant; inside it, cast what comes from the region around (x.float()), "
            "as autocast leaves it as it is",
            first.source)


@rule("AMP804", "autocast-default-dtype", "note",
      "a float16 autocast region that names no dtype")
def default_dtype(trace: Trace) -> Iterator[Hit]:
    if named(trace, UNSCALE, UPDATE_SCALE):
        return  # float16 with its GradScaler: PyTorch's own recipe
    for regions in _lines(trace).values():
        first = regions[0]
        if not (first.enabled and first.dtype_given is False and first.dtype == "float16"):
            continue
        ops, casts = _ops_and_casts(regions)
        consequence = (
            "float16 gradients need loss scaling: smaller than 2^-24 ≈ 6e-8 they flush to "
            "zero; bfloat16 has float32's range and needs none" if trains(trace) else
            "float16's largest value is 65504: activations past it become inf; bfloat16 has "
            "float32's range")
        yield Hit(
            f"{first.label} at {first.source} names no dtype: it ran float16, "
            f"{first.device_type}'s default, and no GradScaler ran.",
            (f"{first.label} entered at {first.source}{_entries(regions)}: dtype float16 "
             f"(the default of {first.device_type} autocast)",
             f"{count(ops, 'op')} ran inside it, {count(casts, 'op')} cast to float16",
             "no GradScaler kernel ran"),
            consequence,
            f"name the dtype: torch.autocast(\"{first.device_type}\", dtype=torch.bfloat16) "
            "where the GPU has bfloat16 (Ampere and later), else dtype=torch.float16 with a "
            "torch.amp.GradScaler",
            first.source)
