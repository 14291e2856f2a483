"""A collective's process-group size: read from the group it ran on, or, where it cannot be
read, said so — in the trace, and in the distributed report that then takes the world.

The ground truth is the groups the tests make themselves on PyTorch's fake process group: the
world of 4 ranks and a subgroup of ranks 0 and 1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import ampscope
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import DistributedReport, collectives, world_size_note
from ampscope.torchcompat import distributed as compat
from ampscope.torchcompat.dispatch import TorchDispatchMode

WORLD = 4


@pytest.fixture
def subgroup():
    """The fake world of 4 ranks, and its subgroup of ranks 0 and 1."""
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=WORLD)
    try:
        yield dist.new_group([0, 1])
    finally:
        dist.destroy_process_group()


def _collective_calls(run) -> list[tuple]:
    """(op, args, kwargs) of every collective op `run()` dispatches."""
    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in compat.NAMESPACES:
                seen.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Seen():
        run()
    return seen


def test_the_size_is_that_of_the_group_the_op_ran_on(subgroup):
    import torch.distributed._functional_collectives as functional

    def run():
        x = torch.ones(4)
        dist.all_reduce(x)  # the world
        dist.all_reduce(x, group=subgroup)
        functional.wait_tensor(functional.all_reduce(x, "sum", subgroup))

    sizes = [(str(f), compat.collective_group_size(f, a, k)) for f, a, k in _collective_calls(run)]
    assert ("c10d.allreduce_.default", WORLD) in sizes
    assert ("c10d.allreduce_.default", 2) in sizes
    assert ("_c10d_functional.all_reduce.default", 2) in sizes  # by the group's name
    # An op that names no group has none to read: not an error.
    assert ("_c10d_functional.wait_tensor.default", None) in sizes


def test_a_group_that_cannot_be_read_raises_with_the_reason(subgroup):
    import torch.distributed._functional_collectives as functional

    calls = _collective_calls(
        lambda: functional.wait_tensor(functional.all_reduce(torch.ones(4), "sum", subgroup)))
    func, args, kwargs = next(c for c in calls if c[0].__name__ == "all_reduce.default")
    # A name no group is registered under, as a build that names its groups otherwise gives.
    unknown = (args[0], args[1], "no-such-group")
    with pytest.raises(compat.GroupSizeUnknown, match=r"group_name could not be read "
                       r"\(RuntimeError: Could not resolve the process group registered under "
                       r"the name no-such-group\)"):
        compat.collective_group_size(func, unknown, kwargs)
    in_place = _collective_calls(lambda: dist.all_reduce(torch.ones(4), group=subgroup))[0]
    not_a_group = (in_place[1][0], object(), *in_place[1][2:])
    with pytest.raises(compat.GroupSizeUnknown, match=r"process_group could not be read"):
        compat.collective_group_size(in_place[0], not_a_group, in_place[2])


class _TwoGroups(torch.nn.Module):
    """A linear layer whose output is all-reduced over the subgroup, then over the world."""

    def __init__(self, subgroup) -> None:
        super().__init__()
        self.subgroup = subgroup
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        shared = y.detach().clone()
        dist.all_reduce(shared, group=self.subgroup)
        dist.all_reduce(shared)
        return (y + shared).sum()


def _report(trace) -> DistributedReport:
    return DistributedReport(model="two-groups", parameters=20, setting=trace.setting,
                             parallel=Parallel("ddp", WORLD), backend="fake", mode="run",
                             ranks=[], trace=trace)


def _all_reduces(trace) -> list[tuple[int | None, int, int]]:
    """(recorded group, payload, wire bytes) of each all-reduce, in order."""
    calls = collectives(trace.ops, WORLD)
    groups = {o.index: o.group for o in trace.ops}
    return [(groups[c.index], c.payload_bytes, c.wire_bytes) for c in calls]


def test_a_recorded_group_counts_its_own_ring_and_needs_no_note(subgroup):
    trace = ampscope.trace(_TwoGroups(subgroup), {"x": torch.randn(2, 4)}, predict=False)
    # 2 × 4 float32 = 32 bytes each; a ring all-reduce sends 2(N-1)/N of it: N = 2, then 4.
    assert _all_reduces(trace) == [(2, 32, 32), (WORLD, 32, 48)]
    assert not [n for n in trace.notes if "process group" in n]
    assert world_size_note(trace.ops, WORLD) is None
    assert _report(trace).notes == []


def _unreadable(dist_module, group):
    raise RuntimeError("made unreadable")


def test_a_group_that_cannot_be_read_is_noted_and_the_report_says_it_took_the_world(
        subgroup, monkeypatch):
    monkeypatch.setattr(compat, "_unboxed_group", _unreadable)
    trace = ampscope.trace(_TwoGroups(subgroup), {"x": torch.randn(2, 4)}, predict=False)
    # Both taken to be the world: the subgroup's all-reduce is overstated (48, not 32 bytes).
    assert _all_reduces(trace) == [(None, 32, 48), (None, 32, 48)]
    assert [n for n in trace.notes if "process group" in n] == [
        "The process group of c10d.allreduce_.default is not in its records: the size of "
        "c10d.allreduce_.default's process_group could not be read (RuntimeError: made "
        "unreadable); a distributed report takes its group to be the world."]
    report = _report(trace)
    assert report.notes == [
        "The process group's size of 2 collective(s) is not recorded (c10d.allreduce_.default "
        "×2): their wire bytes take the group to be the world, 4 ranks; a smaller group "
        "(tensor parallelism's, FSDP2's on a 2-D mesh) sends less."]
    # Read back (as a launcher rebuilds a rank's report): the note is not said twice.
    again = replace(report, notes=list(report.notes))
    assert again.notes == report.notes


def test_the_span_is_the_lowest_and_highest_global_rank_of_the_group(subgroup):
    import torch.distributed._functional_collectives as functional

    ends = dist.new_group([0, 3])  # ranks 0 and 3: 2 ranks that span the world

    def run():
        x = torch.ones(4)
        dist.all_reduce(x)  # the world: ranks 0-3
        dist.all_reduce(x, group=ends)
        functional.wait_tensor(functional.all_reduce(x, "sum", subgroup))

    groups = [(str(f), compat.collective_group(f, a, k)) for f, a, k in _collective_calls(run)]
    assert [g for g in groups if g[1] is not None] == [
        ("c10d.allreduce_.default", compat.CollectiveGroup(WORLD, (0, 3))),
        ("c10d.allreduce_.default", compat.CollectiveGroup(2, (0, 3))),
        ("_c10d_functional.all_reduce.default", compat.CollectiveGroup(2, (0, 1))),
    ]
    assert ("_c10d_functional.wait_tensor.default", None) in groups  # no group to read


def _no_ranks(dist_module, group):
    raise KeyError("not registered")


def test_ranks_that_cannot_be_read_keep_the_size_and_say_the_link_goes_by_it(
        subgroup, monkeypatch):
    monkeypatch.setattr(compat, "_group_ranks", _no_ranks)
    trace = ampscope.trace(_TwoGroups(subgroup), {"x": torch.randn(2, 4)}, predict=False)
    assert [(o.group, o.group_span) for o in trace.ops if o.group] == [(2, None), (WORLD, None)]
    assert [n for n in trace.notes if "process group" in n] == [
        "The ranks of c10d.allreduce_.default's process group are not in its records: the "
        "ranks of c10d.allreduce_.default's process_group could not be read (KeyError: "
        "'not registered'); a step time places the group by its size (NVLink up to a node's "
        "GPUs), which is wrong for a small group whose ranks lie on several nodes (FSDP's on "
        "a 2-D mesh)."]
    # The wire bytes need only the size: no note from the distributed report.
    assert _all_reduces(trace) == [(2, 32, 32), (WORLD, 32, 48)]
    assert _report(trace).notes == []


def test_a_world_of_one_rank_needs_no_note(subgroup, monkeypatch):
    monkeypatch.setattr(compat, "_unboxed_group", _unreadable)
    trace = ampscope.trace(_TwoGroups(subgroup), {"x": torch.randn(2, 4)}, predict=False)
    assert world_size_note(trace.ops, 4) is not None
    assert world_size_note(trace.ops, 1) is None  # every group is the world
