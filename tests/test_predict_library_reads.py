"""A predicted run gets through a value read inside torch or an installed library (a truth test
of a fake tensor: `if not mask.any()` in `nn.init.trunc_normal_`), answered as the usual case
with a note, and records what the real run records; a value read in the user's own code still
stops it, with the line to guard."""

from __future__ import annotations

import textwrap

import pytest

from ampscope.errors import AmpscopeError
from ampscope.script import run_script

_INIT = """\
import torch
import torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
for m in model:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)  # a rejection loop on mask.any() inside torch
opt = torch.optim.AdamW(model.parameters())
loss = model(torch.randn(4, 8)).square().mean()
{user}
loss.backward()
opt.step()
"""


def _ops(trace) -> list[tuple[str, tuple[str, ...]]]:
    return [(o.op, tuple(m.dtype for m in o.outputs)) for o in trace.ops
            if o.phase in ("forward", "backward", "optimizer") and o.module is not None]


def test_trunc_normal_init_is_predicted_as_it_runs(tmp_path):
    script = tmp_path / "init.py"
    script.write_text(_INIT.format(user=""))
    predicted = run_script(str(script), [], in_process=True, predict=True)
    real = run_script(str(script), [], in_process=True)
    assert predicted.mode == "predict"
    assert any(n.startswith("torch/nn/init.py:") and "tested a fake tensor's truth" in n
               for n in predicted.notes)
    assert not any("tested a fake tensor's truth" in n for n in real.notes)
    assert _ops(predicted) == _ops(real)
    assert [(p.name, p.dtype, p.grad_dtype) for p in predicted.parameters] == \
        [(p.name, p.dtype, p.grad_dtype) for p in real.parameters]


def test_a_value_read_in_user_code_still_stops_the_prediction(tmp_path):
    script = tmp_path / "guard.py"
    script.write_text(_INIT.format(user="if loss < 1:\n    print('small')"))
    with pytest.raises(AmpscopeError, match=r"the code at guard\.py:10 reads a tensor's value"):
        run_script(str(script), [], in_process=True, predict=True)


def test_hf_trainer_gets_through_its_nan_filter_predicted(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_frameworks import HF

    script = tmp_path / "hf_train.py"
    script.write_text(textwrap.dedent(HF))
    trace = run_script(str(script), ["bf16"], device="cuda", in_process=True, predict=True)
    # The Trainer's logging_nan_inf_filter tests isnan(loss) of the fake loss: answered False.
    assert any(n.startswith("transformers/trainer.py:") and "tested a fake tensor's truth" in n
               for n in trace.notes)
    assert trace.setting.autocast_dtype == "bfloat16"
    assert any(o.phase == "optimizer" for o in trace.ops)


def test_an_error_after_a_nan_answer_names_where_it_was_given(tmp_path):
    """A value that sets a size (here a split, as expert routing's all-to-all sizes are) has no
    prediction: the error says where `.item()` was answered with NaN."""
    script = tmp_path / "split.py"
    script.write_text(_INIT.format(user="k = loss.detach().abs().item()\n"
                                        "parts = torch.randn(6).split([int(k), 6 - int(k)])"))
    with pytest.raises(AmpscopeError) as raised:
        run_script(str(script), [], in_process=True, predict=True)
    said = str(raised.value)
    assert "ValueError" in said and "cannot convert float NaN to integer" in said
    assert "(predict mode answered .item() with NaN at split.py:10: a value that decides a " \
           "size" in said
