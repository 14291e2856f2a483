"""`ampscope policy`: the build's autocast policy per op, device against device, and the quiz."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ampscope.cli import main
from ampscope.precision import GlobalState
from ampscope.precision.quiz import QUIZ, quiz
from ampscope.records import dtype_name


def _json(capsys, *argv) -> dict:
    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_quiz_answers_the_issue_on_cuda_and_cpu():
    cuda, cpu = quiz("cuda", torch.bfloat16), quiz("cpu", torch.bfloat16)
    assert cuda["x.sum()"]["bfloat16"] == "float32"  # sum comes out fp32 on CUDA...
    assert cuda["x.mean()"]["bfloat16"] == "bfloat16"  # ...but mean stays bf16
    assert cpu["x.sum()"]["bfloat16"] == "bfloat16"  # and on the CPU sum follows its input
    assert cuda["softmax(x, -1)"]["bfloat16"] == "float32"
    assert cpu["softmax(x, -1)"]["bfloat16"] == "bfloat16"
    assert cpu["x @ x"]["float32"] == cuda["x @ x"]["float32"] == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake cuda tensors need a CPU-only build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_quiz_matches_the_builds_own_cuda_autocast(dtype):
    """The emulated answers equal AutocastCUDA's on fake cuda tensors (forward, no GPU)."""
    answers = quiz("cuda", dtype)
    state = GlobalState.save()
    try:
        with FakeTensorMode():
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", dtype)
            for expression, fn in QUIZ.items():
                for input_dtype in (dtype, torch.float32):
                    x = torch.rand(4, 4, device="cuda").to(input_dtype)
                    assert dtype_name(fn(x).dtype) == answers[expression][dtype_name(input_dtype)], \
                        (expression, input_dtype)
    finally:
        state.restore()


@pytest.mark.fast
def test_policy_lists_ops_with_categories(capsys):
    data = _json(capsys, "policy", "--device", "cuda", "--dtype", "bf16", "--op", "softmax")
    assert data["schema"] == "ampscope.policy/1" and data["device"] == "cuda"
    categories = {o["op"]: o["category"] for o in data["ops"]}
    expected = {"log_softmax.int": "fp32_set_opt_dtype", "softmax.int": "fp32_set_opt_dtype"}
    # Releases before 2.13 also list the named-dimension overloads, with the same category.
    named = {"log_softmax.Dimname", "softmax.Dimname"} & set(categories)
    assert categories == expected | dict.fromkeys(named, "fp32_set_opt_dtype")


@pytest.mark.fast
def test_compare_cpu_cuda_shows_where_they_differ(capsys):
    data = _json(capsys, "policy", "--compare", "cpu", "cuda", "--dtype", "bf16")
    rows = {o["op"]: (o["cpu"], o["cuda"]) for o in data["ops"]}
    assert rows["cat"] == ("promote", "passthrough")
    assert rows["softmax.int"] == ("passthrough", "fp32_set_opt_dtype")
    assert rows["cross_entropy_loss"] == ("fp32", "passthrough")
    assert rows["layer_norm"] == ("passthrough", "fp32")
    assert "mm" not in rows  # lower precision on both


def test_policy_default_dtype_is_the_devices(capsys):
    assert _json(capsys, "policy", "--device", "cuda")["dtype"] == "float16"
    assert _json(capsys, "policy")["dtype"] == "bfloat16"


# --- the policy across releases ---------------------------------------------------------------


def test_every_listed_change_agrees_with_this_build():
    """A change this build has must show in the policy read from the build; each row cites the
    pull request that made it."""
    import re

    from ampscope.precision.policy_history import applies, changes
    from ampscope.runtime.autocast_policy import read_policy

    assert changes()
    for change in changes():
        assert re.fullmatch(r"pytorch/pytorch#\d+", change.source), change
        policy = read_policy(change.device, torch.bfloat16)
        here = policy[change.op].category if change.op in policy else "passthrough"
        assert here == (change.since if applies(change) else change.before), change
        assert change.before != change.since


def test_policy_history_names_the_build_and_the_change(capsys):
    from ampscope.precision.policy_history import applies, changes

    data = _json(capsys, "policy", "--device", "cuda", "--history")
    assert data["torch"] == torch.__version__ and data["device"] == "cuda"
    rms = next(row for row in data["history"] if row["op"] == "rms_norm")
    assert rms == {"op": "rms_norm", "device": "cuda", "before": "passthrough", "since": "fp32",
                   "version": "2.12", "source": "pytorch/pytorch#174824",
                   "in_this_build": applies(changes()[0])}
    assert main(["policy", "--device", "cuda", "--history"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"this build, PyTorch {torch.__version__}, has the change" in out
    assert "pytorch/pytorch#174824" in out
    for argv in (["policy"], ["policy", "--compare", "cpu", "cuda"], ["policy", "--quiz"]):
        assert _json(capsys, *argv)["torch"] == torch.__version__
        assert main(argv) == 0
        assert f"Read from PyTorch {torch.__version__}." in " ".join(capsys.readouterr().out.split())


def test_a_trace_says_when_its_dtypes_depend_on_the_release():
    import dataclasses

    import ampscope
    from ampscope.analysis.policy_versions import policy_version_findings
    from ampscope.precision.policy_history import applies, changes

    rms_change = next(c for c in changes() if c.op == "aten::rms_norm" and c.device == "cuda")
    cuda = ampscope.trace("nanochat-tiny", setting="cuda:fp32+amp-bf16", workload="forward",
                          seq=8)
    assert cuda.setting.torch == cuda.to_dict()["setting"]["torch"] == torch.__version__
    [finding] = [f for f in cuda.findings if "depend on the release" in f.text]
    newer = dataclasses.replace(cuda, setting=dataclasses.replace(cuda.setting, torch="2.12.0"))
    older = dataclasses.replace(cuda, setting=dataclasses.replace(cuda.setting, torch="2.11.0"))
    if applies(rms_change):  # this build has the change: the finding says so, as the trace shows
        assert finding.text.startswith(
            f"rms_norm runs in float32 under cuda autocast in PyTorch {torch.__version__}")
        assert "before PyTorch 2.12 it followed its inputs (pytorch/pytorch#174824)" in finding.text
        rms = [c for c in cuda.calls if c.func.endswith("rms_norm")]
        assert rms and all(c.outputs[0].dtype == "float32" for c in rms)  # as the finding says
    else:  # a release before it: the finding says what changes from 2.12 on
        assert finding.text.startswith(
            f"rms_norm follows its inputs under cuda autocast in PyTorch {torch.__version__}")
        assert "from PyTorch 2.12 on it runs in float32" in finding.text
    # The same trace had it come from 2.11 or 2.12: the finding follows the trace's release.
    [finding] = policy_version_findings(older)
    assert "rms_norm follows its inputs under cuda autocast in PyTorch 2.11.0" in finding.text
    assert "from PyTorch 2.12 on it runs in float32" in finding.text
    [finding] = policy_version_findings(newer)
    assert "rms_norm runs in float32 under cuda autocast in PyTorch 2.12.0" in finding.text
    # The CPU has no listed recent change for these ops; a trace of a build that did not record
    # its version says nothing.
    cpu = ampscope.trace("nanochat-tiny", setting="fp32+amp-bf16", workload="forward", seq=8)
    assert not policy_version_findings(cpu)
    unknown = dataclasses.replace(cuda, setting=dataclasses.replace(cuda.setting, torch=None))
    assert not policy_version_findings(unknown)


# --- every overload classified, on every release --------------------------------------------


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_overload_of_the_builds_policy_is_classified(device):
    from ampscope.runtime.autocast_policy import read_policy

    policy = read_policy(device, torch.bfloat16)
    assert policy
    assert [n for n, p in policy.items() if p.category == "unclassified"] == []


def test_named_dimension_overloads_follow_their_positional_twins():
    """Releases before 2.13 list overloads taking a named dimension (`softmax.Dimname`) for
    CUDA autocast; each is probed like any other and gets its twin's category."""
    from ampscope.runtime.autocast_policy import read_policy, registered_ops

    named = [n for n in registered_ops("cuda") if "imname" in n or ".names_" in n]
    if not named:
        pytest.skip(f"torch {torch.__version__} lists no named-dimension overload for cuda")
    policy = read_policy("cuda", torch.bfloat16)
    twins = {"aten::softmax.Dimname": "aten::softmax.int",
             "aten::log_softmax.Dimname": "aten::log_softmax.int",
             "aten::cumsum.dimname": "aten::cumsum", "aten::cumprod.dimname": "aten::cumprod",
             "aten::prod.dim_Dimname": "aten::prod.dim_int",
             "aten::sum.dim_DimnameList": "aten::sum.dim_IntList"}
    for name in named:
        assert policy[name].category != "unclassified", name
        if name in twins and twins[name] in policy:
            assert policy[name].category == policy[twins[name]].category, name
    if "aten::norm.names_ScalarOpt_dim" in policy:
        assert policy["aten::norm.names_ScalarOpt_dim"].category == "fp32_append_dtype"
        assert policy["aten::norm.names_ScalarOpt_dim"].redirect == \
            "aten::norm.names_ScalarOpt_dim_dtype"


def test_policy_features_are_reported():
    from ampscope.torchcompat import optim
    from ampscope.torchcompat import policy as compat

    found = {f.name: f for f in compat.features()}
    assert found["dispatch registrations"].available
    assert "cuda" in optim.foreach_devices()
