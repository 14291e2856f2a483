"""Each rank's reserved peak: the CUDA caching allocator (hardware/cuda_allocator.py) replayed
over the rank's storages, beside its allocated peak, in a predicted 2-rank FSDP2 step of
gpt2-tiny on cuda (`trace --distributed fsdp --predict`'s API, rank 0 on PyTorch's fake process
group); none on a CPU setting. PYTORCH_CUDA_ALLOC_CONF is honoured, and an unreadable one stops
only a cuda run."""

from __future__ import annotations

import json

import pytest

from ampscope.cli import main
from ampscope.distributed import Parallel, predict
from ampscope.distributed.report import RankReport, rank_peak
from ampscope.errors import AmpscopeError
from ampscope.hardware.cuda_allocator import MIN_BLOCK, SMALL_BUFFER, AllocatorConfig, replay
from ampscope.records.timeline import allocation_events

MODEL, RUN = "gpt2-tiny", {"batch": 2, "seq": 16}
FSDP = Parallel("fsdp", 2)


@pytest.fixture(scope="module")
def cuda_run():
    return predict(MODEL, FSDP, setting="cuda:fp32", **RUN)


def _own_replay(trace, config: AllocatorConfig | None = None) -> int:
    """The replay run here, from the storage records themselves: each made at its op (before
    the step: -1), freed after the last op it was live through."""
    n = len(trace.ops)
    events = [(s.nbytes, -1 if s.created is None else s.created,
               None if s.freed is None else min(s.freed + 1, n)) for s in trace.storages]
    return replay(events, config).reserved_peak


def test_each_ranks_reserved_peak_is_the_replay_of_its_storages(cuda_run):
    assert cuda_run.trace is not None and cuda_run.trace.setting.device == "cuda"
    [rank] = cuda_run.ranks
    peak = rank.peak
    assert peak is not None and peak.rounded_bytes is not None and peak.reserved_bytes is not None
    assert peak.reserved_bytes == _own_replay(cuda_run.trace)
    # Reserved holds every 512-byte block live at the allocated peak, in whole segments: a
    # 2 MiB small segment is the least any block can live in.
    assert peak.reserved_bytes >= peak.rounded_bytes >= peak.bytes > 0
    assert peak.reserved_bytes >= SMALL_BUFFER and peak.rounded_bytes % MIN_BLOCK == 0
    # The JSON carries it, and reads back.
    data = rank.to_dict()
    assert data["peak"]["reserved_bytes"] == peak.reserved_bytes
    assert RankReport.from_dict(json.loads(json.dumps(data))).peak == peak


def test_the_events_are_those_of_the_storages(cuda_run):
    trace = cuda_run.trace
    events = allocation_events(trace.storages, len(trace.ops))
    assert [e[:3] for e in events] == [
        (s.nbytes, -1 if s.created is None else s.created,
         None if s.freed is None else min(s.freed + 1, len(trace.ops))) for s in trace.storages]
    assert {e[3] for e in events} == {0}  # a trace records no streams: one stream


def test_the_allocator_options_change_the_rank_reserved_peak(cuda_run):
    trace = cuda_run.trace
    expandable = AllocatorConfig(expandable_segments=True)
    peak = rank_peak(trace, expandable)
    assert peak is not None and peak.reserved_bytes == _own_replay(trace, expandable)
    # Expandable segments map 2 MiB small pages as needed: never more than whole segments.
    assert peak.reserved_bytes <= cuda_run.ranks[0].peak.reserved_bytes
    assert peak.reserved_bytes % SMALL_BUFFER == 0


def test_pytorch_cuda_alloc_conf_is_read_for_each_rank(cuda_run, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert rank_peak(cuda_run.trace).reserved_bytes == _own_replay(
        cuda_run.trace, AllocatorConfig(expandable_segments=True))


def test_a_cpu_setting_has_no_reserved_peak_and_ignores_an_unreadable_conf(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments")
    report = predict(MODEL, FSDP, setting="fp32", **RUN)
    peak = report.ranks[0].peak
    assert peak is not None and peak.bytes > 0
    assert peak.rounded_bytes is None and peak.reserved_bytes is None
    with pytest.raises(AmpscopeError, match="PYTORCH_CUDA_ALLOC_CONF='expandable_segments': "
                                            "'expandable_segments' is not option:value"):
        predict(MODEL, FSDP, setting="cuda:fp32", **RUN)


def test_the_cli_shows_reserved_beside_peak(tmp_path, capsys):
    out = tmp_path / "dist.json"
    assert main(["trace", MODEL, "--distributed", "fsdp", "--nproc", "2", "--predict",
                 "-s", "cuda:fp32", "--seq", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    peak = json.loads(out.read_text())["ranks"][0]["peak"]
    assert peak["reserved_bytes"] >= peak["rounded_bytes"]
    assert "reserved" in text and "peak" in text


def test_the_html_report_shows_each_reserved_peak(cuda_run):
    from ampscope.api.reports import memory
    from ampscope.render.html import memory_body, ranks_body

    reserved = cuda_run.ranks[0].peak.reserved_bytes
    ranks = str(ranks_body(cuda_run))
    assert "<th>reserved</th>" in ranks and f'title="{reserved:,} B"' in ranks
    # The memory report of rank 0's trace: its reserved peak is the same replay.
    report = memory(cuda_run.trace)
    assert report.reserved is not None and report.reserved.reserved_peak == reserved
    assert "<th>reserved (allocator replay)</th>" in str(memory_body([report]))
    cpu = predict(MODEL, FSDP, setting="fp32", **RUN)
    assert "<th>reserved" not in str(ranks_body(cpu))
    assert "<th>reserved" not in str(memory_body([memory(cpu.trace)]))
