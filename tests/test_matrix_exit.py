"""`ampscope matrix` with a setting that fails: the table still shows every setting and says
why one failed, and the command exits 2 with one line on stderr naming the failed setting and
why (before: status 0 and an empty stderr, the failure only in the table).

The model is a factory's: an embedding and a bf16 head, as a model that keeps one layer in
bf16 on purpose. Under native+amp-bf16 autocast runs the head in bf16; under native (no
autocast) the fp32 activations meet the bf16 weight and torch's linear refuses them.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from ampscope.cli import main
from ampscope.cli.commands import _failed_settings

MIXED = """
import types
import torch
from torch import nn
from torch.nn import functional as F


class Mixed(nn.Module):
    config = types.SimpleNamespace(vocab_size=16, block_size=8)

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 16).to(torch.bfloat16)

    def forward(self, idx, targets=None):
        logits = self.head(self.embed(idx))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build():
    return Mixed()
"""


@pytest.fixture
def mixed(tmp_path, monkeypatch):
    (tmp_path / "mixed_matrix_model.py").write_text(textwrap.dedent(MIXED))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mixed_matrix_model:build"


def test_a_failed_setting_exits_2_with_one_line_naming_it(mixed, capsys):
    code = main(["matrix", mixed, "--settings", "native+amp-bf16,native", "--seq", "4"])
    out, err = capsys.readouterr()
    assert code == 2
    [line] = err.splitlines()
    assert line.startswith("ampscope: error: 1 of 2 settings failed (native): native: dtype "
                           "mismatch in head: "), line
    assert "float32 and bfloat16" in line
    # The table is still shown: the setting that ran, and the one that failed, with why.
    text = " ".join(out.split())
    assert "native fails: dtype mismatch in head" in text
    assert "native+amp-bf16" in text


def test_the_json_document_still_holds_the_failure(mixed, capsys):
    code = main(["matrix", mixed, "--settings", "native+amp-bf16,native", "--seq", "4",
                 "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 2
    document = json.loads(out)
    assert [f["setting"] for f in document["failures"]] == ["native"]
    assert [s["name"] for s in document["settings"]] == ["native+amp-bf16"]
    assert len(err.splitlines()) == 1 and "(native)" in err


def test_settings_that_all_run_exit_0_with_nothing_on_stderr(mixed, capsys):
    assert main(["matrix", mixed, "--settings", "native+amp-bf16,fp32+amp-bf16", "--seq", "4"]) == 0
    assert capsys.readouterr().err == ""


def test_every_failed_setting_is_named_before_the_reasons():
    """A long reason is cut at the line's end (300 characters): the names come first."""
    failures = (("fp16", "x" * 400), ("native", "dtype mismatch in head"))
    line = _failed_settings(failures, 4)
    assert line.startswith("2 of 4 settings failed (fp16, native): fp16: xxx")
    assert line.endswith("; native: dtype mismatch in head")


def test_a_report_with_a_failed_setting_exits_2_and_still_writes_its_page(mixed, capsys,
                                                                          tmp_path):
    page = tmp_path / "r.html"
    code = main(["report", mixed, "--settings", "native+amp-bf16,native", "--seq", "4",
                 "-o", str(page)])
    err = capsys.readouterr().err
    assert code == 2
    assert page.read_text().startswith("<!DOCTYPE html>")
    [error] = [line for line in err.splitlines() if line.startswith("ampscope: error")]
    assert error.startswith("ampscope: error: 1 of 2 settings failed (native): native: dtype "
                            "mismatch in head: "), error
