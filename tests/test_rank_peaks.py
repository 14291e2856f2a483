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
import subprocess
import sys
import textwrap
from pathlib import Path

from ampscope.cli import main
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import DistributedReport, RankPeak, RankReport
from ampscope.distributed.verdicts import verdicts
from ampscope.hardware import by_name, with_figures

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
        # the caching allocator's replay over the rank's storages holds at least those blocks
        assert peak["reserved_bytes"] >= peak["rounded_bytes"]
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


# Built in a fresh interpreter: the verdicts are the report's own, made with no view imported.
_REPORT_WITHOUT_VIEWS = """
import json, sys
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import DistributedReport, RankPeak, RankReport
from ampscope.distributed.verdicts import verdicts
from ampscope.hardware import H100
from ampscope.records import UNKNOWN_SETTING

GiB = 2**30
ranks = [RankReport(0, {}, [], RankPeak(90 * GiB, None, "backward", {})),
         RankReport(1, {}, [], RankPeak(70 * GiB, None, "optimizer", {}))]
report = DistributedReport("m", 0, UNKNOWN_SETTING, Parallel("fsdp", 2), "fake", "predict", ranks)
report.notes += verdicts(report, H100)
print(json.dumps({"notes": report.to_dict()["notes"],
                  "views": sorted(m for m in sys.modules if m.startswith("ampscope.render"))}))
"""


def test_the_verdicts_are_notes_of_the_report_made_without_a_view():
    """An H100 holds 80 GiB (its datasheet): a rank peaking at 90 GiB is 10 GiB over, one at
    70 GiB has 10 GiB to spare; the report's JSON says so with no render module imported."""
    result = subprocess.run([sys.executable, "-c", _REPORT_WITHOUT_VIEWS], capture_output=True,
                            text=True, check=True)
    answer = json.loads(result.stdout)
    assert answer["views"] == []
    on_top = ("(the steps' own storages; the CUDA context, NCCL's buffers and the allocator's "
              "reserve come on top).")
    assert answer["notes"] == [
        f"Rank 0: peak 90 GiB of NVIDIA H100 SXM5 80GB's 80 GiB: does not fit: 10 GiB over {on_top}",
        f"Rank 1: peak 70 GiB of NVIDIA H100 SXM5 80GB's 80 GiB: fits, 10 GiB to spare {on_top}",
    ]


def test_the_page_shows_the_verdicts_the_json_has(tmp_path, capsys):
    """`--gpu` adds the verdicts to the report itself, so the HTML page written before the
    terminal view shows the same notes as the JSON (a few KiB per rank fit in 80 GiB)."""
    import html

    from tests.test_html_ranks import FREE_FSDP2

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FREE_FSDP2))
    page, out = tmp_path / "ranks.html", tmp_path / "ranks.json"
    code = main(["run", "--nproc", "2", "--predict", "--device", "cuda", "--quiet", "--gpu",
                 "h100", "--json", str(out), "--report", str(page), str(script), "cuda"])
    assert code == 0, capsys.readouterr().err
    fits = [n for n in json.loads(out.read_text())["notes"] if " 80 GiB: fits, " in n]
    assert len(fits) == 1 and fits[0].startswith("Ranks 0, 1: peak ")
    assert fits[0] in html.unescape(page.read_text())
