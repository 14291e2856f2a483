"""The CUDA caching allocator replay (hardware/cuda_allocator.py; analysis/allocator.py over a
trace's storages) on sequences whose reserved bytes follow from the documented rules, each
worked out by hand in the comments, and on a real tiny trace. Events are (bytes, made at, freed at or None, stream)."""

from __future__ import annotations

import pytest

import ampscope
from ampscope.analysis.allocator import replay_storages
from ampscope.analysis.memory import memory_report
from ampscope.errors import AmpscopeError
from ampscope.hardware.cuda_allocator import AllocatorConfig, Event, replay

KiB, MiB = 1024, 1024 * 1024


def test_a_small_request_gets_one_2mib_segment():
    r = replay([(1000, 0, None)])
    # 1000 B -> 512-byte multiple 1024 B; <= 1 MiB: the small pool, whose segments are 2 MiB.
    assert (r.reserved_peak, r.allocated_peak, r.mallocs) == (2 * MiB, 1024, 1)
    assert (r.requested, r.rounding) == (1000, 24)
    # The 2 MiB segment's untouched tail: 2,097,152 - 1,024.
    assert (r.segments, r.fragmentation) == (2 * MiB - 1024, 0)


def test_two_600_kib_requests_share_a_segment():
    r = replay([(600 * KiB, 0, None), (600 * KiB, 1, None)])
    # 614,400 B each (a multiple of 512). The first splits the 2 MiB segment (remainder
    # 1,482,752 >= 512 B); the second is the best fit in that remainder: no second segment.
    assert (r.reserved_peak, r.mallocs, r.segment_count) == (2 * MiB, 1, 1)
    # The causes are counted where reserved reaches its peak: at the first request, when the
    # segment's tail past the first block was not yet handed out.
    assert (r.reserved_at, r.requested) == (0, 614_400)
    assert r.segments == 2 * MiB - 614_400 == 1_482_752
    assert r.allocated_peak == 2 * 614_400


def test_5_mib_requests_split_one_20_mib_segment():
    r = replay([(5 * MiB, 0, None), (5 * MiB, 1, None)])
    # 5 MiB: large pool, under 10 MiB -> a 20 MiB segment, split (remainder 15 MiB > 1 MiB);
    # the second 5 MiB is carved from the 15 MiB remainder (10 MiB left > 1 MiB: split again).
    assert (r.reserved_peak, r.mallocs, r.allocated_peak) == (20 * MiB, 1, 10 * MiB)
    assert r.segments == 15 * MiB  # at the first request, where the 20 MiB were reserved


def test_large_requests_get_their_own_segment_rounded_to_2_mib():
    # 12 MiB >= 10 MiB: a segment of exactly 12 MiB (a multiple of 2 MiB).
    assert replay([(12 * MiB, 0, None)]).reserved_peak == 12 * MiB
    # 12 MiB + 1 B -> 12 MiB + 512 B rounded; the segment rounds up to 14 MiB.
    r = replay([(12 * MiB + 1, 0, None)])
    assert (r.reserved_peak, r.allocated_peak, r.rounding) == (14 * MiB, 12 * MiB + 512, 511)
    assert r.segments == 2 * MiB - 512


def test_freed_block_is_reused():
    r = replay([(12 * MiB, 0, 1), (12 * MiB, 1, None)])
    # Freed at time 1 before the second request at time 1: the cached 12 MiB block fits.
    assert (r.reserved_peak, r.mallocs) == (12 * MiB, 1)


def test_a_block_freed_on_one_stream_is_not_reused_on_another():
    same = replay([Event(5 * MiB, 0, 1, stream=1), Event(5 * MiB, 2, None, stream=1)])
    assert (same.reserved_peak, same.mallocs) == (20 * MiB, 1)
    other = replay([Event(5 * MiB, 0, 1, stream=1), Event(5 * MiB, 2, None, stream=0)])
    # Stream 0 has no cached block: a second 20 MiB segment. Stream 1's segment is free;
    # 15 MiB of it was never handed out, 5 MiB were and are cached on stream 1.
    assert (other.reserved_peak, other.mallocs, other.segment_count) == (40 * MiB, 2, 2)
    assert (other.segments, other.fragmentation, other.other_streams) == (
        15 * MiB + 15 * MiB, 5 * MiB, 5 * MiB)


def test_fragmentation_a_cached_block_too_small():
    r = replay([(12 * MiB, 0, 2), (12 * MiB, 1, None), (14 * MiB, 3, None)])
    # A (12 MiB) and B (12 MiB) each get a 12 MiB segment; A is freed; the 14 MiB request does
    # not fit A's cached 12 MiB block: a third segment of 14 MiB. 12 + 12 + 14 = 38 MiB reserved
    # for 26 MiB live: the 12 MiB gap is fragmentation, nothing else.
    assert (r.reserved_peak, r.requested) == (38 * MiB, 26 * MiB)
    assert (r.fragmentation, r.segments, r.rounding, r.other_streams) == (12 * MiB, 0, 0, 0)
    assert r.allocated_peak == 26 * MiB


def test_max_split_size():
    events = [(40 * MiB, 0, 1), (8 * MiB, 2, None)]
    # Default: the 8 MiB request takes the cached 40 MiB block and splits it (32 MiB > 1 MiB).
    assert replay(events).reserved_peak == 40 * MiB
    # max_split_size 32 MiB: a request under it never takes a block at or over it, so the
    # 8 MiB request gets its own 20 MiB segment: 40 + 20.
    cap = AllocatorConfig.from_env("max_split_size_mb:32")
    assert cap.max_split_size == 32 * MiB
    assert replay(events, cap).reserved_peak == 60 * MiB
    # A 36 MiB request (>= 32) may take the 40 MiB block, within 20 MiB of it, and takes it
    # whole (oversize blocks are not split): 4 MiB beyond the request, counted as rounding.
    r = replay([(40 * MiB, 0, 1), (36 * MiB, 2, None)], cap)
    assert (r.reserved_peak, r.rounding) == (40 * MiB, 0)  # the peak is at the first request
    assert replay([(40 * MiB, 0, 1), (36 * MiB, 2, None), (1, 3, None)], cap).rounding == \
        4 * MiB + 511
    # A 60 MiB cached block is 20 MiB or more above 36 MiB: not taken; a new 36 MiB segment.
    assert replay([(60 * MiB, 0, 1), (36 * MiB, 2, None)], cap).reserved_peak == 96 * MiB


def test_capacity_releases_cached_segments_then_runs_out():
    events = [(24 * MiB, 0, 1), (30 * MiB, 1, None), (20 * MiB, 2, None)]
    # Without a capacity every segment stays: 24 + 30 = 54 MiB, the 20 MiB request carved
    # from the cached 24 MiB block (remainder 4 MiB > 1 MiB: split).
    free = replay(events)
    assert (free.reserved_peak, free.oom, free.mallocs) == (54 * MiB, None, 2)
    r = replay(events, capacity=40 * MiB)
    # 30 MiB does not fit the cached 24 MiB block; 24 + 30 > 40, so the wholly free 24 MiB
    # segment is given back and the 30 MiB one made (peak 30). Then 20 MiB: 30 + 20 > 40 with
    # nothing cached to give back: out of memory at time 2.
    assert (r.reserved_peak, r.mallocs) == (30 * MiB, 2)
    assert r.oom is not None
    assert (r.oom.time, r.oom.size, r.oom.reserved, r.oom.capacity) == (
        2, 20 * MiB, 30 * MiB, 40 * MiB)


def test_expandable_segments():
    conf = AllocatorConfig.from_env("expandable_segments:True")
    # A 12 MiB block, freed, then 14 MiB: without expandable segments two segments (12 + 14);
    # with them one large segment whose first 20 MiB page holds either: 20 MiB mapped.
    events = [(12 * MiB, 0, 1), (14 * MiB, 1, None)]
    assert replay(events).reserved_peak == 26 * MiB
    r = replay(events, conf)
    assert (r.reserved_peak, r.segment_count) == (20 * MiB, 1)
    # 5 + 5 MiB use one 20 MiB page; 12 MiB then takes the 10 MiB free tail plus 2 MiB more,
    # mapped as one more 20 MiB page: 40 MiB, one segment.
    grown = replay([(5 * MiB, 0, None), (5 * MiB, 1, None), (12 * MiB, 2, None)], conf)
    assert (grown.reserved_peak, grown.segment_count, grown.segments) == (40 * MiB, 1, 18 * MiB)
    # Small requests map 2 MiB pages of their own segment; each stream has its own.
    small = replay([Event(600 * KiB, 0, None, 0), Event(600 * KiB, 0, None, 1)], conf)
    assert (small.reserved_peak, small.segment_count) == (4 * MiB, 2)
    # Under a capacity a free tail is unmapped before giving up: stream 1 maps a 20 MiB page
    # for 12 MiB and frees it; stream 0's 30 MiB needs two pages (40 MiB), 20 + 40 > 40, so
    # stream 1's free page is unmapped and the 40 MiB mapped. Uncapped: 60 MiB.
    events = [Event(12 * MiB, 0, 1, 1), Event(30 * MiB, 2, None, 0)]
    assert replay(events, conf).reserved_peak == 60 * MiB
    cap = replay(events, conf, capacity=40 * MiB)
    assert (cap.oom, cap.reserved_peak, cap.mallocs) == (None, 40 * MiB, 2)


BOTH = "expandable_segments:True,max_split_size_mb:32"  # the two options together


def test_expandable_segments_take_an_oversize_free_tail_as_it_is():
    """Best fit passes over an oversize block for a request under max_split_size; when that block
    is the expandable segment's free tail, the request takes it and maps nothing."""
    conf = AllocatorConfig.from_env(BOTH)
    events = [Event(40 * MiB, 0, 1, 0), Event(8 * MiB, 2, None, 0), Event(30 * MiB, 3, None, 1)]
    r = replay(events, conf)
    # t0, stream 0: 40 MiB maps two 20 MiB pages of stream 0's segment: [0, 40) MiB, no
    # remainder to split. Reserved 40. t1: it is freed, the segment's free tail.
    # t2, stream 0: 8 MiB is under 32 MiB and the only cached block, 40 MiB, is at or over it:
    # best fit passes it over. The segment's free tail (the same 40 MiB) already holds 8 MiB:
    # no page mapped, the tail split (remainder 32 MiB >= 512 B): [0, 8) live, [8, 40) free.
    # Reserved stays 40 (the old replay "grew" by -20 MiB here, to 20).
    # t3, stream 1: 30 MiB, a segment of its own: two pages, 40 MiB, split (10 MiB left free).
    # Reserved 40 + 40 = 80, the peak, in two segments, mapped by two calls.
    assert (r.reserved_peak, r.reserved_at, r.segment_count, r.mallocs) == (80 * MiB, 3, 2, 2)
    # At the peak: 8 + 30 MiB requested, multiples of 512 B. Tails never handed out: stream 1's
    # 10 MiB (stream 0 handed out all 40 at t0). Fragmentation: stream 0's 32 MiB free block,
    # cached on a stream other than the one allocating at the peak.
    assert (r.requested, r.rounding, r.segments) == (38 * MiB, 0, 10 * MiB)
    assert (r.fragmentation, r.other_streams) == (32 * MiB, 32 * MiB)
    assert (r.allocated_peak, r.allocated_at, r.oom) == (40 * MiB, 0, None)


def test_expandable_segments_are_not_released_as_oversize_under_a_capacity():
    """Past a capacity, max_split_size_mb gives back cached oversize segments whole; PyTorch
    skips expandable segments' blocks there. What is unmapped instead: the free tails (the
    replay unmaps nothing else, see `_release_cached`)."""
    conf = AllocatorConfig.from_env(BOTH)
    events = [Event(40 * MiB, 0, 4, 1),  # F: stream 1
              Event(40 * MiB, 0, 4, 0), Event(8 * MiB, 1, None, 0),  # A, B: stream 0
              Event(40 * MiB, 2, 4, 0), Event(60 * MiB, 5, None, 0)]  # D, E
    # t0: F maps [0, 40) MiB of stream 1's segment, A [0, 40) of stream 0's: reserved 80.
    # t1: B finds no free block; stream 0's tail is A, in use: one page [40, 60), B [40, 48),
    # [48, 60) free. Reserved 100. t2: D, 40 MiB: the free tail holds 12, 28 more need two
    # pages: [60, 100); D [48, 88), [88, 100) free. Reserved 140.
    # t4: F, A and D freed. Stream 0 caches A [0, 40) (B is its neighbour) and D merged with
    # [88, 100): [48, 100), 52 MiB, the segment's free tail. Stream 1 caches [0, 40).
    # t5: E, 60 MiB (>= 32): no cached block holds it; the free tail's 52 plus one page of 20.
    uncapped = replay(events, conf)
    assert (uncapped.reserved_peak, uncapped.reserved_at, uncapped.mallocs) == (160 * MiB, 5, 5)
    # At 160: 8 + 60 requested; [108, 120) of stream 0 never handed out; A's 40 MiB and
    # stream 1's 40 MiB cached, the latter on another stream than E's.
    assert (uncapped.requested, uncapped.segments, uncapped.fragmentation,
            uncapped.other_streams) == (68 * MiB, 12 * MiB, 80 * MiB, 40 * MiB)
    capped = replay(events, conf, capacity=150 * MiB)
    # Under 150 MiB, 140 + 20 does not fit. The cached oversize blocks (52 and 40 MiB) lie in
    # expandable segments: nothing is given back whole (the old replay gave back stream 0's
    # segment twice over and raised ValueError). Then cached bytes are unmapped: stream 1's
    # free tail, all 40 MiB (reserved 100), and the whole pages of stream 0's free tail
    # [48, 100), that is [60, 100) (reserved 60); A, not a tail, stays mapped. E takes the 12 MiB
    # left at [48, 60) and three pages more, [60, 120): reserved 120, within the capacity.
    assert (capped.oom, capped.mallocs) == (None, 5)
    # The peak is t2's 140, before the capacity mattered: 128 MiB requested, [88, 100) untouched.
    assert (capped.reserved_peak, capped.reserved_at, capped.segment_count) == (140 * MiB, 2, 2)
    assert (capped.requested, capped.segments, capped.fragmentation) == (128 * MiB, 12 * MiB, 0)
    for r in (uncapped, capped):
        causes = (r.requested, r.rounding, r.segments, r.fragmentation, r.other_streams)
        assert sum(causes[:4]) == r.reserved_peak and min(causes) >= 0


def test_roundup_power2_divisions():
    conf = AllocatorConfig.from_env("roundup_power2_divisions:4")
    # 1200 KiB lies in [1024, 2048) KiB; 4 divisions: 1024, 1280, 1536, 1792 -> 1280 KiB.
    assert conf.round_size(1200 * KiB) == 1280 * KiB
    # 1200 B is not above 512 x 4: plain 512-byte rounding.
    assert conf.round_size(1200) == 1536
    r = replay([(1200 * KiB, 0, None)], conf)
    assert (r.reserved_peak, r.rounding) == (20 * MiB, 80 * KiB)
    listed = AllocatorConfig.from_env("roundup_power2_divisions:[256:1,512:2,>:4]")
    # Intervals from 1 MiB: index log2(MiB); 256 -> 8 (and below it), 512 -> 9, beyond -> 4.
    assert listed.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6
    # 700 MiB lies in [512, 1024) MiB, index 9: 2 divisions, 256 MiB apart -> 768 MiB.
    assert listed.round_size(700 * MiB + 1) == 768 * MiB
    assert listed.round_size(300 * MiB + 1) == 300 * MiB + 512  # 1 division: 512 B rounding


def test_alloc_conf_parsing():
    conf = AllocatorConfig.from_env(
        "expandable_segments:True,garbage_collection_threshold:0.6,bogus:1")
    assert conf.expandable_segments
    assert conf.notes == (
        "PYTORCH_CUDA_ALLOC_CONF's garbage_collection_threshold is not modelled by the replay",
        "PYTORCH_CUDA_ALLOC_CONF's 'bogus' is not an option the replay knows "
        "(expandable_segments, max_split_size_mb, roundup_power2_divisions, "
        "max_non_split_rounding_mb): ignored")
    assert AllocatorConfig.from_env("") == AllocatorConfig()
    for text, why in (("expandable_segments", "is not option:value"),
                      ("expandable_segments:yes", "takes True or False"),
                      ("max_split_size_mb:20", "must be > 20"),
                      ("max_split_size_mb:1.5", "whole number of MiB"),
                      ("roundup_power2_divisions:3", "powers of 2"),
                      ("roundup_power2_divisions:[256:1", "unclosed")):
        with pytest.raises(AmpscopeError, match=why) as info:
            AllocatorConfig.from_env(text)
        assert str(info.value).startswith(f"PYTORCH_CUDA_ALLOC_CONF={text!r}: ")


def test_zero_bytes_and_bad_times():
    assert replay([(0, 0, None)]).reserved_peak == 0
    with pytest.raises(AmpscopeError, match="freed at 0, not after it is made at 3"):
        replay([(10, 3, 0)])
    with pytest.raises(AmpscopeError, match="freed at 3, not after it is made at 3"):
        replay([(10, 3, 3)])


@pytest.fixture(scope="module")
def tiny():
    return ampscope.trace("gpt2-tiny", setting="cuda:fp32", workload="train", batch=1, seq=8,
                          predict=True)


def test_a_real_tiny_trace(tiny):
    t = tiny
    report = memory_report(t)
    r = replay_storages(t.storages, len(t.ops))
    # The replay's allocated peak is the report's, counted independently in 512-byte blocks.
    assert (r.allocated_peak, r.allocated_at) == (report.peak.rounded_bytes, report.peak.rounded_op)
    # Every storage of this step is at most 128 KiB: small pool only, 2 MiB segments. The
    # rounded peak, 2,775,040 B, needs at least ceil(2,775,040 / 2 MiB) = 2 of them, and the
    # replay finds the holes it needs in those two: 4 MiB.
    assert max(s.nbytes for s in t.storages) <= 128 * KiB
    assert report.peak.rounded_bytes == 2_775_040
    assert (r.reserved_peak, r.segment_count) == (4 * MiB, 2)
    assert r.reserved_peak >= r.allocated_peak
    assert r.requested + r.rounding + r.segments + r.fragmentation == r.reserved_peak
    assert report.reserved is not None and report.reserved.reserved_peak == 4 * MiB


def test_memory_honours_pytorch_cuda_alloc_conf(tiny, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,backend:native")
    report = ampscope.memory(tiny)
    assert report.reserved is not None and report.reserved.config.expandable_segments
    # One small-pool segment growing by 2 MiB pages: at most the two segments' 4 MiB.
    assert report.reserved.segment_count == 1
    assert report.reserved.reserved_peak % (2 * MiB) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF's backend is not modelled by the replay" in report.notes
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:big")
    with pytest.raises(AmpscopeError, match="max_split_size_mb takes a whole number of MiB"):
        ampscope.memory(tiny)


def test_an_unreadable_alloc_conf_stops_only_cuda_runs(monkeypatch):
    """It configures CUDA's allocator alone: a CPU run goes on; a cuda one stops before it is
    traced, by its setting or its device."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:maybe")
    report = ampscope.memory("gpt2-tiny", seq=8, setting="fp32")
    assert report.reserved is None and report.peak.bytes > 0
    for options in (dict(setting="cuda:fp32"), dict(setting="fp32", device="cuda")):
        with pytest.raises(AmpscopeError, match="expandable_segments takes True or False"):
            ampscope.memory("gpt2-tiny", seq=8, **options)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64",
                                  "roundup_power2_divisions:4", BOTH])
def test_random_sequences_keep_the_books(conf):
    """Splits, merges, releases and pages on 3,000 random events over two streams, uncapped and
    capped at 3/4, 1/2 and 1/4 of the uncapped peak: the causes, none negative, add up to the
    reserved peak, which holds the allocated one; a capacity is never passed."""
    import random
    rng = random.Random(7)
    events = [Event(rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB),
                                rng.randint(MiB, 80 * MiB)]),
                    i, i + rng.randint(1, 300) if rng.random() < 0.95 else None, rng.randint(0, 1))
              for i in range(3000)]
    config = AllocatorConfig.from_env(conf)
    free = replay(events, config)
    assert free.reserved_peak >= free.allocated_peak
    runs = [free]
    for share in (3, 2, 1):
        capacity = free.reserved_peak * share // 4
        runs.append(replay(events, config, capacity=capacity))
        assert runs[-1].reserved_peak <= capacity
        assert runs[-1].oom is not None or runs[-1].allocated_peak == free.allocated_peak
    for r in runs:
        causes = (r.requested, r.rounding, r.segments, r.fragmentation)
        assert sum(causes) == r.reserved_peak and min(causes) >= 0
        assert 0 <= r.other_streams <= r.fragmentation
