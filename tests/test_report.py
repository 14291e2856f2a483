"""The HTML report and the notebook fragments: sections, inline SVG, no external URL, escaping.

The browser test (tests/test_report_browser.py) opens the same page in headless Chromium.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import ampscope
from ampscope.analysis.compare import build_matrix
from ampscope.analysis.flops import flop_report
from ampscope.analysis.memory import memory_report
from ampscope.analysis.numerics import (
    BlockDivergence,
    CastRange,
    ModuleDivergence,
    NumericsReport,
    SettingNumerics,
    tensor_range,
)
from ampscope.precision import fp8
from ampscope.records import (
    Finding,
    FunctionCall,
    InputRecord,
    ModelInfo,
    ModuleCall,
    OpCall,
    ParameterRecord,
    TensorMeta,
    Trace,
)
from ampscope.render.html import report_html, section_html
from tests.helpers import SETTINGS, divergence, gpt2_tiny_report, setting_record

HEADINGS = ("Findings", "Dtype flow", "Settings matrix", "Memory", "FLOPs by module",
            "Numerics per layer")
LOADING_TAGS = {"script", "link", "iframe", "frame", "object", "embed", "img", "image", "audio",
                "video", "source", "track", "base"}
_LOAD_ATTRIBUTES = {"src", "href", "xlink:href", "srcset", "action", "formaction", "poster",
                    "data", "background", "ping", "manifest"}
_CSS_LOADS = re.compile(r"""url\(\s*["']?\s*(?P<url>[^"')\s]*)|@import\s+(?:url\()?["']?(?P<imp>[^"')\s;]*)""",
                        re.I)


class _Loads(HTMLParser):
    """What a parsed page names to load: attribute targets and CSS url()/@import targets that
    are not a fragment of the page itself (`#id`), and the tags that load by being there."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.targets: list[str] = []
        self.tags: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in LOADING_TAGS:
            self.tags.append(tag)
        for name, value in attrs:
            if name in _LOAD_ATTRIBUTES and value and not value.startswith("#"):
                self.targets.append(value)
            if name == "style" and value:
                self._css(value)
            if tag == "meta" and name == "http-equiv" and (value or "").lower() == "refresh":
                self.targets.append("meta refresh")
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self._css(data)

    def _css(self, css: str) -> None:
        for m in _CSS_LOADS.finditer(css):
            target = m["url"] if m["url"] is not None else m["imp"]
            if not target.startswith("#"):
                self.targets.append(target)


def external_loads(html: str) -> list[str]:
    parser = _Loads()
    parser.feed(html)
    parser.close()
    return parser.targets + [f"<{t}>" for t in parser.tags]


@pytest.fixture(scope="module")
def run() -> dict:
    return gpt2_tiny_report()


def test_report_has_every_section_with_inline_svg(run):
    html = run["html"]
    assert html.startswith("<!DOCTYPE html>")
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in html
    for key in ("findings", "flow", "matrix", "memory", "flops", "numerics"):
        assert f'<section id="{key}">' in html and f'href="#{key}"' in html
    # The flow graphs (one column per setting; the repeated block folds), and the plots of
    # memory (2), FLOPs (one per setting) and numerics (1).
    assert html.count('class="flowgraph"') >= 2 * 3
    assert '<details class="block" open><summary>transformer.h.0–1' in html
    assert html.count("<svg") >= 6 + 2 + 2 + 1
    for setting in SETTINGS:
        assert f"<h3>{setting}</h3>" in html
    # The autocast casts are marked on the amp graph: its linears' notes.
    assert "autocast → bf16: bias, weight, input" in html


def test_report_loads_nothing(run):
    html = run["html"]
    assert external_loads(html) == []
    assert "http://" not in html and "https://" not in html
    assert "default-src 'none'" in html  # the browser refuses any load besides


@pytest.mark.fast
def test_the_url_check_sees_loads():
    page = ('<img src="https://cdn.example/x.png"><link href="http://a/b.css">'
            '<style>@import "x.css"; p { background: url( "//host/y.png") }</style>'
            '<a href="#flow"></a><use xlink:href="#m1"/><rect clip-path="url(#p1)"/>')
    assert external_loads(page) == ["https://cdn.example/x.png", "http://a/b.css", "x.css",
                                    "//host/y.png", "<img>", "<link>"]


def test_report_is_the_same_every_time(run):
    again = report_html(run["traces"], run["matrix"],
                        reports=[*run["memory"], *run["flops"], run["numerics"]])
    assert again == run["html"]


def test_optional_sections_are_left_out(run):
    html = report_html(run["traces"][:1], build_matrix(run["traces"][:1]))
    for heading in HEADINGS[:3]:
        assert f"<h2>{heading}</h2>" in html
    for heading in HEADINGS[3:]:
        assert f"<h2>{heading}</h2>" not in html
    with pytest.raises(ValueError):
        report_html([], run["matrix"])


def test_plots_leave_matplotlib_state_alone(run):
    import matplotlib

    backend = matplotlib.get_backend()
    run["flops"][0]._repr_html_()
    assert matplotlib.get_backend() == backend
    if "matplotlib.pyplot" in sys.modules:  # imported by someone else: still no figure of ours
        assert sys.modules["matplotlib.pyplot"].get_fignums() == []


@pytest.mark.parametrize("key, heading", [("traces", "Findings"), ("matrix", "Settings matrix"),
                                          ("flops", "FLOPs by module"),
                                          ("numerics", "Numerics per layer")])
def test_repr_html_is_a_fragment(run, key, heading):
    obj = run[key][-1] if isinstance(run[key], list) else run[key]
    html = obj._repr_html_()
    assert html.startswith('<div class="ampscope"><style>') and html.endswith("</div>")
    assert f"<h2>{heading}</h2>" in html
    assert not re.search(r"<(!DOCTYPE|html|head|body)\b", html, re.I)
    assert external_loads(html) == []


def test_trace_fragment_has_tensors_findings_and_flow(run):
    html = run["traces"][1]._repr_html_()
    for heading in ("Tensors by dtype", "Findings", "Dtype flow"):
        assert f"<h2>{heading}</h2>" in html
    assert 'class="flowgraph"' in html


def test_memory_fragment(run):
    html = section_html(run["memory"][0])
    assert html.startswith('<div class="ampscope">') and "<h2>Memory</h2>" in html
    assert html.count("<svg") == 2


# --- escaping ---------------------------------------------------------------------------------

SCRIPT = '<script>alert("x")</script>'
IMG = '<img src=x onerror="alert(1)">'


class _Markup(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.handlers: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.handlers += [f"{tag} {name}" for name, _ in attrs if name.startswith("on")]


def assert_inert(html: str) -> None:
    """Nothing from the model became markup: the parsed page has no script or img element and
    no event handler attribute, and loads nothing."""
    parser = _Markup()
    parser.feed(html)
    assert not parser.tags & {"script", "img"}
    assert parser.handlers == []
    assert external_loads(html) == []


class _Text(HTMLParser):
    """The text a browser shows or keeps from a page: character data and attribute values,
    with every character reference decoded."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.parts += [value for _, value in attrs if value]


def page_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    parser.close()
    return "\n".join(parser.parts)


def test_module_and_class_names_are_escaped():
    """A model whose submodule is registered as `<script>…` and whose class is named `<img …>`."""

    def init(self):
        nn.Module.__init__(self)
        self.add_module(SCRIPT, nn.Linear(4, 4))

    evil = type(IMG, (nn.Module,), {
        "__init__": init,
        "forward": lambda self, x: getattr(self, SCRIPT)(x).float().sum(),
    })()
    matrix, traces = ampscope.matrix(evil, torch.randn(2, 4), settings=SETTINGS,
                                     workload="forward")
    html = report_html(traces, matrix, reports=[memory_report(t) for t in traces])
    assert_inert(html)
    assert SCRIPT in page_text(html) and IMG in page_text(html)  # it is shown, as text
    for fragment in (traces[1]._repr_html_(), matrix._repr_html_()):
        assert_inert(fragment)
        assert "&lt;script&gt;" in fragment


def test_every_text_from_records_is_escaped():
    """Model, class, setting, module, parameter and source names and finding text, by hand."""
    f32, bf16 = TensorMeta("float32", (2, 4)), TensorMeta("bfloat16", (2, 4))
    name = f"h.0.{SCRIPT}"
    trace = Trace(
        model=ModelInfo(IMG, IMG, 16),
        setting=setting_record(f"fp32+amp-bf16{IMG}"),
        workload="forward",
        modules=[ModuleCall(0, "", IMG, "forward", 0, (f32,), (bf16,)),
                 ModuleCall(1, name, SCRIPT, "forward", 1, (f32,), (bf16,))],
        calls=[FunctionCall(0, "torch.nn.functional.linear", name, "forward", (f32, f32), (bf16,),
                            f"{SCRIPT}.py:1", "bfloat16", 1)],
        ops=[OpCall(0, "aten._to_copy.default", name, "forward", (f32,), (bf16,), True, 0,
                    None, (f"{name}.weight",)),
             OpCall(1, "aten.mm.default", name, "forward", (bf16, bf16), (bf16,), False, 0,
                    f"{SCRIPT}.py:1", (None, None), flops=64, flops_causal=64)],
        parameters=[ParameterRecord(f"{name}.weight", "float32", (4, 4), True, None)],
        inputs=[InputRecord(IMG, "input", "float32", (2, 4))],
        outputs=[InputRecord(SCRIPT, "output", "bfloat16", (2, 4))],
        findings=[Finding(f"{SCRIPT} then {IMG}", SCRIPT, f"{IMG}.py:3")],
        notes=[f"note {SCRIPT}"],
    )
    flops = flop_report(trace, tokens=2)
    numerics = NumericsReport(IMG, SCRIPT, "fp64", [SettingNumerics(
        IMG, [ModuleDivergence(name, SCRIPT, 1, divergence(1e-3))],
        [BlockDivergence(SCRIPT, 0, divergence(1e-3))], None, [],
        [CastRange(name, "forward", "input", "float8_e4m3fn", "tensorwise", 1, 8, 8, 0, 1)])],
        [tensor_range("activation", SCRIPT, torch.tensor([1e6]))])
    html = report_html([trace], build_matrix([trace]),
                       reports=[memory_report(trace), flops, numerics], title=SCRIPT)
    assert_inert(html)
    assert html.count("&lt;script&gt;") >= 9
    for fragment in (trace._repr_html_(), flops._repr_html_(), numerics._repr_html_()):
        assert_inert(fragment)


EVIL_MODEL = """
from torch import nn

PAYLOAD = "PAYLOAD"


def build():
    def init(self):
        nn.Module.__init__(self)
        self.add_module(PAYLOAD, nn.Linear(4, 4))

    cls = type(PAYLOAD, (nn.Module,), {
        "__init__": init,
        "forward": lambda self, x: getattr(self, PAYLOAD)(x).bfloat16().float().sum(),
    })
    return cls()
""".replace('"PAYLOAD"', repr(SCRIPT))


def test_a_script_payload_is_escaped_everywhere_it_appears(tmp_path):
    """A module and a class named `<script>…`, defined in a file named `m<script>.py`: each
    shows up as text in every section that names it, and never once as markup."""
    import importlib.util

    path = tmp_path / "m<script>.py"
    path.write_text(EVIL_MODEL)
    spec = importlib.util.spec_from_file_location("evil_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    matrix, traces = ampscope.matrix(module.build(), torch.randn(2, 4), settings=SETTINGS,
                                     workload="forward")
    assert len(traces) == 2 and any(o.source == "m<script>.py:14" for o in traces[1].ops)
    html = report_html(traces, matrix, reports=[*(memory_report(t) for t in traces),
                                                *(flop_report(t, tokens=2) for t in traces)])
    pages = [html, traces[1]._repr_html_(), matrix._repr_html_()]
    for page in pages:
        assert_inert(page)
        assert "<script" not in page.lower()
        # Every "<script>" the page shows is one escaped in its source, and the other way round.
        assert page_text(page).count("<script>") == page.count("&lt;script&gt;") > 0
    sections = dict(re.findall(r'<section id="(\w+)">(.*?)</section>', html, re.S))
    head = html[:html.index("<nav>")]
    assert SCRIPT in page_text(head)  # the class, in the header
    assert SCRIPT in page_text(sections["matrix"])  # the module and its type
    assert SCRIPT in page_text(sections["flow"])  # the module, on its step and in its tooltip
    findings = page_text(sections["findings"])
    assert SCRIPT in findings and "m<script>.py:14" in findings  # the module and the file


@pytest.mark.fast
def test_the_templates_ship_with_the_package():
    """Every template the report renders is package data of the wheel (pyproject.toml)."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["ampscope"]
    package = root / "src" / "ampscope"
    shipped = {p for g in globs for p in package.glob(g)}
    templates = set((package / "render" / "templates").iterdir())
    assert templates and templates <= shipped


# --- fp8 casts in the numerics section ---------------------------------------------------------

needs_torchao = pytest.mark.skipif(not fp8.available(), reason="torchao is not installed")
FP8_SETTINGS = ["fp32+amp-bf16+fp8-tensorwise", "fp32+amp-bf16+fp8-rowwise"]


class _Tables(HTMLParser):
    """The rows of each table with a class attribute, by class: each cell as (text, title)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, list[list[tuple[str, str | None]]]] = {}
        self._rows: list | None = None
        self._cell: list | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table" and a.get("class"):
            self._rows = self.tables.setdefault(a["class"], [])
        elif tag == "tbody" and self._rows is not None:
            self._rows.clear()  # the header rows are not data
        elif tag == "tr" and self._rows is not None:
            self._rows.append([])
        elif tag == "td" and self._rows is not None:
            self._cell = ["", a.get("title")]

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self._rows[-1].append((self._cell[0], self._cell[1]))
            self._cell = None
        elif tag == "table":
            self._rows = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell[0] += data


def tables(html: str) -> dict[str, list[list[tuple[str, str | None]]]]:
    parser = _Tables()
    parser.feed(html)
    parser.close()
    return parser.tables


@pytest.fixture(scope="module")
def fp8_numerics() -> NumericsReport:
    return ampscope.numerics("gpt2-tiny", settings=FP8_SETTINGS, seq=16, workload="train")


@needs_torchao
def test_the_numerics_section_shows_each_fp8_cast_as_the_numerics_record_holds_it(fp8_numerics):
    """The page (`ampscope report --numerics`) and the notebook view of the report show the
    same figures, each one that of `SettingNumerics.fp8_casts` in the same run."""
    report = fp8_numerics
    assert [s.setting for s in report.settings] == FP8_SETTINGS
    matrix, traces = ampscope.matrix("gpt2-tiny", settings=FP8_SETTINGS, seq=16)
    page = report_html(traces, matrix, reports=[report])
    section = re.search(r'<section id="numerics">.*?</section>', page, re.S)[0]
    fragment = report._repr_html_()
    assert section in fragment  # the notebook shows the same section
    found = tables(section)

    # per setting: casts, scales, non-zero values, saturated and underflowed (count, share)
    expected = []
    for s in report.settings:
        casts = s.fp8_casts
        nonzero = sum(c.nonzero for c in casts)
        sat, under = sum(c.saturated for c in casts), sum(c.underflow for c in casts)
        expected.append([s.setting, f"{sum(c.casts for c in casts):,}",
                         "/".join(sorted({c.granularity for c in casts})), f"{nonzero:,}",
                         f"{sat:,} ({100 * sat / nonzero:.3f}%)",
                         f"{under:,} ({100 * under / nonzero:.3f}%)"])
    assert [[text for text, _ in row] for row in found["fp8-totals"]] == expected
    assert [row[2] for row in expected] == ["tensorwise", "rowwise"]

    # per cast that lost a value in some setting: layer, phase, operand, then per setting its
    # format, scales and shares (the counts in the tooltip)
    records = [{(c.module, c.phase, c.role): c for c in s.fp8_casts} for s in report.settings]
    lossy = {k for rows in records for k, c in rows.items() if c.saturated or c.underflow}
    assert 0 < len(lossy) <= 12  # all of them are shown
    assert f"{len(lossy)} of {len(set().union(*records))} by layer" in section
    rows = found["fp8-lossy"]
    assert {(r[0][0], r[1][0], r[2][0]) for r in rows} == lossy
    for row in rows:
        key = (row[0][0], row[1][0], row[2][0])
        for rows_of, cells in zip(records, (row[3:7], row[7:11]), strict=True):
            c = rows_of[key]
            short = {"float8_e4m3fn": "fp8e4m3", "float8_e5m2": "fp8e5m2"}[c.dtype]
            assert cells == [
                (short, None), (c.granularity, None),
                (f"{100 * c.saturated / c.nonzero:.2f}%",
                 f"{c.saturated:,} of {c.nonzero:,} non-zero values"),
                (f"{100 * c.underflow / c.nonzero:.2f}%",
                 f"{c.underflow:,} of {c.nonzero:,} non-zero values")]


@needs_torchao
def test_the_fp8_section_only_for_settings_with_fp8_casts(run):
    """Absent without fp8; with one fp8 setting beside one without, only the fp8 one has a row;
    a run whose casts lost nothing says so and has no table of casts."""
    for html in (run["html"], run["numerics"]._repr_html_()):
        assert "fp8 casts" not in html and "fp8-totals" not in html
    plain = ampscope.numerics("gpt2-tiny", settings=["fp32+amp-bf16"], seq=16, workload="train")
    assert plain.settings[0].fp8_casts == []
    assert "fp8-totals" not in plain._repr_html_()
    if not fp8.available():
        return
    mixed = ampscope.numerics("gpt2-tiny", settings=["fp32+amp-bf16", FP8_SETTINGS[1]], seq=16,
                              workload="train")
    totals = tables(mixed._repr_html_())["fp8-totals"]
    assert [row[0][0] for row in totals] == [FP8_SETTINGS[1]]
    # tests/test_fp8_numerics.py's hand-computed case: rowwise scales lose nothing here
    from tests.test_fp8_numerics import N, outliers

    model = nn.Sequential(nn.Linear(N, N, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(N))
    clean = ampscope.numerics(model, outliers(), settings=["fp32+fp8-rowwise"], reference="fp32")
    assert clean.settings[0].fp8_casts
    assert not any(c.saturated or c.underflow for c in clean.settings[0].fp8_casts)
    html = clean._repr_html_()
    assert "fp8-totals" in html and "fp8-lossy" not in html
    assert "No cast saturated or underflowed a value." in html
