"""Repeated blocks traced once (runs/repeats.py): a predicted trace that replays identical
blocks equals, record for record, the trace that dispatches every block — the ground truth here
is the full run, which the replay never consults; and where blocks are not alike, or turn out
not to be, nothing is replayed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampscope
from ampscope.runs.alike import alike, repeated_runs
from tests.helpers import REPLAY_NOTE, assert_same_trace


def _replayed(trace) -> int:
    note = next((n for n in trace.notes if REPLAY_NOTE in n), None)
    return int(note.split()[0]) if note else 0


# Every zoo model with at least five identical blocks, each in a setting and workload of its
# own (dtypes, autocast casts, attention kernels, GradScaler, fp8 casts all differ), at seq 16.
CASES = [
    ("gpt2", "cuda:bf16", "train"),
    ("gpt2", "fp32+amp-bf16", "generate"),
    ("gpt2-medium", "mps:fp32+amp-bf16", "train"),
    ("opt-125m", "cuda:fp32+amp-fp16", "train"),
    ("gpt2-hf", "fp32+amp-bf16", "train"),
    ("llama-3.2-1b", "cuda:bf16", "forward"),
    ("llama-3.2-1b", "fp32+amp-bf16+fp8", "train"),
    ("nanochat-d20", "cuda:fp32+amp-bf16", "train"),
    ("qwen2.5-0.5b", "cuda:bf16", "train"),
    ("smollm2-135m", "fp32", "train"),
    # Under activation checkpointing: a replayed block's backward never unpacks what it saved,
    # so nothing is recomputed for it; its records include the recorded twin's recomputation.
    ("llama-3.2-1b", "fp32+amp-bf16", "train+checkpoint"),
    ("gpt2", "cuda:bf16", "train+checkpoint"),
]


@pytest.mark.parametrize(("model", "setting", "workload"), CASES)
def test_replayed_trace_equals_the_full_trace(model, setting, workload):
    if "+fp8" in setting:
        pytest.importorskip("torchao")
    workload, _, checkpoint = workload.partition("+")
    options = {"setting": setting, "workload": workload, "seq": 16, "predict": True,
               "checkpoint": checkpoint == "checkpoint"}
    replayed = ampscope.trace(model, **options)
    full = ampscope.trace(model, **options, every_block=True)
    assert _replayed(replayed) > 0
    assert _replayed(full) == 0
    assert_same_trace(replayed, full)


# -- tiny models built here: what is replayed and what is not


def _tagged(y: torch.Tensor, layer: int) -> torch.Tensor:
    return y  # as a KV cache's update(k, v, layer_idx) would be given the index


class Block(nn.Module):
    def __init__(self, layer_idx: int, width: int = 16):
        super().__init__()
        self.layer_idx = layer_idx
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x, extra=None):
        y = _tagged(self.fc(self.norm(x)), self.layer_idx)  # the index passed on: alike
        if extra is not None:
            y = y + extra
        return x + torch.relu(y)


class Branching(Block):
    def forward(self, x, extra=None):
        if self.layer_idx % 2:  # reads its index: blocks are not alike
            x = x * 2
        return super().forward(x, extra)


class Stack(nn.Module):
    def __init__(self, n: int = 7, width: int = 16, *, block: type[Block] = Block,
                 extra_every: int = 0):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(block(i, width) for i in range(n))
        self.extra = nn.Parameter(torch.zeros(width))
        self.extra_every = extra_every

    def forward(self, x):
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            # Value embeddings on some layers only: those calls differ from block 1's.
            extra = self.extra if self.extra_every and i % self.extra_every == 0 else None
            x = block(x, extra)
        return x.sum()


def _train(model: nn.Module, backward: bool = True):
    def step(module, batch):
        loss = module(batch["x"])
        if backward:
            loss.backward()
        return {"loss": loss}
    return step


def _both(model: nn.Module, setting: str = "fp32+amp-bf16", *, backward: bool = True):
    x = torch.randn(2, 4, 16)
    kwargs = {"setting": setting, "workload": _train(model, backward), "predict": True}
    return (ampscope.trace(model, {"x": x}, **kwargs),
            ampscope.trace(model, {"x": x}, **kwargs, every_block=True))


def test_blocks_that_pass_their_index_on_are_alike():
    blocks = [Block(i) for i in range(6)]
    assert alike(blocks)
    model = Stack()
    assert [len(b) for _, b in repeated_runs(model)] == [7]


def test_blocks_that_branch_on_their_index_are_not_alike():
    assert not alike([Branching(i) for i in range(6)])
    replayed, full = _both(Stack(block=Branching))
    assert _replayed(replayed) == 0
    assert_same_trace(replayed, full)


def test_a_block_class_made_in_a_function_that_branches_on_its_index_is_not_alike():
    class Local(Block):  # indented source, and the forward of a subclass
        def forward(self, x, extra=None):
            if self.layer_idx == 3:
                x = -x
            return super().forward(x, extra)

    assert not alike([Local(i) for i in range(6)])


def test_blocks_with_different_shapes_or_attributes_are_not_alike():
    assert not alike([Block(i, 16 if i != 3 else 8) for i in range(6)])
    blocks = [Block(i) for i in range(6)]
    for i, b in enumerate(blocks):
        b.window = 128 if i == 4 else 4096  # a sliding window on one layer
    assert not alike(blocks)


def test_a_block_with_a_hook_is_not_replayed():
    blocks = [Block(i) for i in range(6)]
    blocks[2].fc.register_forward_hook(lambda *a: None)
    assert not alike(blocks)


@pytest.mark.fast
def test_calls_with_other_inputs_run_and_the_rest_replay():
    # Every second block also gets a tensor (nanochat's value embeddings on alternate layers):
    # those calls do not match block 1's and run; the trace is still the full one.
    replayed, full = _both(Stack(n=9, extra_every=2))
    assert _replayed(replayed) > 0
    assert_same_trace(replayed, full)


class Counting(Block):
    calls = 0  # a class attribute: the same for every block, so no structural difference

    def forward(self, x, extra=None):
        Counting.calls += 1
        if Counting.calls == 3:  # the third block that runs does one more op
            x = x * 1.5
        return super().forward(x, extra)


class CountingStack(Stack):
    def __init__(self):
        super().__init__(n=7, block=Counting)

    def forward(self, x):
        Counting.calls = 0
        return super().forward(x)


def test_a_block_unlike_its_recorded_twin_makes_the_whole_step_run_again():
    # Block 1 is recorded, blocks 2-4 replayed (they run no code), then block 5 runs as the
    # third block and differs from block 1: the replay is thrown away and every block runs —
    # where block 2 is the one that differs.
    model = CountingStack()
    replayed, full = _both(model)
    assert _replayed(replayed) == 0
    assert_same_trace(replayed, full)
    scaled = {o.module for o in full.ops if o.op == "aten.mul.Tensor" and o.phase == "forward"}
    assert scaled == {"blocks.2"}


@pytest.mark.fast
def test_blocks_get_their_own_forward_back(gpt2_tiny):
    model = Stack()
    ampscope.trace(model, {"x": torch.randn(2, 4, 16)}, workload=_train(model), predict=True)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    with pytest.raises(RuntimeError):
        ampscope.trace(model, {"x": torch.randn(2, 4, 8)}, workload=_train(model), predict=True)
    assert all("forward" not in b.__dict__ for b in model.blocks)


@pytest.mark.fast
def test_a_real_run_replays_nothing():
    model = Stack()
    trace = ampscope.trace(model, {"x": torch.randn(2, 4, 16)}, workload=_train(model),
                           predict=False)
    assert _replayed(trace) == 0


def test_a_failure_of_the_replay_itself_falls_back_to_every_block(monkeypatch):
    # Not the model's error: ampscope's own bookkeeping around a block fails (here, made to).
    from ampscope.runs.replayed import Replayed

    def broken(*args, **kwargs):
        raise KeyError("made to fail")

    replayed_before, full = _both(Stack())
    monkeypatch.setattr(Replayed, "_backward", staticmethod(broken))
    replayed, _ = _both(Stack())
    assert _replayed(replayed_before) > 0 and _replayed(replayed) == 0
    assert_same_trace(replayed, full)


class EarlyExit(Stack):
    """Stops after six of its nine blocks: the replayed ones are never confirmed by the
    second-to-last block, so nothing stays replayed."""

    def forward(self, x):
        x = self.embed(x)
        for block in list(self.blocks)[:6]:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("backward", [True, False])
def test_replayed_blocks_never_confirmed_by_their_twin_are_traced_again(backward):
    # With a backward pass the replayed blocks' backward finds no recorded twin; without one,
    # the capture's end finds the pass unconfirmed: either way every block runs again.
    model = EarlyExit(n=9)
    replayed, full = _both(model, backward=backward)
    assert _replayed(replayed) == 0
    assert_same_trace(replayed, full)


def test_the_cli_says_how_many_calls_it_replayed_and_every_block_turns_it_off(capsys):
    import json

    from ampscope.cli import main

    runs = {}
    for flag in ([], ["--every-block"]):
        assert main(["trace", "gpt2", "--seq", "8", "--json", "-", *flag]) == 0
        runs[bool(flag)] = json.loads(capsys.readouterr().out)
    # gpt2's 12 blocks: 0, 1, 10 and 11 run, 2-9 replay
    assert [n for n in runs[False]["notes"] if REPLAY_NOTE in n][0].startswith("8 calls")
    assert not [n for n in runs[True]["notes"] if REPLAY_NOTE in n]
    assert runs[False]["ops"] == runs[True]["ops"]


# Architectures outside the zoo, from their transformers configs at tiny sizes (6 layers).
_TINY_HF = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=128, max_position_embeddings=64)
OTHERS = {
    # an activation module made per layer (functools.partial(gelu, approximate="tanh"))
    "gemma": ("GemmaConfig", dict(_TINY_HF, num_key_value_heads=1, head_dim=16), True),
    "gpt-bigcode": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=6, n_head=4, multi_query=True,
                                             vocab_size=128, n_positions=64), True),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                                    multi_query=True, new_decoder_architecture=False,
                                    vocab_size=128), True),
    # sliding-window attention on every other layer: the layers are not alike
    "gemma2": ("Gemma2Config", dict(_TINY_HF, num_key_value_heads=1, head_dim=16), False),
}


@pytest.mark.parametrize("name", list(OTHERS))
def test_other_architectures_replay_exactly_or_not_at_all(name):
    transformers = pytest.importorskip("transformers")
    config_class, fields, replays = OTHERS[name]
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**fields))
    options = {"setting": "cuda:fp32+amp-bf16", "seq": 32, "predict": True}
    replayed = ampscope.trace(model, **options)
    full = ampscope.trace(model, **options, every_block=True)
    assert (_replayed(replayed) > 0) == replays
    assert_same_trace(replayed, full)


class Wider(Block):
    """A first layer unlike the rest (as dense layers before mixture-of-experts ones)."""

    def __init__(self, layer_idx: int, width: int = 16):
        super().__init__(layer_idx, width)
        self.gate = nn.Parameter(torch.ones(width))

    def forward(self, x, extra=None):
        return super().forward(x * self.gate, extra)


class FirstUnlike(Stack):
    def __init__(self):
        super().__init__(n=8)
        self.blocks[0] = Wider(0)


def test_a_stretch_of_alike_blocks_after_an_unlike_one_replays():
    model = FirstUnlike()
    [(names, blocks)] = repeated_runs(model)
    assert names == [f"blocks.{i}" for i in range(1, 8)]  # block 0 is not one of them
    replayed, full = _both(model)
    assert _replayed(replayed) == 3  # blocks 3, 4, 5: 1-2 and 6-7 are recorded
    assert_same_trace(replayed, full)
