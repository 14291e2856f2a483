"""What each forward pass of a script was for, and the precision in force when each op ran.

The scripts are written here, a few lines each, in the shapes training scripts have: an
evaluation under `torch.no_grad()` before the first step, gradient accumulation, sampling
with `torch.multinomial`, TF32 switched on by the script. The FLOPs are derived by hand from
the model's shapes (PyTorch's convention: 2·m·n·k per matmul), and the precisions from what
torch's own API documents: `torch.backends.cuda.matmul.allow_tf32` and
`torch.set_float32_matmul_precision("high")` set CUDA matmuls to TF32, the first leaves the CPU's
oneDNN matmuls in IEEE float32, and cuDNN convolutions take TF32 by default
(`torch.backends.cudnn.allow_tf32` is True unless a script turns it off).
"""

from __future__ import annotations

import textwrap

import pytest

from ampscope.analysis.flops import flop_report
from ampscope.analysis.summary import forward_passes, tokens_of
from ampscope.script import run_script

pytestmark = pytest.mark.fast

V, D, B, T = 32, 16, 2, 4  # vocabulary, width, batch, sequence

HEADER = f"""
import torch
from torch import nn
from torch.nn import functional as F

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding({V}, {D})
        self.head = nn.Linear({D}, {V}, bias=False)
    def forward(self, idx, targets=None):
        logits = self.head(self.emb(idx))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, {V}), targets.view(-1))

dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = Tiny().to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randint(0, {V}, ({B}, {T}), device=dev)
"""


def script(tmp_path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return str(path)


# Per pass over B·T tokens: the head's forward matmul, 2·BT·D·V; its backward, one matmul for
# the input's gradient and one for the weight's, 4·BT·D·V. The embedding counts none.
FORWARD = 2 * B * T * D * V
BACKWARD = 4 * B * T * D * V

EVAL_THEN_ACCUMULATE = """
model.eval()
with torch.no_grad():
    for _ in range(2):
        model(x, x).item()
model.train()
for step in range(3):
    for micro in range(4):
        (model(x, x) / 4).backward()
    opt.step()
    opt.zero_grad()
"""


def test_evaluation_before_the_first_step_is_not_gradient_accumulation(tmp_path):
    t = run_script(script(tmp_path, EVAL_THEN_ACCUMULATE), device="cpu", in_process=True)
    assert [p.kind for p in t.passes] == ["evaluation"] * 2 + ["train"] * 4
    assert [p.grad for p in t.passes] == [False] * 2 + [True] * 4
    assert forward_passes(t) == 4
    assert tokens_of(t) == 4 * B * T
    report = flop_report(t, tokens=tokens_of(t))
    assert report.by_phase["forward"] == 4 * FORWARD
    assert report.by_phase["backward"] == 4 * BACKWARD
    assert report.total == 4 * (FORWARD + BACKWARD)
    assert report.evaluation == 2 * FORWARD
    six_nd = next(c for c in report.conventions if c.name == "6·N·D")
    assert six_nd.flops == 6 * (V * D + D * V) * 4 * B * T
    assert any("4 training passes for an optimizer step" in n for n in t.notes)
    assert any("2 evaluation passes" in n for n in t.notes)
    # The evaluation passes' module calls are in the evaluation phase, the training ones not.
    roots = [m.phase for m in t.modules if m.depth == 0 and m.name == ""
             and m.phase != "backward"]
    assert roots == ["evaluation"] * 2 + ["forward"] * 4


def test_a_pass_never_backpropagated_is_evaluation_even_with_gradients_on(tmp_path):
    body = """
    model(x, x).item()          # with gradients on, but never backpropagated
    model(x, x).backward()
    opt.step()
    """
    t = run_script(script(tmp_path, body), device="cpu", in_process=True)
    assert [(p.kind, p.grad) for p in t.passes] == [("evaluation", True), ("train", True)]
    assert flop_report(t, tokens=tokens_of(t)).total == FORWARD + BACKWARD


def test_sampling_passes_between_steps(tmp_path):
    body = """
    g = torch.Generator(device=dev).manual_seed(1)
    model(x, x).backward()
    with torch.no_grad():
        logits = model(x[:, -1:])
        torch.multinomial(logits[:, -1].softmax(-1), 1, generator=g)
    opt.step()
    """
    t = run_script(script(tmp_path, body), device="cpu", in_process=True)
    assert [p.kind for p in t.passes] == ["train", "sampling"]
    assert any("1 sampling pass " in n for n in t.notes)
    # The sampling pass's tokens: B×1, not counted in the step's.
    assert t.passes[1].tokens == B and tokens_of(t) == B * T


# llm.c's shape: one forward and backward to dump reference tensors, the gradients cleared,
# then the training loop (here two steps of one pass each).
REFERENCE_PASS_THEN_TRAIN = """
loss = model(x, x)
loss.backward()                 # the reference pass: its gradients are never stepped on
print(loss.item(), model.head.weight.grad.norm().item())   # ops after backward
with torch.no_grad():
    model(x)                    # and an evaluation of it
{clear}
for step in range(2):
    model(x, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


@pytest.mark.parametrize("clear", ["opt.zero_grad(set_to_none=True)",
                                   "for p in model.parameters(): p.grad = None"])
def test_a_pass_whose_gradients_are_cleared_before_a_step_is_discarded(tmp_path, clear):
    body = REFERENCE_PASS_THEN_TRAIN.format(clear=clear)
    t = run_script(script(tmp_path, body), device="cpu", in_process=True, steps=2)
    assert [p.kind for p in t.passes] == ["discarded", "evaluation", "train", "train"]
    # The step counts the two training passes only: no gradient accumulation, its tokens once.
    assert forward_passes(t) == 2 and tokens_of(t) == 2 * B * T
    report = flop_report(t, tokens=tokens_of(t))
    assert report.by_phase["forward"] == 2 * FORWARD
    assert report.by_phase["backward"] == 2 * BACKWARD
    # The discarded pass's forward and backward both moved to the evaluation phase.
    assert report.evaluation == FORWARD + BACKWARD + FORWARD
    assert not any("gradient accumulation)" in n for n in t.notes)
    assert any(n.startswith("1 training pass of the run (forward and backward) was discarded")
               for n in t.notes)


def test_accumulated_gradients_are_not_discarded(tmp_path):
    """Gradients kept from one pass to the next (accumulation) are the step's."""
    body = """
    model(x, x).backward()
    model(x, x).backward()
    opt.step()
    """
    t = run_script(script(tmp_path, body), device="cpu", in_process=True)
    assert [p.kind for p in t.passes] == ["train", "train"]
    assert any("2 training passes for an optimizer step" in n for n in t.notes)


def test_a_run_that_never_trains_keeps_its_passes_forward(tmp_path):
    body = """
    with torch.no_grad():
        for _ in range(3):
            model(x)
    """
    t = run_script(script(tmp_path, body), device="cpu", in_process=True)
    assert [p.kind for p in t.passes] == ["evaluation"] * 3
    assert not any(o.phase == "evaluation" for o in t.ops)
    assert sum(1 for m in t.modules if m.depth == 0 and m.phase == "forward") == 3


TF32_MIDWAY = """
for step in range(2):
    if step == 1:
        torch.backends.cuda.matmul.allow_tf32 = True   # switched on after the first step
    for micro in range(1 + step):
        model(x, x).backward()
    opt.step()
    opt.zero_grad()
"""


def _matmul_precisions(t) -> list[str | None]:
    return [o.fp32_precision for o in t.ops if o.op.startswith(("aten.mm.", "aten.addmm."))]


def test_tf32_set_by_the_script_midway_is_recorded_per_op(tmp_path):
    t = run_script(script(tmp_path, TF32_MIDWAY), device="cuda", steps=2, in_process=True)
    # 3 matmuls a pass (forward, and the two of backward); 1 pass in step 1, 2 in step 2.
    assert _matmul_precisions(t) == ["ieee"] * 3 + ["tf32"] * 6
    assert t.setting.matmul_precision == "high"  # most of the matmul FLOPs ran in TF32


def test_allow_tf32_is_cuda_only(tmp_path):
    t = run_script(script(tmp_path, TF32_MIDWAY), device="cpu", steps=2, in_process=True)
    assert set(_matmul_precisions(t)) == {"ieee"}
    assert t.setting.matmul_precision == "highest"


def test_set_float32_matmul_precision_before_the_model_runs(tmp_path):
    body = """
    torch.set_float32_matmul_precision("high")
    model(x, x).backward()
    opt.step()
    """
    t = run_script(script(tmp_path, body), device="cuda", in_process=True)
    assert set(_matmul_precisions(t)) == {"tf32"}
    assert t.setting.matmul_precision == "high"
    # Ops with no matmul have no fp32 precision recorded; bf16 matmuls neither.
    assert all(o.fp32_precision is None for o in t.ops if "embedding" in o.op)


def test_cudnn_convolutions_take_tf32_by_default(tmp_path):
    body = """
    conv = nn.Conv1d(4, 4, 3).to(dev)
    copt = torch.optim.SGD(conv.parameters(), lr=0.1)
    conv(torch.randn(2, 4, 8, device=dev)).sum().backward()
    copt.step()
    """
    t = run_script(script(tmp_path, body), device="cuda", in_process=True)
    convs = [o.fp32_precision for o in t.ops if o.op.startswith("aten.convolution")]
    assert convs and set(convs) == {"tf32"}
    # The legacy matmul setting is untouched: the header still says IEEE matmuls.
    assert t.setting.matmul_precision == "highest"


def test_gradients_freed_by_zero_grad_after_the_step_are_still_gradients(tmp_path):
    """`--steps 1` runs the script's code after its step: a `zero_grad()` frees the gradients
    before the run ends. Their storages are the two gradients the optimizer stepped on (the
    model's two parameters), freed by the script, not temporaries."""
    body = """
    for step in range(2):
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    """
    t = run_script(script(tmp_path, body), device="cpu", in_process=True)
    grads = [s for s in t.storages if s.category == "gradient"]
    assert sorted(s.names for s in grads) == [("emb.weight.grad",), ("head.weight.grad",)]
    assert all(s.freed is not None for s in grads)  # zero_grad(set_to_none=True) freed them
