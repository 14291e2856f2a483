"""Tables of a trace and of its reports: `to_dataframe`, `table`, and `--csv PATH`, checked
against the records they come from."""

from __future__ import annotations

import csv
import io
import sys

import pytest

import ampscope
from ampscope.analysis.compare import build_matrix
from ampscope.analysis.flops import flop_report
from ampscope.analysis.memory import memory_report
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.records import PHASES, module_label
from ampscope.records.table import PANDAS_MISSING, table

pd = pytest.importorskip("pandas")


@pytest.fixture(scope="module")
def step():
    return ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", workload="train", seq=8)


@pytest.mark.fast
def test_ops_frame_has_one_row_per_op_with_its_dtypes(step):
    df = step.to_dataframe("ops")
    assert len(df) == len(step.ops)
    for o, row in zip(step.ops, df.itertuples(index=False), strict=True):
        assert row.op == o.op and row.phase == o.phase
        assert row.in_dtypes.split() == [m.dtype for m in o.inputs]
        assert row.out_dtypes.split() == [m.dtype for m in o.outputs]
        assert bool(row.autocast_cast) == o.autocast_cast
    # The FLOPs column adds up to the report's total; per phase as well.
    report = flop_report(step, tokens=8)
    assert df["flops"].sum() == report.total > 0
    for phase in PHASES:  # the evaluation passes' FLOPs (none here) are counted apart
        counted = report.evaluation if phase == "evaluation" else report.by_phase[phase]
        assert df[df.phase == phase]["flops"].sum() == counted
    # Autocast's casts are rows too: as many as the trace has.
    assert df["autocast_cast"].sum() == sum(o.autocast_cast for o in step.ops) > 0


@pytest.mark.fast
def test_modules_frame_keeps_each_calls_output_dtype(step):
    df = step.to_dataframe("modules")
    assert list(df.columns)[:4] == ["index", "phase", "module", "type"]
    assert len(df) == len(step.modules)
    for m, row in zip(step.modules, df.itertuples(index=False), strict=True):
        assert row.module == module_label(m.name) and row.type == m.type
        assert row.out_dtypes.split() == [t.dtype for t in m.outputs]
    lm_head = df[(df.module == "lm_head") & (df.phase == "forward")].iloc[0]
    assert lm_head.out_dtypes == "bfloat16"  # autocast ran the Linear in bf16
    assert lm_head.out_shapes == "1x8x512"


@pytest.mark.fast
def test_tensors_frame_counts_every_parameter_byte_once(step):
    df = step.to_dataframe("tensors")
    params = df[df.role == "parameter"]
    assert set(params.name) == {p.name for p in step.parameters}
    # Each parameter's bytes are its elements times its dtype's size: float32 here.
    assert params["bytes"].sum() == 4 * params["elements"].sum()
    assert params["elements"].sum() == step.model.parameters
    grads = df[df.role == "gradient"]
    assert len(grads) == sum(p.grad_dtype is not None for p in step.parameters)
    assert set(df.role) >= {"parameter", "gradient", "optimizer_state", "input", "target",
                            "output"}


@pytest.mark.fast
def test_memory_frame_matches_the_report(step):
    report = memory_report(step)
    df = report.to_dataframe()
    assert df["peak_bytes"].sum() == report.peak.bytes
    assert df["allocated_bytes"].sum() == sum(s.nbytes for s in step.storages)
    assert df["allocated_storages"].sum() == len(step.storages)


@pytest.mark.fast
def test_flop_frame_totals_the_report_without_the_optimizer(step):
    report = flop_report(step, tokens=8)
    df = report.to_dataframe()
    assert df["total"].sum() + report.by_phase["optimizer"] == report.total
    assert (df["total"] == df["repeats"] * (df["forward"] + df["backward"])).all()


@pytest.mark.fast
def test_matrix_frame_has_an_in_out_and_matmul_column_per_setting(step):
    fp32 = ampscope.trace("gpt2-tiny", setting="fp32", workload="train", seq=8)
    result = build_matrix([fp32, step])
    df = result.to_dataframe()
    assert list(df.columns[4:]) == ["fp32 in", "fp32 out", "fp32 matmul", "fp32+amp-bf16 in",
                                    "fp32+amp-bf16 out", "fp32+amp-bf16 matmul"]
    row = df[df.module == "lm_head"].iloc[0]
    assert (row["fp32 out"], row["fp32+amp-bf16 out"]) == ("float32", "bfloat16")
    assert row["fp32 matmul"] is None  # no fp8 setting: the matmul is in the dtypes shown


@pytest.mark.fast
def test_csv_and_dataframe_have_the_same_columns_and_values(step):
    t = step.table("ops")
    read = pd.read_csv(io.StringIO(t.to_csv()), keep_default_na=False)
    frame = t.to_dataframe()
    assert list(read.columns) == list(frame.columns)
    assert read["flops"].tolist() == frame["flops"].tolist()
    assert read["op"].tolist() == frame["op"].tolist()
    assert read["source"].tolist() == frame["source"].fillna("").tolist()


@pytest.mark.fast
def test_unknown_kind_is_refused(step):
    with pytest.raises(ValueError, match="no table 'op'.*ops, modules, tensors"):
        step.to_dataframe("op")


@pytest.mark.fast
def test_without_pandas_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    with pytest.raises(AmpscopeError, match=r"pip install 'ampscope\[pandas\]'"):
        table(("a",), [(1,)]).to_dataframe()
    assert "\n" not in PANDAS_MISSING


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_cli_csv_writes_the_printed_table(tmp_path, capsys):
    modules, ops = tmp_path / "modules.csv", tmp_path / "ops.csv"
    assert main(["trace", "gpt2-tiny", "--seq", "8", "--csv", str(modules)]) == 0
    assert main(["trace", "gpt2-tiny", "--seq", "8", "--ops", "--csv", str(ops)]) == 0
    traced = ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", workload="train", seq=8)
    rows = _csv(modules)
    assert [r["module"] for r in rows] == [module_label(m.name) for m in traced.modules]
    assert [r["out_dtypes"] for r in rows] == [" ".join(t.dtype for t in m.outputs)
                                               for m in traced.modules]
    assert sum(int(r["flops"]) for r in _csv(ops)) == sum(o.flops for o in traced.ops)
    assert "Wrote" in capsys.readouterr().err


def test_cli_csv_to_stdout_is_the_only_output(capsys):
    assert main(["memory", "gpt2-tiny", "--seq", "8", "--csv", "-"]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(io.StringIO(out)))
    report = ampscope.memory("gpt2-tiny", seq=8)
    assert sum(int(r["peak_bytes"]) for r in rows) == report.peak.bytes
    assert "Peak" not in out  # no rendering after the CSV


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", [
    (["flops", "gpt2-tiny", "--csv", "-", "--json", "-"], "would both write to stdout"),
    (["matrix", "gpt2-tiny", "--csv", "/no/such/folder/m.csv"], "no folder /no/such/folder"),
])
def test_csv_bad_paths_are_refused_before_the_run(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.fast
def test_csv_with_distributed_is_refused_not_ignored(capsys):
    assert main(["memory", "gpt2-tiny", "--distributed", "ddp", "--csv", "m.csv"]) == 2
    err = capsys.readouterr().err
    assert "--csv is not available with --distributed" in err and len(err.splitlines()) == 1
