"""The per-rank section ("Ranks") of the HTML report, for `run --nproc N [--predict] --report`
and `trace MODEL --distributed ddp|fsdp --report`.

Most checks render a `DistributedReport` built by hand from its dataclasses: every figure the
page must show is set in the test and its sums are done by hand. Two end-to-end runs hold the
page to the `--json` document of the same run, and to bytes derived by hand from the models'
shapes (as tests/test_run_nproc_predict.py and tests/test_distributed.py derive them).
"""

from __future__ import annotations

import json
import textwrap
from html.parser import HTMLParser

import pytest

from ampscope.cli import main
from ampscope.distributed import report as distributed_report
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import Collective, DistributedReport, RankReport
from ampscope.render.html import ranks_html
from ampscope.render.style import SHORT_DTYPES
from tests.helpers import setting_record
from tests.test_report import SCRIPT, assert_inert, page_text
from tests.test_run_nproc_predict import FREE_FSDP2

Cell = tuple[str, list[str]]  # a cell's text, and the exact byte counts of its figures


class _Rows(HTMLParser):
    """The body rows of each table with a class, by class: (the row's data-rank, its cells),
    each cell its text and the `title`s (exact bytes) of the figures in it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, list[tuple[str | None, list[Cell]]]] = {}
        self._rows: list | None = None
        self._cell: tuple[list[str], list[str]] | None = None
        self._in_body = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table" and a.get("class"):
            self._rows = self.tables.setdefault(a["class"] or "", [])
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._rows is not None and self._in_body:
            self._rows.append((a.get("data-rank"), []))
        elif tag == "td" and self._rows is not None:
            self._cell = ([], [])
        elif tag == "br" and self._cell is not None:
            self._cell[0].append("\n")  # one line per dtype
        elif tag == "span" and self._cell is not None and a.get("title"):
            self._cell[1].append(a["title"] or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._rows is not None:
            self._rows[-1][1].append(("".join(self._cell[0]).strip(), self._cell[1]))
            self._cell = None
        elif tag == "tbody":
            self._in_body = False
        elif tag == "table":
            self._rows = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell[0].append(data)


def rows(html: str) -> dict[str, list[tuple[str | None, list[Cell]]]]:
    parser = _Rows()
    parser.feed(html)
    parser.close()
    return parser.tables


def _b(n: int) -> str:
    return f"{n:,} B"


def _call(index: int, kind: str, phase: str, dtype: str, payload: int, wire: int) -> Collective:
    return Collective(index, "c10d.op", kind, phase, SCRIPT, dtype, payload, wire)


# A rank's memory peak is an optional field of RankReport; the section renders without it.
RankPeak = getattr(distributed_report, "RankPeak", None)
needs_peak = pytest.mark.skipif(RankPeak is None, reason="RankReport has no memory peak")
PEAK = {"bytes": 5000, "rounded_bytes": 5120, "phase": f"backward {SCRIPT}",
        "live": {"activation": {"bfloat16": 3000}, "parameter": {"float32": 400}}}


def _rank(rank: int, held: dict, calls: list[Collective], peak: dict | None) -> RankReport:
    report = RankReport(rank, held, calls)
    if peak is not None and RankPeak is not None:
        report.peak = RankPeak(**peak)
    return report


def _report(peak: dict | None = PEAK) -> DistributedReport:
    """Ranks 0 and 3 of 6 ran (FSDP2, predicted); 1-2 are taken to be rank 0, 4-5 unknown."""
    r0 = _rank(0, {"parameter": {"float32": 400}, "gradient": {"float32": 400},
                   "optimizer_state": {"float32": 800, "int64": 16}},
               [_call(1, "all_gather", "forward", "bfloat16", 200, 100),
                _call(2, "all_gather", "forward", "bfloat16", 300, 150),
                _call(9, "reduce_scatter", "backward", "float32", 1000, 500)], peak)
    r3 = _rank(3, {"parameter": {"float32": 100}}, [], None)
    return DistributedReport(SCRIPT, 58, setting_record(SCRIPT), Parallel("fsdp", 6), "fake",
                             "predict", [r0, r3], notes=[f"a note {SCRIPT}"])


@pytest.mark.fast
def test_each_rank_held_and_collectives_by_hand():
    html = ranks_html(_report(), {1: 0, 2: 0, 4: None, 5: None})
    t = rows(html)
    held = t["ranks-held"]
    # Rank 0: parameter 400, gradient 400, optimizer state 800 + 16, total 1,616 (by hand).
    assert [c[1] for c in held[0][1]] == [[], [_b(400)], [_b(400)], [_b(800), _b(16)],
                                           [_b(1616)]]
    assert held[0][1][3][0].splitlines() == ["800 B fp32", "16 B i64"]
    assert [c[0] for c in held[1][1]] == ["1–2", "not run; taken to be the same as rank 0"]
    assert [c[1] for c in held[2][1]] == [[], [_b(100)], [], [], [_b(100)]]
    assert [c[0] for c in held[3][1]] == ["4–5", "not run; their records are not known"]
    comms = t["ranks-collectives"]
    # Rank 0's two forward all-gathers sum to 200 + 300 = 500 B (wire 250), one row.
    assert [(rank, [c[0] for c in cells[:5]], [c[1] for c in cells[5:]])
            for rank, cells in comms if rank is not None] == [
        ("0", ["0", "all-gather", "forward", "bf16", "2"], [[_b(500)], [_b(250)]]),
        ("0", ["0", "reduce-scatter", "backward", "fp32", "1"], [[_b(1000)], [_b(500)]])]
    total = next(cells for _, cells in comms if cells[1][0] == "total")
    assert total[4][0] == "3" and [c[1] for c in total[5:]] == [[_b(1500)], [_b(750)]]
    assert [cells[-1][0] for _, cells in comms if cells[0][0] == "3"] == ["no collective"]
    text = page_text(html)
    assert "Parameters unsharded (all-gathered) in:" in text and "FSDP on 6 ranks" in text


@needs_peak
@pytest.mark.fast
def test_each_rank_peak_by_hand():
    html = ranks_html(_report(), {1: 0, 2: 0, 4: None, 5: None})
    t = rows(html)
    peak = t["ranks-peak"]
    assert [c[1] for c in peak[0][1]][:3] == [[], [_b(5000)], [_b(5120)]]
    # The live categories as columns, in StorageCategory's order (records/tensors.py):
    # parameter 400 B fp32, activation 3,000 B bf16.
    assert [(c[0].split()[-1], c[1]) for c in peak[0][1][4:]] == [
        ("fp32", [_b(400)]), ("bf16", [_b(3000)])]
    assert [c[0] for c in peak[2][1]] == ["3", "no peak recorded"]
    assert [c[0] for c in peak[1][1]] == ["1–2", "not run; taken to be the same as rank 0"]


@pytest.mark.fast
def test_names_from_the_run_are_escaped_in_the_section():
    """The model, setting, note, module and peak phase all hold a script element: each is
    shown as text, none becomes markup."""
    html = ranks_html(_report(), {1: 0})
    assert_inert(html)
    # The model's name, the setting's, the note, and the peak's phase where there is one.
    assert page_text(html).count(SCRIPT) == 3 + (RankPeak is not None)


@pytest.mark.fast
def test_without_a_peak_or_collectives_those_parts_are_left_out():
    report = _report(peak=None)
    report.ranks = [RankReport(0, {"parameter": {"float32": 232}}),
                    RankReport(1, {"parameter": {"float32": 232}})]
    report.parallel = Parallel("ddp", 2)
    html = ranks_html(report)
    text = page_text(html)
    assert "ranks-peak" not in html and "Memory peak" not in text
    assert "No rank ran a collective." in text and "NONE on 2 ranks" in text
    assert "not run" not in text  # both ranks ran: no row for a rank that did not


def _ampscope(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def _page_facts(html: str) -> dict[int, list[tuple]]:
    """Each rank's collective rows as the page shows them: kind, phase, dtype, calls and the
    exact payload and wire bytes."""
    facts: dict[int, list[tuple]] = {}
    for rank, cells in rows(html)["ranks-collectives"]:
        if rank is not None:
            facts.setdefault(int(rank), []).append(
                (cells[1][0], cells[2][0], cells[3][0], int(cells[4][0]), *(
                    int(c[1][0].removesuffix(" B").replace(",", "")) for c in cells[5:])))
    return facts


def _json_facts(document: dict) -> dict[int, list[tuple]]:
    return {r["rank"]: [(s["kind"].replace("_", "-"), s["phase"],
                         SHORT_DTYPES.get(s["dtype"], s["dtype"]), s["calls"],
                         s["payload_bytes"], s["wire_bytes"]) for s in r["summary"]]
            for r in document["ranks"] if r.get("ran", True)}


def _held_of(html: str) -> dict[int, list[list[str]]]:
    return {int(cells[0][0]): [c[1] for c in cells[1:]]
            for _, cells in rows(html)["ranks-held"] if cells[0][0].isdigit()}


def _json_held(document: dict) -> dict[int, list[list[str]]]:
    return {r["rank"]: [[_b(n) for _, n in sorted(r["held"].get(c, {}).items())]
                        for c in ("parameter", "gradient", "optimizer_state")]
            + [[_b(r["held_total"])]] for r in document["ranks"] if r.get("ran", True)}


def test_run_nproc_predict_report_shows_each_rank_as_its_json(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FREE_FSDP2))
    page, out = tmp_path / "ranks.html", tmp_path / "ranks.json"
    code, err = _ampscope(capsys, "run", "--nproc", "2", "--predict", "--device", "cuda",
                          "--json", str(out), "--report", str(page), str(script), "cuda")
    assert code == 0, err
    document, html = json.loads(out.read_text()), page.read_text()
    assert '<section id="ranks">' in html and '<a href="#ranks">Ranks</a>' in html
    facts = _page_facts(html)
    assert sorted(facts) == [0, 1] and facts == _json_facts(document)
    # By hand: FSDP2 at 2 ranks all-gathers Linear(4, 8) as two 4-row shards of (4·4 + 4)
    # values and Linear(8, 2) as two 1-row shards of (8 + 1), in bf16: (40 + 18) · 2 = 116 B
    # per forward pass, in two calls; a ring sends half of it, 58 B.
    assert ("all-gather", "forward", "bf16", 2, 116, 58) in facts[0]
    assert _held_of(html) == _json_held(document)
    peaks = {cells[0][0]: cells for _, cells in rows(html).get("ranks-peak", [])}
    for r in document["ranks"]:  # the memory peak, where the report has one
        if r.get("peak"):
            cells, peak = peaks[str(r["rank"])], r["peak"]
            # a cuda run: peak, its 512-byte blocks, the allocator replay's reserved peak
            assert [c[1] for c in cells[1:4]] == [[_b(peak["bytes"])], [
                _b(peak["rounded_bytes"])], [_b(peak["reserved_bytes"])]]
            assert peak["reserved_bytes"] >= peak["rounded_bytes"]
            assert cells[4][0] == (peak["phase"] or "—")
            assert sorted(t for c in cells[5:] for t in c[1]) == sorted(
                _b(n) for by_dtype in peak["live"].values() for n in by_dtype.values())


def test_trace_distributed_report_shows_rank_zero_and_the_others_unknown(tmp_path, capsys):
    page, out = tmp_path / "fsdp.html", tmp_path / "fsdp.json"
    code, err = _ampscope(capsys, "trace", "gpt2-tiny", "--distributed", "fsdp", "--nproc", "2",
                          "--predict", "-s", "fp32", "--mp-policy", "param=bf16,reduce=fp32",
                          "--seq", "8", "--json", str(out), "--report", str(page))
    assert code == 0, err
    document, html = json.loads(out.read_text()), page.read_text()
    facts = _page_facts(html)
    assert facts == _json_facts(document) and sorted(facts) == [0]
    # By hand from gpt2-tiny's 136,960 float32 parameters (tests/test_distributed.py checks
    # these against a launched run): every parameter all-gathered once in forward in bf16,
    # every gradient reduce-scattered in fp32; rank 0 holds half of the fp32 parameters.
    params = 136_960
    assert ("all-gather", "forward", "bf16", 3, params * 2, params) in facts[0]
    assert ("reduce-scatter", "backward", "fp32", 3, params * 4, params * 2) in facts[0]
    assert _held_of(html)[0][0] == [_b(params * 4 // 2)] == [_b(
        document["ranks"][0]["held"]["parameter"]["float32"])]
    # Only rank 0 of 2 is predicted: rank 1's records are not claimed.
    assert [c[0] for c in rows(html)["ranks-held"][1][1]] == [
        "1", "not run; its records are not known"]


def test_trace_report_without_distributed_has_no_ranks_section(tmp_path, capsys):
    """`trace --report` on one process writes the usual page; an unwritable path is refused
    in one line before anything runs (cli/checks.py)."""
    page = tmp_path / "one.html"
    code, err = _ampscope(capsys, "trace", "gpt2-tiny", "--seq", "8", "--report", str(page))
    assert code == 0, err
    html = page.read_text()
    assert '<section id="memory">' in html and '<section id="ranks">' not in html
    code, err = _ampscope(capsys, "trace", "gpt2-tiny", "--report", "/nonexistent/x.html")
    assert code == 2 and "cannot write '/nonexistent/x.html'" in err
