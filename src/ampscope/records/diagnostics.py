"""`Diagnostic`: one judgement of a run (something wrong, or a deliberate choice worth knowing),
as a linter states it: a stable id, a severity, the message, the evidence, what it does on the
target device and the usual fix. The checks that make them live in analysis/checks/.

Namesakes, the same concern at another layer: `render/diagnostics.py` (the terminal view)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# From the most to the least severe. error: fails, or produces inf/NaN, on the target device;
# warning: silently loses precision or speed there; note: a deliberate choice worth knowing.
SEVERITIES = ("error", "warning", "note")


@dataclass(frozen=True)
class Diagnostic:
    id: str  # "AMP201": stable, as a linter's rule code
    name: str  # "fp16-without-loss-scaling": the id in words
    severity: str  # one of SEVERITIES
    message: str  # one line
    evidence: tuple[str, ...]  # the ops, tensors, lines and counts it rests on
    consequence: str  # what it does on the target device
    fix: str  # the usual fix
    source: str | None = None  # "train.py:12": the line to look at (and to silence it on)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["evidence"] = list(self.evidence)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Diagnostic:
        return cls(data["id"], data["name"], data["severity"], data["message"],
                   tuple(data.get("evidence", ())), data.get("consequence", ""),
                   data.get("fix", ""), data.get("source"))
