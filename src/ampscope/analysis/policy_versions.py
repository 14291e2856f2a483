"""The finding that says when a trace's dtypes depend on the PyTorch release.

Autocast's op lists change between releases (precision/policy_history.json lists the changes
for the ops GPT-style models call, each with its pull request). A trace follows the policy of
the build it ran on (`SettingRecord.torch`); when the model calls an op whose category on the
setting's device changed in the last `RECENT_RELEASES` releases, the same script on a build
from before the change runs it in another dtype, and this finding says so. Older changes are
in `ampscope policy --history` but not repeated on every trace.
"""

from __future__ import annotations

from ampscope.precision.policy_history import PolicyChange, applies, for_device
from ampscope.records import Finding, Trace

RECENT_RELEASES = 4  # about a year of PyTorch releases


def _runs(category: str, dtype: str, *, past: bool = False) -> str:
    if past:
        return {"passthrough": "followed its inputs", "fp32": "ran in float32",
                "lower": f"ran in {dtype}"}.get(category, f"was on the {category} list")
    return {"passthrough": "follows its inputs", "fp32": "runs in float32",
            "lower": f"runs in {dtype}"}.get(category, f"is on the {category} list")


def _recent(change: PolicyChange, version: str) -> bool:
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    changed_major, changed_minor = (int(p) for p in change.version.split("."))
    return changed_major == major and minor - changed_minor <= RECENT_RELEASES


def policy_version_findings(trace: Trace) -> list[Finding]:
    setting = trace.setting
    if setting.autocast_dtype is None or setting.torch is None:
        return []
    findings = []
    for change in for_device(setting.device):
        if not _recent(change, setting.torch):
            continue
        calls = [c for c in trace.calls if c.autocast is not None and c.phase == "forward"
                 and c.func.rsplit(".", 1)[-1] == change.name]
        if not calls:
            continue
        dtype = setting.autocast_dtype
        has = applies(change, setting.torch)
        now, other = (change.since, change.before) if has else (change.before, change.since)
        when = f"before PyTorch {change.version}" if has else f"from PyTorch {change.version} on"
        where = f" at {calls[0].source}" if calls[0].source else ""
        findings.append(Finding(
            f"{change.name} {_runs(now, dtype)} under {setting.device} autocast in PyTorch "
            f"{setting.torch}, the build this trace followed; {when} it "
            f"{_runs(other, dtype, past=has)} ({change.source}): this model's dtypes depend on the "
            f"release ({len(calls)} {'call' if len(calls) == 1 else 'calls'}{where}).",
            "autocast-policy", calls[0].source))
    return findings
