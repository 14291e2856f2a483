"""`--gpu` reaches every rank: `run --nproc N --gpu NAME` (real and predicted ranks) and
`trace MODEL --distributed ... --gpu NAME` run each rank's virtual cuda device as the asked GPU,
as a single-process `run --gpu` does, not the default H100.

The expected figures are NVIDIA's for the A100 SXM4 80GB, written here by hand: the name
`torch.cuda.get_device_name()` returns on one, 80 GiB of memory (80 · 2^30 bytes, as the
single-process `run --device cuda --gpu a100` reports it) and compute capability 8.0 (CUDA's
table of GPUs); the H100 SXM5 is 9.0.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from ampscope.cli import main
from ampscope.distributed import Parallel, predict
from ampscope.errors import AmpscopeError
from ampscope.script.ranks import run_ranks

A100_NAME = "NVIDIA A100 SXM4 80GB"
A100_MEMORY = 80 * 2**30  # bytes
A100_CAPABILITY = [8, 0]

# Each rank writes what its device says, then takes one SGD step of a tiny model.
FACTS = """
import json, os, torch
props = torch.cuda.get_device_properties(0)
with open(f"facts{os.environ['RANK']}.json", "w") as f:
    json.dump({"name": torch.cuda.get_device_name(), "memory": props.total_memory,
               "capability": torch.cuda.get_device_capability(),
               "count": torch.cuda.device_count()}, f)
model = torch.nn.Linear(4, 4).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4, device="cuda")).sum().backward()
opt.step()
"""


def _facts(tmp_path, monkeypatch) -> str:
    (tmp_path / "facts.py").write_text(textwrap.dedent(FACTS))
    monkeypatch.chdir(tmp_path)
    return "facts.py"


@pytest.mark.parametrize("predicted", [False, True], ids=["real", "predicted"])
def test_every_rank_sees_the_asked_a100(predicted, tmp_path, monkeypatch, capsys):
    script = _facts(tmp_path, monkeypatch)
    code = main(["run", "--nproc", "2", "--device", "cuda", "--gpu", "a100",
                 *(["--predict"] if predicted else []), script])
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"facts{rank}.json").read_text())
        assert facts == {"name": A100_NAME, "memory": A100_MEMORY,
                         "capability": A100_CAPABILITY, "count": 2}, rank
    # The note of what the ranks' code saw names the same GPU the step is predicted on.
    text = " ".join(out.split())
    assert f"saw cuda (2 × {A100_NAME}, compute capability 8.0)" in text
    assert f"Predicted step on {A100_NAME}" in text
    assert "H100" not in text.split("Check:")[0]


def test_without_gpu_the_ranks_see_the_default_h100(tmp_path, monkeypatch, capsys):
    script = _facts(tmp_path, monkeypatch)
    traces = run_ranks(script, [], 2, device="cuda")
    capsys.readouterr()
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"facts{rank}.json").read_text())
        assert facts["name"] == "NVIDIA H100 SXM5 80GB" and facts["capability"] == [9, 0]
    assert any("saw cuda (2 × NVIDIA H100 SXM5 80GB, compute capability 9.0)" in n
               for n in traces[0].notes)


def test_an_unknown_gpu_is_one_line_and_no_rank_starts(tmp_path, monkeypatch, capsys):
    script = _facts(tmp_path, monkeypatch)
    code = main(["run", "--nproc", "2", "--device", "cuda", "--gpu", "a1000", script])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("ampscope: error: unknown accelerator 'a1000'; known: ")
    assert err.count("\n") == 1
    # The library refuses it as early, before spawning a rank.
    with pytest.raises(AmpscopeError, match="unknown accelerator 'a1000'"):
        run_ranks(script, [], 2, device="cuda", gpu="a1000")
    assert not list(tmp_path.glob("facts*.json"))


def _attention(gpu: str | None) -> set[str]:
    report = predict("gpt2-tiny", Parallel("fsdp", 2), setting="cuda:fp32+amp-bf16", seq=8,
                     gpu=gpu)
    assert report.trace is not None
    assert report.trace.setting.gpu == (gpu or "h100")  # the rank's record says which
    return {o.op for o in report.trace.ops
            if o.phase == "forward" and "scaled_dot_product" in o.op}


def test_a_predicted_fsdp_rank_runs_the_asked_gpus_attention_kernel():
    """The rank's SDPA kernel is picked by the asked GPU's capability: flash on an A100
    (sm80: cuDNN attention goes first only from sm90), cuDNN on the default H100."""
    assert _attention("a100") == {"aten._scaled_dot_product_flash_attention.default"}
    assert _attention(None) == {"aten._scaled_dot_product_cudnn_attention.default"}
    with pytest.raises(AmpscopeError, match="unknown accelerator 'a1000'"):
        _attention("a1000")


def test_trace_distributed_passes_gpu_to_the_predicted_rank(monkeypatch, capsys):
    import ampscope.distributed as distributed

    asked: list[object] = []
    real = distributed.predict

    def recorded(*args, **kwargs):
        asked.append(kwargs.get("gpu"))
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed, "predict", recorded)
    code = main(["trace", "gpt2-tiny", "-d", "cuda", "--distributed", "fsdp", "--nproc", "2",
                 "--seq", "8", "--gpu", "a100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [getattr(a, "title", None) for a in asked] == [A100_NAME]
    assert f"Predicted step on {A100_NAME}" in " ".join(out.split())
