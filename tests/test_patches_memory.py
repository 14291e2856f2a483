"""A long-lived process that traces many models keeps none of them: the patch registry
(src/ampscope/patches.py) forgets an attribute once it is put back, so a model whose `forward`
a run wrapped is freed with the caller's last reference to it."""

from __future__ import annotations

import gc
import textwrap
import weakref

import torch
from torch import nn

import ampscope
from ampscope import patches
from ampscope.script import run_script


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x).relu())


def test_a_traced_model_is_freed_after_del():
    model = Net()
    ref = weakref.ref(model)
    t = ampscope.trace(model, torch.randn(2, 8), workload="forward", predict=False)
    assert {m.name for m in t.modules if m.phase == "forward"} == {"", "a", "b"}
    del model, t
    gc.collect()
    assert ref() is None
    assert patches.active() == [] and patches.changed() == []


def test_a_predicted_trace_frees_its_model_too():
    model = Net()
    ref = weakref.ref(model)
    t = ampscope.trace(model, torch.randn(2, 8), workload="forward", predict=True)
    assert t.mode == "predict"
    del model, t
    gc.collect()
    assert ref() is None


def test_an_instance_patch_is_forgotten_once_undone():
    model = Net()
    ref = weakref.ref(model)
    undo = patches.patch(model, "forward", lambda x: x)
    assert patches.changed() == ["Net.forward"]  # in force: remembered
    assert model(torch.ones(1)).tolist() == [1.0]
    undo()
    assert "forward" not in vars(model)  # the class's shows through again
    del model, undo
    gc.collect()
    assert ref() is None


def test_an_attribute_not_put_back_is_still_reported():
    # Two replacements undone oldest first leave the newer one's original (the first
    # replacement) in place: not as it was, so it is remembered and reported.
    class Owner:
        value = 1

    first = patches.patch(Owner, "value", 2)
    second = patches.patch(Owner, "value", 3)
    try:
        first()
        second()
        assert Owner.value == 2
        assert patches.changed() == ["test_an_attribute_not_put_back_is_still_reported."
                                     "<locals>.Owner.value"]
    finally:
        Owner.value = 1
    assert patches.changed() == []


def test_a_script_run_keeps_none_of_its_models(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class ProbeNet(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x)

        model = ProbeNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    """))
    t = run_script(str(script), in_process=True)
    assert t.model.name == "ProbeNet" and t.workload == "train"
    del t
    gc.collect()
    assert [o for o in gc.get_objects() if type(o).__name__ == "ProbeNet"] == []
