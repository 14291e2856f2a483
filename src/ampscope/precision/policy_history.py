"""How autocast policies changed between PyTorch releases, for the ops GPT-style models call.

The policy ampscope applies is always read from the installed build
(`precision.autocast_policy`); a trace made with another release can differ. The changes that
matter for GPT-style models are listed, each with the release it shipped in and the PyTorch pull
request that made it, in `policy_history.json` next to this module (package data), so that
`ampscope policy --history` can show them and a trace can say when its result depends on one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

_DATA = Path(__file__).with_name("policy_history.json")


@dataclass(frozen=True)
class PolicyChange:
    """One op's category on one device, before and since a release."""

    op: str  # "aten::rms_norm"
    device: str  # "cuda"
    before: str  # category in earlier releases ("passthrough": not on the list)
    since: str  # category from `version` on
    version: str  # the first release with `since`, "2.12"
    source: str  # the pull request, "pytorch/pytorch#174824"

    @property
    def name(self) -> str:
        """"aten::rms_norm" -> "rms_norm"."""
        return self.op.removeprefix("aten::").split(".")[0]

    def to_dict(self) -> dict:
        return {"op": self.op.removeprefix("aten::"), "device": self.device,
                "before": self.before, "since": self.since, "version": self.version,
                "source": self.source}


@functools.cache
def changes() -> tuple[PolicyChange, ...]:
    """Every listed change, in the file's order."""
    rows = json.loads(_DATA.read_text())["changes"]
    return tuple(PolicyChange(**row) for row in rows)


def _release(version: str) -> tuple[int, int]:
    """"2.13.0+cpu" -> (2, 13)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def applies(change: PolicyChange, version: str | None = None) -> bool:
    """Whether build `version` (default: this one) has the change."""
    return _release(version or torch.__version__) >= _release(change.version)


def for_device(device: str, op_filter: str | None = None) -> list[PolicyChange]:
    """The listed changes on `device` (op names containing `op_filter`, if given)."""
    return [c for c in changes() if c.device == device
            and (op_filter is None or op_filter in c.op.removeprefix("aten::"))]
