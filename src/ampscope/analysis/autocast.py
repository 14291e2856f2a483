"""Autocast policies side by side: what each category means, and where two devices differ.

The policies themselves are read from the build (runtime/autocast_policy.py); this module only arranges
them for people.

Namesakes, the same concern at another layer: `render/autocast.py`; and the checks of the
autocast regions a run entered, `analysis/checks/autocast.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ampscope.precision.policy_history import PolicyChange
from ampscope.runtime.autocast_policy import OpPolicy

SCHEMA = "ampscope.policy/1"

MEANING = {
    "lower": "runs in {dtype}: floating inputs cast down",
    "fp32": "forced to float32: floating inputs cast up",
    "fp32_set_opt_dtype": "computed in float32 (dtype=float32) unless the caller names a dtype",
    "fp32_append_dtype": "computed in float32 through its dtype overload",
    "promote": "promotes to the widest floating input",
    "banned": "refused under autocast",
    "unclassified": "not classified by the probe; passes through",
    "passthrough": "not on the list: follows its inputs",
}


def meaning(category: str, dtype: str) -> str:
    return MEANING.get(category, category).format(dtype=dtype)


def short_name(op: str) -> str:
    """"aten::softmax.int" -> "softmax.int"."""
    return op.removeprefix("aten::")


@dataclass(frozen=True)
class PolicyRow:
    op: str  # "softmax.int"
    categories: tuple[str, ...]  # one per device compared ("passthrough" when not listed)


def table(policy: dict[str, OpPolicy], op_filter: str | None = None) -> list[PolicyRow]:
    """One device's ops, grouped by category then name; `op_filter` keeps names containing it."""
    rows = [PolicyRow(short_name(name), (rule.category,)) for name, rule in policy.items()
            if op_filter is None or op_filter in short_name(name)]
    order = {c: i for i, c in enumerate(MEANING)}
    return sorted(rows, key=lambda r: (order.get(r.categories[0], 99), r.op))


def compare(a: dict[str, OpPolicy], b: dict[str, OpPolicy], op_filter: str | None = None
            ) -> list[PolicyRow]:
    """Ops whose category differs between the two devices ("passthrough" where not listed)."""
    rows = []
    for name in sorted(set(a) | set(b)):
        if op_filter is not None and op_filter not in short_name(name):
            continue
        pair = (a[name].category if name in a else "passthrough",
                b[name].category if name in b else "passthrough")
        if pair[0] != pair[1]:
            rows.append(PolicyRow(short_name(name), pair))
    return rows


@dataclass
class PolicyReport:
    """What `ampscope policy` shows, in one of four forms: one device's policy (`device`), two
    devices' differences (`devices`), the quiz's answers (`quiz`), or how `device`'s policy
    changed in earlier releases (`history`). `torch` names the build it was read from."""

    dtype: str  # the autocast dtype, e.g. "bfloat16"
    torch: str  # the PyTorch version the policy was read from
    device: str | None = None
    devices: tuple[str, str] | None = None
    rows: list[PolicyRow] = field(default_factory=list)
    total: int = 0  # ops on `device`'s autocast list, before any op filter
    quiz: dict[str, dict[str, dict[str, str]]] | None = None  # device → expression → in → out
    history: list[PolicyChange] | None = None  # `device`'s listed changes, for --history
    in_build: tuple[bool, ...] = ()  # per history row: whether this build has the change

    def to_dict(self) -> dict:
        data: dict = {"schema": SCHEMA, "dtype": self.dtype, "torch": self.torch}
        if self.history is not None:
            data.update(device=self.device, history=[
                {**c.to_dict(), "in_this_build": has}
                for c, has in zip(self.history, self.in_build, strict=True)])
        elif self.quiz is not None:
            data["quiz"] = self.quiz
        elif self.devices is not None:
            data.update(devices=list(self.devices), ops=[
                {"op": r.op, **dict(zip(self.devices, r.categories, strict=True))}
                for r in self.rows])
        else:
            data.update(device=self.device,
                        ops=[{"op": r.op, "category": r.categories[0]} for r in self.rows])
        return data
