"""Each rank's memory peak under `ampscope run --nproc N`: real gloo ranks and predicted ranks
(fake tensors, PyTorch's fake process group) give the same peak to the byte, and what is live
at it is each rank's own shard (examples/distributed/train.py, FSDP2 with bf16 gathers).

By hand, at tp = 1, dp = 2: a block holds 4·64·64 (q, k, v, o) + 2·256·64 (up, down) + 2·64
(its RMSNorms) = 49,280 elements, the root 256·64 + 64 + 256·64 = 32,832; each rank keeps half
of 2·49,280 + 32,832 = 131,392, i.e. 65,696 float32 elements (262,784 B) of parameters and as
many of gradients, and AdamW's two moments of them plus a 4-byte step for each of the 19
parameters (525,644 B)."""

from __future__ import annotations

import json
from pathlib import Path

from ampscope.cli import main
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import DistributedReport, RankPeak, RankReport
from ampscope.hardware import by_name, with_figures
from ampscope.render.ranks import verdicts

EXAMPLE = Path(__file__).parent.parent / "examples" / "distributed" / "train.py"
SHARD = 65_696 * 4
STATE = 2 * SHARD + 19 * 4


def _ranks(tmp_path, capsys, *options) -> tuple[list[dict], str]:
    out = tmp_path / f"ranks{len(list(tmp_path.iterdir()))}.json"
    code = main(["run", "--nproc", "2", "--device", "cuda", "--quiet", "--json", str(out),
                 *options, str(EXAMPLE), "--steps=2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(out.read_text())["ranks"], captured.out


def test_real_and_predicted_ranks_peak_alike_with_their_own_shards(tmp_path, capsys):
    real, _ = _ranks(tmp_path, capsys)
    predicted, text = _ranks(tmp_path, capsys, "--predict", "--gpu", "h100")
    assert [r["peak"] for r in real] == [r["peak"] for r in predicted]
    for rank in real:
        peak = rank["peak"]
        # the step's second optimizer step: every state made, every gradient reduced
        assert peak["phase"] == "optimizer"
        assert peak["live"]["parameter"] == {"float32": SHARD}
        assert peak["live"]["gradient"] == {"float32": SHARD}
        assert peak["live"]["optimizer_state"] == {"float32": STATE}
        assert peak["rounded_bytes"] >= peak["bytes"] > SHARD * 2 + STATE
    # --gpu holds each rank's peak against the GPU's memory
    assert "Ranks 0, 1: peak" in " ".join(text.split()) and "fits" in text


def test_a_peak_over_the_gpus_memory_does_not_fit():
    def rank(k: int, peak: int) -> RankReport:
        return RankReport(k, {}, [], RankPeak(peak - 100, peak, "backward", {}))

    report = DistributedReport("m", 0, None, Parallel("fsdp", 3), "fake", "predict",  # type: ignore[arg-type]
                               [rank(0, 2048), rank(1, 1024), rank(2, 2048)])
    small = with_figures(by_name("h100"), memory_bytes=1536)
    lines = verdicts(report, small)
    assert len(lines) == 2  # ranks 0 and 2 share their peak, rank 1 has its own
    assert lines[0].startswith("Ranks 0, 2: peak 2 KiB") and "does not fit: 512 B over" in lines[0]
    assert lines[1].startswith("Rank 1: peak 1 KiB") and "fits, 512 B to spare" in lines[1]
    assert verdicts(report, None) == []
