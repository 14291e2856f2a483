"""`AutocastRegion`: one `torch.autocast(...)` region a run entered, and what ran inside it.

A region is recorded each time it is entered while a capture records (a region object entered
every micro-step is one record per entry), in the order they were entered. Its counts are of
the ops recorded while it was the innermost region, so that nested regions split the work
between them rather than count it twice.

Namesakes, the same concern at other layers: `torchcompat/autocast_regions.py` (how a region
is built, entered and read), `runs/autocast_regions.py` (the recorder).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class AutocastRegion:
    index: int  # its place in Trace.autocast_regions: the order the regions were entered
    device_type: str  # as the code named it: torch.autocast("cuda") -> "cuda"
    dtype: str  # the dtype it ran with ("float16" for torch.autocast("cuda") without one)
    enabled: bool  # as it ran: torch turns a region off whose device is missing
    enabled_asked: bool  # as the code asked (`enabled=` argument)
    dtype_given: bool | None  # the code named a dtype; None: built before the run was recorded
    source: str | None  # "train.py:40": the user line that entered it; None: not user code
    depth: int  # 0 for a region entered outside any other recorded one
    parent: int | None  # the index of the region it was entered in
    ops: int  # aten ops recorded while it was the innermost region
    casts: int  # of them, the casts autocast inserted (OpCall.autocast_cast)
    input_dtypes: tuple[str, ...]  # the floating dtypes among those ops' inputs, sorted
    # The device types of the tensors the torch calls inside it were given, as the code sees
    # them (the virtual device's tensors say "cuda"), sorted; empty when no call took a tensor.
    devices: tuple[str, ...]

    @property
    def label(self) -> str:
        """How the code spelled it, in short: `torch.autocast("cuda", dtype=torch.bfloat16)`."""
        parts = [f'"{self.device_type}"']
        if self.dtype_given:
            parts.append(f"dtype=torch.{self.dtype}")
        if not self.enabled_asked:
            parts.append("enabled=False")
        return f"torch.autocast({', '.join(parts)})"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["input_dtypes"] = list(self.input_dtypes)
        data["devices"] = list(self.devices)
        return data

    @classmethod
    def from_dict(cls, data: dict, index: int) -> AutocastRegion:
        return cls(data.get("index", index), data["device_type"], data["dtype"], data["enabled"],
                   data.get("enabled_asked", data["enabled"]), data.get("dtype_given"),
                   data.get("source"), data.get("depth", 0), data.get("parent"),
                   data.get("ops", 0), data.get("casts", 0), tuple(data.get("input_dtypes", ())),
                   tuple(data.get("devices", ())))
