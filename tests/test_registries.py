"""The report registry (render/report_kinds.py) and the export registry (cli/exports.py): every
registered report has its JSON Schema, its docs section and its public function; a report
registered in a test, and nothing else, gets its public name (`ampscope.NAME`), its command with
its own arguments and examples, its JSON, its view, its notebook view and its section of the
HTML page; every command takes exactly the exports registered for it."""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from markupsafe import Markup

import ampscope
import ampscope.api
from ampscope import schemas
from ampscope.cli import _parser, main
from ampscope.cli.exports import EXPORTS
from ampscope.render.report_kinds import REPORTS, ReportKind, kind_of, register_report

ROOT = Path(__file__).parent.parent


@pytest.mark.fast
@pytest.mark.parametrize("name", list(REPORTS))
def test_every_registered_report_has_its_schema_and_docs_section(name):
    kind = REPORTS[name]
    assert name in schemas.names(), f"no src/ampscope/schemas/{name}.schema.json"
    assert f"## `ampscope.{name}/1`" in (ROOT / "docs" / "json-schema.md").read_text(), \
        f"docs/json-schema.md has no section for ampscope.{name}/1"
    cls = kind.load("report")
    documented = {importlib.import_module(cls.__module__).SCHEMA, schemas.load(name)["$id"]}
    assert documented == {f"ampscope.{name}/1"}
    assert callable(cls.to_dict) and callable(kind.load("view"))
    assert kind.table is None or callable(cls.table)
    assert kind.section is None or callable(kind.load("body"))
    if kind.public:  # the public name is the registered function, documented
        assert name in ampscope.__all__ and name in dir(ampscope)
        assert getattr(ampscope, name) is kind.load("api") is getattr(ampscope.api, name)
        assert f"## `ampscope.{name}`" in (ROOT / "docs" / "api.md").read_text()
    else:
        assert name not in ampscope.__all__ and not hasattr(ampscope, name)


@pytest.mark.fast
def test_every_command_takes_exactly_its_registered_exports():
    [sub] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for command, parser in sub.choices.items():
        actions = {o: a for a in parser._actions for o in a.option_strings}
        for export in EXPORTS.values():
            expected = export.help(command)
            action = actions.get(export.flag)
            assert (action and action.help) == expected, (command, export.flag)
            assert action is None or action.metavar == "PATH"


@dataclass
class ToyReport:  # a report of a test's own: the registration below is all it gets
    size: int

    def to_dict(self) -> dict:
        return {"schema": "ampscope.toy/1", "size": self.size}

    def table(self):
        from ampscope.records.table import Table

        return Table(("size",), ((self.size,),))


def toy(size: int = 3) -> ToyReport:
    return ToyReport(size)


def toy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=3, help="the toy's size")


@pytest.fixture
def toy_kind():
    from ampscope.render import notebook

    kind = register_report(ReportKind(
        "toy", "a report of the tests' own", ToyReport, toy,
        lambda report: f"a toy of size {report.size}", "Toy section",
        lambda reports: Markup("".join(f"<p>toy {r.size}</p>" for r in reports)),
        table="the toy's size", arguments=toy_arguments,
        examples=("ampscope toy --size 7   # a toy of size 7",)))
    try:
        yield kind
    finally:
        del REPORTS["toy"]
        notebook.VIEWS.pop(ToyReport, None)
        vars(ampscope).pop("toy", None)  # the package root keeps a name once used
    assert "a report of the tests' own" not in _parser().format_help()
    assert "toy" not in ampscope.__all__ and not hasattr(ampscope, "toy")


def test_one_registration_makes_the_command_the_views_and_the_page(toy_kind, capsys, tmp_path):
    from ampscope.render import notebook
    from ampscope.render.html import report_html

    assert kind_of(ToyReport(1)) is toy_kind
    assert "a report of the tests' own" in _parser().format_help()
    assert main(["toy", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == {"schema": "ampscope.toy/1", "size": 3}
    assert main(["toy", "--size", "4", "--csv", str(tmp_path / "toy.csv")]) == 0
    assert "a toy of size 4" in capsys.readouterr().out
    assert (tmp_path / "toy.csv").read_text() == "size\n4\n"

    notebook.register()
    fragment = ToyReport(2)._repr_html_()  # type: ignore[attr-defined]
    assert "<h2>Toy section</h2>" in fragment and "<p>toy 2</p>" in fragment

    matrix, traces = ampscope.matrix("gpt2-tiny", settings=["fp32"], seq=4, workload="forward")
    page = report_html(traces, matrix, reports=[ToyReport(5)])
    assert '<section id="toy"><h2>Toy section</h2><p>toy 5</p></section>' in page


def test_one_registration_makes_the_public_name(toy_kind):
    assert "toy" in ampscope.__all__ and "toy" in dir(ampscope)
    assert ampscope.toy is toy and ampscope.api.toy is toy  # type: ignore[attr-defined]
    assert ampscope.toy(size=6) == ToyReport(6)  # type: ignore[attr-defined]


def test_one_registration_makes_the_help(toy_kind):
    [sub] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    text = sub.choices["toy"].format_help()
    # Its own argument first, then the exports it takes (a table: --csv too), then the example.
    assert text.index("--size SIZE") < text.index("--json PATH") < text.index("--csv PATH")
    assert "write the toy's size as CSV ('-' for stdout)" in text
    assert text.rstrip().endswith("examples:\n  ampscope toy --size 7   # a toy of size 7")
    assert _parser().parse_args(["toy", "--size", "7"]).size == 7
