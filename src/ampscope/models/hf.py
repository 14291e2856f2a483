"""Hugging Face causal LMs: a zoo of published architectures, local checkpoints, and the adapter.

Every zoo entry is the published configuration of a real model, built from its config with
random weights, and every model in float32 with SDPA attention: why, in docs/models.md ("The
Hugging Face zoo"). On the meta device nothing is allocated, so even llama-3-70b can be counted
on a laptop.

`transformers` is imported only here and only when an HF spec is resolved (it takes seconds).

Namesakes, the same concern at another layer: `integrations/hf.py`."""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
from torch import nn

from ampscope.errors import AmpscopeError, first_line
from ampscope.models.base import Batch, LoadedModel
from ampscope.models.catalog import Presets, split_spec
from ampscope.models.weight_files import load_checkpoint, shards, torch_checkpoint
from ampscope.quiet import loggers_quiet
from ampscope.torchcompat.ops import PYTREE_LOGGER

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    class _CausalLM(Protocol):
        """What ampscope uses of the transformers causal LM (an AutoModelForCausalLM class)
        that `hf_loaded_model` wraps, typed as an nn.Module where it is passed around: its
        config, its loss_type, and `generate`, which returns the ids (a LongTensor) unless
        asked for a dict (return_dict_in_generate, never asked here)."""

        config: PretrainedConfig
        loss_type: str | None

        def generate(self, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor: ...

# The attention kernel every HF model is built with where it has one: the same one nanoGPT
# and nanochat call.
ATTN_IMPLEMENTATION = "sdpa"

log = logging.getLogger(__name__)
_Built = TypeVar("_Built")  # what `_with_attention`'s `make` builds


def transformers_module():
    try:
        _torchao_quietly()
        import transformers
    except ImportError as e:
        raise AmpscopeError(
            "Hugging Face models need transformers; install it with `pip install 'ampscope[hf]'`"
        ) from e
    return transformers


def dtype_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    """transformers renamed `torch_dtype` to `dtype` in 4.56 and warns on the old name since."""
    major, minor = (int(part) for part in transformers_module().__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


def _zoo_config(model_type: str, **fields: Any) -> PretrainedConfig:
    """A zoo entry's config.json fields (catalog.py) as its config, set to build in float32
    with SDPA attention (unless the spec names another: `gpt2-hf[attn_implementation=eager]`)."""
    fields.setdefault("attn_implementation", ATTN_IMPLEMENTATION)
    return transformers_module().AutoConfig.for_model(
        model_type, **fields, **dtype_kwargs(torch.float32)
    )


# The zoo: every published architecture of catalog.py, name → config, made on look-up.
ZOO: Presets[PretrainedConfig] = Presets("hf", _zoo_config)


def build_from_config(config: PretrainedConfig, *, device: str | torch.device,
                      attn_implementation: str | None = None) -> nn.Module:
    """Random-weight causal LM from `config` on `device` (meta allocates nothing), with
    `attn_implementation` (None: `_with_attention`'s)."""
    transformers = transformers_module()
    on_meta = torch.device(device).type == "meta"
    try:
        with quiet_transformers(), torch.device(device), _no_init(on_meta):
            module = _with_attention(
                lambda attention: transformers.AutoModelForCausalLM.from_config(
                    config, attn_implementation=attention, **dtype_kwargs(torch.float32)),
                attn_implementation)
    except ValueError as e:  # "Unrecognized configuration class ... for AutoModelForCausalLM"
        raise AmpscopeError(
            f"cannot build a causal LM from {type(config).__name__}: {first_line(e)}"
        ) from e
    if on_meta:
        module.tie_weights()  # what the skipped init_weights would have done besides initialising
    return module


def _with_attention(make: Callable[[str], _Built], chosen: str | None) -> _Built:
    """`make(attn_implementation)` with `chosen`; with None, SDPA where the model has it (the
    kernel nanoGPT and nanochat call), else the eager attention every transformers model has
    (Gemma 2 has no SDPA path: transformers refuses it with a ValueError, and picks eager
    itself when not told)."""
    if chosen is not None:
        return make(chosen)
    try:
        return make(ATTN_IMPLEMENTATION)
    except ValueError as refused:
        built = make("eager")
        # "Gemma2ForCausalLM does not support an attention implementation through ... yet"
        log.info("%s: built with its eager attention", first_line(refused).split(". ")[0])
        return built


def _no_init(on_meta: bool) -> contextlib.AbstractContextManager:
    """Weight initialisation skipped on the meta device, where there are no values to set.

    transformers skips it itself when it sees the meta device, but a predicted run builds its
    model on the virtual device (runtime/virtual_device.py), which reports the device the run
    stands for: every `normal_` and `kaiming_uniform_` would then be dispatched, for nothing
    (a fifth of a 70B predicted step)."""
    if not on_meta:
        return contextlib.nullcontext()
    from transformers.initialization import no_init_weights

    return no_init_weights()


def load(name: str, *, device: str | torch.device = "cpu",
         target_device: str | None = None) -> LoadedModel:
    """Build zoo entry `name` with random weights (no device-dependent choice to make for
    `target_device`)."""
    attention = split_spec(name)[1].get("attn_implementation")
    return hf_loaded_model(build_from_config(ZOO[name], device=device,
                                             attn_implementation=attention), name=name)


def load_local(path: str | Path, *, device: str | torch.device = "cpu") -> LoadedModel:
    """`hf:PATH`: a config.json file, or a folder with config.json and optionally weights,
    loaded as docs/models.md's table ("Local Hugging Face checkpoints") says; random on the meta
    device."""
    path = Path(path).expanduser()
    if not path.exists():
        raise AmpscopeError(
            f"hf:{path}: no such file or folder; give a config.json or a folder with one"
        )
    if not path.is_dir() and not path.is_file():
        raise AmpscopeError(f"hf:{path}: not a regular file or folder; give a config.json or a "
                            "folder with one")
    folder = path if path.is_dir() else path.parent
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise AmpscopeError(
            f"hf:{path}: no config.json in this folder; save one with config.save_pretrained()"
        )
    name = f"hf:{path}"
    config = _read_config(config_file)
    if torch.device(device).type == "meta" or not path.is_dir():
        return hf_loaded_model(build_from_config(config, device=device), name=name)

    if sorted(folder.glob("*.safetensors")):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            shards(index)  # transformers would open whatever the index names
        module = load_pretrained(folder, config, label=name)
        return hf_loaded_model(module.to(device), name=name)
    checkpoint = torch_checkpoint(folder)
    module = build_from_config(config, device=device)
    if checkpoint is not None:
        load_checkpoint(module, checkpoint, folder)
    return hf_loaded_model(module, name=name)


def load_pretrained(folder: Path, config: PretrainedConfig, *, label: str,
                    **options: Any) -> nn.Module:
    """Load the weights in `folder` (safetensors, or a GGUF file named in `options`) in float32,
    with `config` as given, without touching the network. `label` names the model in errors.

    Weights the checkpoint lacks are refused, as for torch checkpoints: transformers would
    fill them with random values and only log it."""
    from safetensors import SafetensorError

    transformers = transformers_module()
    try:
        with quiet_transformers():
            module, info = _with_attention(
                lambda attention: transformers.AutoModelForCausalLM.from_pretrained(
                    folder,
                    config=config,
                    local_files_only=True,
                    attn_implementation=attention,
                    output_loading_info=True,
                    **dtype_kwargs(torch.float32),
                    **options,
                ),
                None,
            )
    except SafetensorError as e:  # a damaged file, or one that is not safetensors at all
        raise AmpscopeError(
            f"{label}: its .safetensors file cannot be read ({first_line(e)}); save it again "
            "with save_pretrained() or download it again"
        ) from e
    except (OSError, ValueError, RuntimeError) as e:
        raise AmpscopeError(f"{label}: cannot load its weights: {first_line(e)}") from e
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise AmpscopeError(
            f"{label}: checkpoint does not match config.json ({len(missing)} missing keys such "
            f"as {missing[0]!r}); check both come from one model"
        )
    # from_pretrained switches to eval mode; from_config and every other spec leave an
    # nn.Module in its default training mode. Keep all specs alike: the workload decides.
    return module.train()


# transformers' own loggers, and torchao's, which transformers imports while it builds (a CPU
# build of it says it cannot load its CUDA kernels; torch warns about one of its enums).
_NOISY = ("transformers", "torchao", PYTREE_LOGGER)


def _torchao_quietly() -> None:
    """transformers imports torchao when it is installed (the `fp8` extra): imported here first,
    without the log lines a CPU build of it prints on import (its CUDA kernels cannot load)."""
    import importlib.util
    import sys

    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    # A broken install is left for transformers to report, or not, as it would.
    with loggers_quiet(*_NOISY[1:]), contextlib.suppress(Exception):
        import torchao  # noqa: F401


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hold back transformers' log lines, Python warnings and progress bars while it builds or
    loads a model: they would come before ampscope's own one-line answer (or error) on stderr.
    What ampscope needs from them (missing weights, unknown model types) it checks and says
    itself. The logger level and the progress-bar switch are put back as they were."""
    transformers = transformers_module()
    progress_bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights: 100%|..."
    try:
        with loggers_quiet(*_NOISY), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if progress_bar:
            transformers.utils.logging.enable_progress_bar()


def _read_config(config_file: Path) -> PretrainedConfig:
    transformers = transformers_module()
    try:
        config_dict = json.loads(config_file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise AmpscopeError(
            f"cannot read {config_file}: it is not a UTF-8 text file; give the config.json "
            "that config.save_pretrained() writes"
        ) from e
    except (OSError, json.JSONDecodeError) as e:
        raise AmpscopeError(f"cannot read {config_file}: {e}") from e
    if not isinstance(config_dict, dict) or "model_type" not in config_dict:
        raise AmpscopeError(
            f"{config_file} has no model_type; write it with config.save_pretrained()"
        )
    model_type = config_dict.pop("model_type")
    try:
        with quiet_transformers():
            config = transformers.AutoConfig.for_model(model_type, **config_dict)
    except ValueError as e:  # unknown model_type
        raise AmpscopeError(f"{config_file}: {first_line(e)}") from e
    config._attn_implementation = ATTN_IMPLEMENTATION  # noqa: SLF001 - transformers' setting
    return config


def _valid_token_id(config: PretrainedConfig, vocab_size: int) -> int:
    """A token id to pad with: the config's pad or eos token when it exists in the vocab, else 0."""
    for candidate in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if isinstance(candidate, int) and 0 <= candidate < vocab_size:
            return candidate
    return 0


def _max_seq_len(config: PretrainedConfig) -> int:
    for attr in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    raise AmpscopeError(
        f"{type(config).__name__} names no context length (max_position_embeddings)"
    )


# `use_cache=False` on every plain forward: otherwise HF builds a KV cache whose updates would
# show up in forward and train traces (`generate` still uses one). Passed per call rather than
# set on the config, so a user's model is left as it was.
def hf_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    # HF causal LMs shift the labels internally: the labels are the input ids themselves.
    return module(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss


def hf_logits(module: nn.Module, batch: Batch) -> torch.Tensor:
    return module(input_ids=batch["input_ids"], use_cache=False).logits


def hf_generate(
    module: nn.Module, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator
) -> torch.Tensor:
    """Sample through HF's `generate`, which keeps a KV cache like nanochat's sampler.

    HF takes no `torch.Generator`: sampling draws from the global RNG, which the generate
    workload seeds and `precision.applied` restores; `generator` is unused. `eos_token_id=None` makes every run produce exactly
    `max_new_tokens` tokens (a random model samples its eos token now and then).
    """
    del generator
    model = cast("_CausalLM", module)
    vocab_size = model.config.vocab_size
    return model.generate(
        idx,
        attention_mask=torch.ones_like(idx),  # no padding; also silences HF's warning
        max_new_tokens=max_new_tokens,
        do_sample=True,
        top_k=50,
        pad_token_id=_valid_token_id(model.config, vocab_size),
        eos_token_id=None,
    )


def hf_loaded_model(module: nn.Module, *, name: str, built_here: bool = True) -> LoadedModel:
    """Wrap a transformers `PreTrainedModel` (causal LM) in a LoadedModel.

    A model the user passed in (`built_here=False`) is not touched at all.
    """
    model = cast("_CausalLM", module)
    config = model.config
    # transformers 5 derives the loss from the class name; for GPT2LMHeadModel that fails and
    # every first loss logs "`loss_type=None` ... unrecognized. Using the default loss:
    # `ForCausalLMLoss`". Name that default up front on models we built: same loss, no log.
    if built_here and getattr(module, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return LoadedModel(
        name=name,
        module=module,
        vocab_size=config.vocab_size,
        max_seq_len=_max_seq_len(config),
        family="hf",
        input_name="input_ids",
        target_name="labels",
        targets_are_shifted_inputs=False,
        loss_fn=hf_loss,
        logits_fn=hf_logits,
        generate_fn=hf_generate,
        notes=["generate() samples with HF's generate and its KV cache, from the global RNG"],
    )
