"""Facts about the reference models: sizes, init, dtypes, FLOP formulas, sampling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ampscope.models import gpt2, nanochat

ALL_PRESETS = [(gpt2, p) for p in gpt2.PRESETS] + [(nanochat, p) for p in nanochat.PRESETS]


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _train_batch(lm, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """A training batch as the models' own loaders make it: contiguous targets.

    `LoadedModel.make_batch` slices targets out of a (B, T+1) tensor, which leaves them
    non-contiguous, and both reference models (like nanoGPT and nanochat) flatten targets with
    `.view(-1)`, which needs contiguous memory.
    """
    return {k: v.contiguous() for k, v in lm.make_batch(batch, seq, "train", _generator()).items()}


# --- sizes -------------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize(("family", "preset"), ALL_PRESETS)
def test_every_preset_builds_on_meta(family, preset):
    lm = family.load(preset, device="meta")
    assert lm.name == preset
    assert lm.family == family.__name__.rsplit(".", 1)[-1]
    assert all(p.device.type == "meta" for p in lm.module.parameters())
    assert all(b.device.type == "meta" for b in lm.module.buffers())
    assert lm.vocab_size == lm.module.config.vocab_size
    assert lm.num_parameters > 0


@pytest.mark.fast
def test_gpt2_parameter_count_counts_tied_weights_once():
    lm = gpt2.load("gpt2", device="meta")
    assert lm.num_parameters == 124_439_808
    assert lm.max_seq_len == 1024
    model = lm.module
    assert model.transformer.wte.weight is model.lm_head.weight


def test_gpt2_medium_parameter_count():
    # V*C + T*C + L*(12*C^2 + 13*C) + 2*C, C=1024, L=24
    V, T, L, C = 50257, 1024, 24, 1024
    assert gpt2.load("gpt2-medium", device="meta").num_parameters == (
        V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    )


@pytest.mark.fast
def test_nanochat_d20_parameter_count_by_hand():
    # depth 20: C = 64*20 = 1280, 10 heads of 128, kv heads = heads, V = 2**16.
    V, L, C = 2**16, 20, 1280
    embeddings = 2 * V * C  # wte and lm_head, untied
    attn = 4 * C * C  # c_q, c_k, c_v, c_proj (n_kv_head == n_head), no biases
    mlp = 8 * C * C  # c_fc C->4C and c_proj 4C->C
    lm = nanochat.load("nanochat-d20", device="meta")
    assert lm.num_parameters == embeddings + L * (attn + mlp) == 560_988_160
    config = lm.module.config
    assert (config.n_head, config.n_kv_head, config.sequence_len) == (10, 10, 2048)
    assert lm.module.transformer.wte.weight is not lm.module.lm_head.weight


# --- init --------------------------------------------------------------------------------------


def test_gpt2_residual_projection_init_std():
    config = gpt2.GPTConfig(block_size=8, vocab_size=64, n_layer=8, n_head=4, n_embd=256)
    model = gpt2.GPT(config)
    proj = torch.cat(
        [p.flatten() for n, p in model.named_parameters() if n.endswith("c_proj.weight")]
    )
    fc = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("c_fc.weight")])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.01)
    assert fc.std().item() == pytest.approx(0.02, rel=0.01)
    biases = [p for n, p in model.named_parameters() if n.endswith("attn.c_attn.bias")]
    assert all(torch.count_nonzero(b) == 0 for b in biases)


# --- dtypes ------------------------------------------------------------------------------------


def test_nanochat_dtypes_on_cpu():
    lm = nanochat.load("nanochat-tiny")
    model = lm.module
    assert model.cos.dtype == model.sin.dtype == torch.bfloat16
    assert model.cos.shape == (1, 64 * 10, 1, 32)  # head dim 64 -> 32 frequencies
    assert "cos" not in model.state_dict()  # derived, not checkpointed
    assert model.transformer.wte.weight.dtype == torch.float32  # bf16 only on CUDA
    assert (lm.train_ids_dtype, lm.generate_ids_dtype) == (torch.int32, torch.int64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nanochat_embedding_is_bf16_on_cuda():
    model = nanochat.load("nanochat-tiny", device="cuda").module
    assert model.transformer.wte.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32


def test_nanochat_train_step_int32_ids_fp32_logits_under_autocast(monkeypatch):
    lm = nanochat.load("nanochat-tiny")
    batch = _train_batch(lm, 2, 16)
    assert batch["idx"].dtype == torch.int32

    lm_head_out: list[torch.dtype] = []
    lm.module.lm_head.register_forward_hook(lambda m, i, o: lm_head_out.append(o.dtype))
    ce_in: list[torch.dtype] = []
    cross_entropy = F.cross_entropy

    def spy(logits, *args, **kwargs):
        ce_in.append(logits.dtype)
        return cross_entropy(logits, *args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm.loss(batch)
        logits = lm.logits({"idx": batch["idx"]})
    loss.backward()

    assert lm_head_out == [torch.bfloat16, torch.bfloat16]  # autocast ran lm_head in bf16
    assert ce_in == [torch.float32]  # ... and the model cast the logits up before the loss
    assert logits.dtype == torch.float32
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert lm.module.transformer.wte.weight.grad is not None
    assert logits.abs().max() < 15.0  # softcapped


def test_gpt2_forward_follows_input_dtype():
    lm = gpt2.load("gpt2-tiny")
    batch = _train_batch(lm, 2, 16)
    logits, loss = lm.module(batch["idx"], batch["targets"])
    assert logits.shape == (2, 16, 512) and logits.dtype == torch.float32
    assert lm.module(batch["idx"])[1] is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lm.logits({"idx": batch["idx"]}).dtype == torch.bfloat16  # no explicit upcast


# --- FLOPs -------------------------------------------------------------------------------------


def _counted_train_flops(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> int:
    # The math kernel runs attention as matmuls the counter sees (the CPU flash kernel counts 0).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(idx, targets)
        loss = out[1] if isinstance(out, tuple) else out
        loss.backward()
    return counter.get_total_flops()


def test_nanochat_estimate_flops_equals_counted():
    lm = nanochat.load("nanochat-tiny")
    B, T = 2, 16
    batch = _train_batch(lm, B, T)
    counted = _counted_train_flops(lm.module, batch["idx"], batch["targets"])
    assert lm.module.estimate_flops(T) * B * T == counted


def test_gpt2_estimate_flops_overcounts_exactly_biases_and_layernorms():
    lm = gpt2.load("gpt2-tiny")
    B, T = 2, 16
    batch = _train_batch(lm, B, T)
    counted = _counted_train_flops(lm.module, batch["idx"], batch["targets"])
    L, C = 2, 64
    # Per block: biases of c_attn (3C), attn.c_proj (C), c_fc (4C), mlp.c_proj (C), and two
    # LayerNorms (2 * 2C); plus ln_f (2C). None of them is in a matmul the counter sees.
    no_matmul_params = L * (3 * C + C + 4 * C + C + 2 * 2 * C) + 2 * C
    assert lm.module.estimate_flops(T) * B * T - counted == 6 * B * T * no_matmul_params


# --- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "preset"), [(gpt2, "gpt2-tiny"), (nanochat, "nanochat-tiny")])
def test_generate_shape_and_dtype(family, preset):
    lm = family.load(preset)
    prompt = torch.randint(0, lm.vocab_size, (2, 5), generator=_generator(), dtype=torch.int32)
    out = lm.generate(prompt, 4, _generator(1))
    assert out.shape == (2, 9) and out.dtype == torch.int64
    assert torch.equal(out[:, :5], prompt.long())
    again = lm.generate(prompt, 4, _generator(1))
    assert torch.equal(out, again)  # sampling draws only from the given generator


def test_gpt2_generate_crops_to_block_size():
    lm = gpt2.load("gpt2-tiny")
    prompt = torch.zeros(1, 64, dtype=torch.int64)
    assert lm.generate(prompt, 2, _generator()).shape == (1, 66)


def test_nanochat_kv_cache_decode_matches_no_cache_greedy():
    model = nanochat.load("nanochat-tiny").module
    prompt = torch.randint(0, 512, (2, 6), generator=_generator())
    steps = 8

    idx = prompt
    for _ in range(steps):  # reference: rerun the whole sequence every step, no cache
        logits = model(idx)[:, -1, :]
        idx = torch.cat((idx, logits.argmax(dim=-1, keepdim=True)), dim=1)

    assert torch.equal(model.generate(prompt, steps, temperature=0.0), idx)
    assert torch.equal(model.generate(prompt, steps, top_k=1, generator=_generator()), idx)

    # The cached logits of the last token equal the full forward's, not just their argmax.
    cache = nanochat.KVCache(model.config.n_layer, max_len=idx.size(1))
    model(idx[:, :-1], kv_cache=cache)
    cached = model(idx[:, -1:], kv_cache=cache)[:, -1]
    torch.testing.assert_close(cached, model(idx)[:, -1], rtol=1e-5, atol=1e-5)
    assert cache.k[0].shape == (2, 1, idx.size(1), 64)  # one kv head (GQA), full length
