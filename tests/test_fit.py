"""`ampscope fit`: the batch it finds fits and the next does not (checked with the predicted
memory API itself), every probe is printed, each variant's figures are its own predicted runs,
and bad input is one line and exit 2. All on gpt2-tiny under emulated CUDA: seconds, no GPU."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import ampscope
from ampscope.analysis.fit import Point, extrapolated, largest, parse_bytes
from ampscope.api.fit import fit
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.models import registry
from ampscope.models.registry import resolve
from ampscope.render.style import format_bytes
from ampscope.workloads import MAX_SIZE, repeated_blocks

api_fit = importlib.import_module("ampscope.api.fit")  # ampscope.api.fit is also the function
MODEL, SETTING, SEQ = "gpt2-tiny", "cuda:fp32+amp-bf16", 32
BUDGET = 6 * 2**20


def peaks(batch: int, seq: int = SEQ, setting: str = SETTING, **options) -> tuple[int, int]:
    """The ground truth: the predicted memory API's allocated peak in CUDA allocator blocks,
    and its caching allocator's reserved peak."""
    report = ampscope.memory(MODEL, setting=setting, batch=batch, seq=seq, predict=True,
                             **options)
    assert report.peak.rounded_bytes is not None and report.reserved is not None
    return report.peak.rounded_bytes, report.reserved.reserved_peak


def peak(batch: int, seq: int = SEQ, setting: str = SETTING, **options) -> int:
    """The peak fit holds to the budget on a CUDA setting: the reserved one."""
    return peaks(batch, seq, setting, **options)[1]


@pytest.fixture(scope="module")
def found():
    return fit(MODEL, memory_size=BUDGET, setting=SETTING, seq=SEQ)


def test_the_batch_found_fits_and_the_next_does_not(found):
    assert 1 < found.batch < 32  # a small batch: the budget was chosen so
    allocated, reserved = peaks(found.batch)
    assert found.peak_bytes == allocated and found.reserved_bytes == reserved <= BUDGET
    assert found.held == "reserved" and found.margin_bytes == BUDGET - reserved
    assert peak(found.batch + 1) > BUDGET
    document = found.to_dict()
    assert (document["held"], document["margin_bytes"]) == ("reserved", BUDGET - reserved)
    assert found.memory_bytes == BUDGET and found.memory_source == "--memory"


def test_what_is_live_at_the_limit_adds_up_to_the_peak(found):
    report = ampscope.memory(MODEL, setting=SETTING, batch=found.batch, seq=SEQ, predict=True)
    assert sum(s.bytes for s in found.at_limit) == sum(r.bytes for r in report.at_peak)
    assert [s.bytes for s in found.at_limit] == sorted((s.bytes for s in found.at_limit),
                                                       reverse=True)
    assert abs(sum(s.fraction for s in found.at_limit) - 1) < 1e-9


def test_each_variant_is_its_own_predicted_run(found):
    by_name = {v.name: v for v in found.variants}
    assert set(by_name) == {"bf16 weights", "checkpointing", "fused optimizer"}
    runs = {"bf16 weights": {"setting": "cuda:bf16"}, "checkpointing": {"checkpoint": True},
            "fused optimizer": {"optimizer_impl": "fused"}}
    for name, options in runs.items():
        variant = by_name[name]
        assert variant.peak_at_limit == peak(found.batch, **options)
        assert variant.saved_bytes == found.reserved_bytes - variant.peak_at_limit
    # Checkpointing keeps only each block's input for backward: it buys a larger batch here,
    # and that batch is again the largest. (At the batch found its allocated peak is lower; the
    # reserved one, in 2 MiB segments at this size, may be the same.)
    ckpt = by_name["checkpointing"]
    assert peaks(found.batch, checkpoint=True)[0] < found.peak_bytes
    assert ckpt.saved_bytes >= 0 and ckpt.batch > found.batch
    assert ckpt.peak_bytes == peak(ckpt.batch, checkpoint=True) <= BUDGET
    assert peak(ckpt.batch + 1, checkpoint=True) > BUDGET


def test_probes_bracket_the_answer(found):
    given = [p for p in found.probes if p.variant == "as given"]
    assert any(p.batch == found.batch and p.fits for p in given)
    assert any(p.batch == found.batch + 1 and not p.fits for p in given)
    # Every probe's reserved peak is its own allocator replay, and decides whether it fits.
    for p in given:
        assert (p.peak_bytes, p.reserved_bytes) == peaks(p.batch)
        assert p.fits == (p.reserved_bytes <= BUDGET)
    # Two to guess from, the guess and the batch after it, and a third guess for a miss: the
    # guess extrapolates live bytes, and the reserved peak held to the budget moves in whole
    # segments (2 MiB, 20 MiB) that no line predicts.
    assert len(given) <= 6


def test_where_the_allocated_peak_fits_and_the_reserved_does_not_the_batch_is_smaller():
    """A budget equal to batch 16's allocated peak: the allocated rule would take batch 16, but
    its reserved peak is over, so the answer is a smaller batch whose reserved peak fits (the
    next batch's reserved peak over). Off CUDA the same budget holds the allocated peak."""
    allocated, reserved = peaks(16)
    assert allocated < reserved  # the budget lies between the two peaks
    budget = allocated
    report = fit(MODEL, memory_size=budget, setting=SETTING, seq=SEQ, variants=False)
    assert report.held == "reserved" and report.batch < 16
    assert (report.peak_bytes, report.reserved_bytes) == peaks(report.batch)
    assert report.reserved_bytes is not None and report.reserved_bytes <= budget
    assert report.margin_bytes == budget - report.reserved_bytes
    assert peak(report.batch + 1) > budget
    cpu = fit(MODEL, memory_size=budget, setting="cpu:fp32+amp-bf16", seq=SEQ, variants=False)
    assert cpu.held == "allocated" and cpu.reserved_bytes is None
    assert cpu.margin_bytes == budget - cpu.peak_bytes >= 0


def test_seq_auto_finds_the_longest_power_of_two_that_fits():
    # Off CUDA, where the allocated peak is held: gpt2-tiny's reserved peaks at batch 1 are one
    # 4 MiB at seq 32 and 64, so no budget would lie between them.
    setting = "cpu:fp32+amp-bf16"

    def allocated(batch: int, seq: int) -> int:
        return ampscope.memory(MODEL, setting=setting, batch=batch, seq=seq,
                               predict=True).peak.bytes

    context = resolve(MODEL, device="meta").max_seq_len
    budget = (allocated(1, context // 2) + allocated(1, context)) // 2
    report = fit(MODEL, memory_size=budget, setting=setting, seq="auto", variants=False)
    assert report.seq_auto and report.seq == context // 2 and report.held == "allocated"
    assert allocated(report.batch, report.seq) <= budget < allocated(report.batch + 1, report.seq)
    assert not report.variants


def test_the_cli_prints_every_probe_as_it_runs_and_writes_json(capsys, tmp_path):
    path = tmp_path / "fit.json"
    code = main(["fit", MODEL, "--memory", "6MiB", "-s", SETTING, "--seq", str(SEQ),
                 "--no-variants", "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    document = json.loads(path.read_text())
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("batch")]
    assert len(lines) == len(document["probes"]) >= 2
    for line, probe in zip(lines, document["probes"], strict=True):
        assert line.split()[:4] == ["batch", str(probe["batch"]), "seq", str(probe["seq"])]
        assert line.endswith("fits: yes" if probe["fits"] else "fits: no")
    assert f"Largest micro-batch: {document['batch']} at seq {SEQ}" in out
    assert document["variants"] == []


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "h1000"], "unknown accelerator 'h1000'"),
    (["--memory", "0"], "'0' is not a size"),
    (["--memory", "80 furlongs"], "'80 furlongs' is not a size"),
    ([], "give the GPU (--gpu h100"),
    (["--memory", "1MiB"], "does not fit in 1 MiB (--memory) under cuda:fp32+amp-bf16 even at "
                           "batch 1"),
    (["--memory", "1GiB", "--seq", "many"], "--seq takes a number of tokens or auto"),
    (["--memory", "1GiB", "--seq", "100000"], "exceeds gpt2-tiny's context length"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code = main(["fit", MODEL, "-s", SETTING, *argv])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and message in err, err


def test_a_budget_beyond_any_batch_stops_at_the_ceiling_and_says_so(capsys, tmp_path,
                                                                    monkeypatch):
    """--memory 1e30 once extrapolated to batch 1,393,083,618,451,113,937,362,257 and was
    refused quoting it; the search now stops at the largest batch it probes."""
    # 64M "free": ids at most half of it, 32 MiB, i.e. 32 MiB / (16 bytes × 32 tokens)
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", "64M")
    limit = 2**25 // (16 * SEQ)
    path = tmp_path / "fit.json"
    code = main(["fit", MODEL, "--memory", "1e30", "-s", SETTING, "--seq", str(SEQ),
                 "--no-variants", "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 0 and err == f"Wrote {path}\n", err  # no error, no warning
    document = json.loads(path.read_text())
    assert document["batch"] == document["batch_limit"] == limit == 65_536
    assert max(p["batch"] for p in document["probes"]) == limit
    assert all(p["fits"] for p in document["probes"])
    assert (document["peak_bytes"], document["reserved_bytes"]) == peaks(limit)
    text = " ".join(out.split())
    assert f"Every micro-batch up to {limit:,} fits at seq {SEQ} for {MODEL}" in text
    assert (f"as given: every batch up to {limit:,} fits in {format_bytes(10**30)}; fit probes "
            "no larger batch: a larger one's token ids, made for real even in a predicted run, "
            "would take more than 32 MiB (half the memory free here)") in text
    assert "Largest micro-batch" not in text and "must be at most" not in text


def test_each_variant_stops_at_the_ceiling_too(monkeypatch):
    monkeypatch.setenv("AMPSCOPE_MEMORY_LIMIT", "64M")
    report = fit(MODEL, memory_size=10**30, setting=SETTING, seq=SEQ, max_probes=4)
    assert report.batch == report.batch_limit == 65_536 and report.at_batch_limit
    assert {v.batch for v in report.variants} == {report.batch}
    assert max(p.batch for p in report.probes) == report.batch
    assert report.notes[0].startswith("as given, bf16 weights, checkpointing, fused optimizer: "
                                      "every batch up to 65,536 fits")
    assert not any("stopped after" in n for n in report.notes)


@pytest.mark.parametrize("free, limit, why", [
    (None, 2**30 // (16 * 64), "a larger one's token ids, made for real even in a predicted "
                               "run, would take more than 1 GiB"),
    (2**40, 2**30 // (16 * 64), "a larger one's token ids, made for real even in a predicted "
                                "run, would take more than 1 GiB"),
    (2**30, 2**29 // (16 * 64), "a larger one's token ids, made for real even in a predicted "
                                "run, would take more than 512 MiB (half the memory free here)"),
    (10, 1, "a larger one's token ids, made for real even in a predicted run, would take more "
            "than 5 B (half the memory free here)"),
])
def test_the_ceiling_is_1_gib_of_ids_or_half_the_free_memory(monkeypatch, free, limit, why):
    monkeypatch.setattr(registry, "available_memory_bytes", lambda: free)
    assert api_fit._batch_limit(64) == (limit, why)


def test_the_ceiling_is_never_above_the_largest_batch_a_run_takes(monkeypatch):
    monkeypatch.setattr(registry, "available_memory_bytes", lambda: None)
    monkeypatch.setattr(api_fit, "_IDS_BUDGET", 2**62)
    assert api_fit._batch_limit(1) == (MAX_SIZE, "ampscope runs no batch over 2,147,483,647")


def test_a_gpu_sets_the_budget_and_puts_a_bare_setting_on_cuda():
    report = fit(MODEL, gpu="a100-40gb", setting="bf16", seq=SEQ, variants=False, max_probes=3)
    assert report.memory_bytes == 40 * 2**30 and report.accelerator == "a100-40gb"
    assert report.setting == "cuda:bf16"
    assert any("stopped after 3 probes" in n for n in report.notes)  # 40 GiB: a huge batch


def test_with_a_gpu_the_answer_is_timed_and_its_reserved_peak_replayed(capsys):
    """The answer's step on the GPU is step_time over the same predicted run (trace), its
    tokens/s batch × seq over it; the reserved peak is the memory report's allocator replay.
    Without --gpu: no time; off CUDA: no reserved peak."""
    from ampscope import hardware
    from ampscope.analysis.step_time import step_time

    report = fit(MODEL, gpu="h100", memory_size=BUDGET, setting=SETTING, seq=SEQ,
                 variants=False)
    t = step_time(ampscope.trace(MODEL, setting=SETTING, batch=report.batch, seq=SEQ,
                                 predict=True), hardware.by_name("h100"))
    assert report.step_seconds == t.seconds > 0 and report.mfu == t.mfu
    assert report.tokens_per_second == pytest.approx(report.batch * SEQ / t.seconds, rel=1e-12)
    assert report.bound == max(t.by_bound, key=t.by_bound.__getitem__)
    memory = ampscope.memory(MODEL, setting=SETTING, batch=report.batch, seq=SEQ, predict=True)
    assert memory.reserved is not None
    assert report.reserved_bytes == memory.reserved.reserved_peak >= report.peak_bytes
    assert report.reserved_bytes <= BUDGET  # the reserved peak is the one held to the budget
    document = report.to_dict()
    assert document["step_seconds"] == t.seconds
    assert document["reserved_bytes"] == report.reserved_bytes
    plain = fit(MODEL, memory_size=BUDGET, setting="cpu:fp32", seq=SEQ, variants=False)
    assert plain.step_seconds is None and plain.reserved_bytes is None
    code = main(["fit", MODEL, "--gpu", "h100", "--memory", "6MiB", "-s", SETTING, "--seq",
                 str(SEQ), "--no-variants"])
    out = " ".join(capsys.readouterr().out.split())  # as words: the line wraps
    assert code == 0
    assert (f"At batch {report.batch}: predicted step " in out and " on h100, " in out
            and f"{format_bytes(report.reserved_bytes)} reserved by the caching allocator" in out
            and f"{format_bytes(report.margin_bytes)} under the 6 MiB budget" in out)


# -- the search, on synthetic steps -----------------------------------------------------------

OPS = ["aten.embedding", "aten.mm", "aten.gelu", "aten.mm"]


def _step(batch: int, *, quadratic: bool = False) -> list[int]:
    """Live bytes of a made-up step: weights, then activations growing with the batch."""
    grow = batch * batch if quadratic else batch
    return [100, 100 + 10 * grow, 100 + 25 * grow, 100 + 5 * grow]


@pytest.mark.fast
@pytest.mark.parametrize("budget", [125, 126, 349, 350, 5000, 10**6])
@pytest.mark.parametrize("quadratic", [False, True])
def test_largest_brackets_the_answer(budget, quadratic):
    seen = []

    def probe(n: int) -> Point:
        seen.append(n)
        live = _step(n, quadratic=quadratic)
        return Point(n, max(live) <= budget, live, OPS, ["forward"] * len(live))

    truth = max((n for n in range(1, 50_000) if max(_step(n, quadratic=quadratic)) <= budget),
                default=None)
    batch, closed = largest(probe, budget, max_probes=40)
    assert closed and batch == truth
    assert len(seen) == len(set(seen))  # no batch probed twice
    if not quadratic and truth is not None and truth > 1:
        assert len(seen) <= 4  # 1, 2, the guess, the batch after it


@pytest.mark.parametrize("budget, expected", [(10**30, 1000), (350, 10), (100 + 25 * 1000, 1000),
                                              (100 + 25 * 1001, 1000), (100 + 25 * 999, 999)])
def test_largest_probes_nothing_above_its_limit(budget, expected):
    seen = []

    def probe(n: int) -> Point:
        seen.append(n)
        live = _step(n)
        return Point(n, max(live) <= budget, live, OPS, ["forward"] * len(live))

    assert largest(probe, budget, limit=1000, max_probes=40) == (expected, True)
    assert max(seen) <= 1000 and len(seen) == len(set(seen))
    assert largest(probe, budget, start=5000, limit=1000, max_probes=40) == (expected, True)


def test_extrapolated_is_exact_for_affine_steps_and_bounded_otherwise():
    a = Point(1, True, _step(1), OPS, ["forward"] * 4)
    b = Point(2, True, _step(2), OPS, ["forward"] * 4)
    assert extrapolated(a, b, 350) == 10  # 100 + 25·10 = 350
    # An op inserted at batch 2: the ops both ran are lined up, the same answer.
    inserted = [*_step(2)[:2], 10**6, *_step(2)[2:]]
    c = Point(2, True, inserted, [*OPS[:2], "aten.expand", *OPS[2:]], ["forward"] * 5)
    assert extrapolated(a, c, 350) == 10
    # Runs that cannot be lined up: each phase's highest bytes, a line below the convex truth.
    d = Point(2, True, [*_step(2), 0], ["aten.other"] * 5, ["forward"] * 5)
    assert extrapolated(a, d, 350) == 10
    flat = Point(2, True, _step(1), OPS, ["forward"] * 4)
    assert extrapolated(a, flat, 350) is None


@pytest.mark.fast
@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("24576MiB", 24576 * 2**20), ("1.5GiB", 3 * 2**29),
    ("4096", 4096), (" 2 kib ", 2048), (512, 512),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.fast
@pytest.mark.parametrize("text", ["0", "0GiB", -1, "GiB", "80 furlongs", "1e3 XB"])
def test_parse_bytes_refuses(text):
    with pytest.raises(AmpscopeError):
        parse_bytes(text)


def test_parse_bytes_refuses_a_size_past_any_float():
    with pytest.raises(AmpscopeError, match=r"^the memory size '1e400' is too large to be a "
                                            r"number of bytes; write it as e.g. 80GiB$"):
        parse_bytes("1e400")


# -- the workload options the variants run ----------------------------------------------------

def test_checkpointing_recomputes_blocks_and_leaves_them_as_they_were():
    lm = resolve(MODEL)
    blocks = repeated_blocks(lm.module)
    assert len(blocks) == 2
    plain = ampscope.trace(lm, setting="fp32", batch=4, seq=SEQ, predict=True)
    ckpt = ampscope.trace(lm, setting="fp32", batch=4, seq=SEQ, predict=True, checkpoint=True)
    forward = sum(o.phase == "forward" for o in plain.ops)
    # Every block's forward ops run again in backward: more ops, the same forward.
    assert sum(o.phase == "forward" for o in ckpt.ops) == forward
    assert len(ckpt.ops) > len(plain.ops)
    from ampscope.analysis.memory import saved_activation_bytes
    assert saved_activation_bytes(ckpt) < saved_activation_bytes(plain)
    assert all("forward" not in b.__dict__ for b in blocks)


def test_checkpointing_is_refused_outside_a_train_step_and_without_blocks():
    with pytest.raises(AmpscopeError, match="train workload only"):
        ampscope.trace(MODEL, workload="forward", checkpoint=True, predict=True)
    class Net(torch.nn.Module):  # one layer, no ModuleList of blocks
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.lin(x).sum()

    with pytest.raises(AmpscopeError, match="largest ModuleList, and it has none"):
        ampscope.trace(Net(), {"x": torch.randn(2, 4)}, checkpoint=True)


@pytest.mark.parametrize("impl, present, absent", [
    ("fused", "aten._fused_adamw_.default", "aten._foreach_mul_.Scalar"),
    ("foreach", "aten._foreach_mul_.Scalar", "aten._fused_adamw_.default"),
    ("for-loop", "aten.mul_.Tensor", "aten._foreach_mul_.Scalar"),
])
def test_optimizer_impl_picks_the_update(impl, present, absent):
    result = ampscope.trace(MODEL, setting="fp32", seq=8, predict=True, optimizer_impl=impl)
    ops = {o.op for o in result.ops if o.phase == "optimizer"}
    assert present in ops and absent not in ops


def test_optimizer_impl_is_checked():
    with pytest.raises(AmpscopeError, match="unknown optimizer implementation 'turbo'"):
        ampscope.trace(MODEL, optimizer_impl="turbo", predict=True)
