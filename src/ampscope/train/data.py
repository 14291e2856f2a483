"""Training data with no download: an embedded corpus, a train/validation split, a loader.

The default corpus is the documentation that ships inside every CPython (`pydoc_data.topics`;
what it holds, and why that one: docs/training.md, "Data and tokenizer, with no download"), and
`DataLoaderLite` is build-nanogpt's loader, whose position is two integers a checkpoint saves
(docs/training.md, "What the trainer does").
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ampscope.errors import AmpscopeError
from ampscope.train.tokenizer import Tokenizer

DEFAULT_CORPUS = "pydoc_data.topics"  # how a run without --data names its data


def default_corpus() -> str:
    """CPython's bundled help texts, topics in sorted order, separated by blank lines."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split the stdlib's docs into another package
        raise AmpscopeError("this Python has no pydoc_data (its bundled documentation); "
                            "give a text file with --data PATH") from e
    return "\n\n".join(topics[name] for name in sorted(topics))


def read_text(path: str | None) -> str:
    """The text to train on: the file at `path` (UTF-8), or the default corpus."""
    if path is None:
        return default_corpus()
    if Path(path).exists() and not Path(path).is_dir() and not Path(path).is_file():
        raise AmpscopeError(f"cannot read --data {path}: not a regular file")  # a FIFO blocks
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise AmpscopeError(f"cannot read --data {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise AmpscopeError(f"{path} is not UTF-8 text (byte {e.start} is not); give a text "
                            "file with --data") from e


@functools.lru_cache(maxsize=4)
def _cached_tokens(path: str | None, mtime: float | None, tokenizer: Tokenizer) -> torch.Tensor:
    del mtime  # part of the cache key only: an edited file is read again
    ids = tokenizer.encode(read_text(path))
    # int32 holds any id below 2**31; the loader converts each batch to what the model takes.
    return torch.tensor(ids, dtype=torch.int32)


def load_tokens(path: str | None, tokenizer: Tokenizer) -> torch.Tensor:
    """The whole text as token ids (int32), cached per process: a ladder of benchmark rungs
    tokenizes once."""
    mtime = os.path.getmtime(path) if path is not None and os.path.exists(path) else None
    return _cached_tokens(path, mtime, tokenizer)


@dataclass(frozen=True)
class Split:
    train: torch.Tensor
    val: torch.Tensor


def split(tokens: torch.Tensor, val_fraction: float, batch: int, seq: int,
          source: str) -> Split:
    """The first (1 - val_fraction) of the tokens for training, the rest for validation.

    A contiguous split, not a shuffled one: validation text is text the model never saw.
    Both parts must hold at least one batch (B·T tokens plus the one extra target).
    """
    if not 0 < val_fraction < 1:
        raise AmpscopeError(f"the validation fraction must be between 0 and 1, not {val_fraction}")
    n_val = int(len(tokens) * val_fraction)
    parts = Split(train=tokens[: len(tokens) - n_val], val=tokens[len(tokens) - n_val :])
    need = batch * seq + 1
    for name, part in (("training", parts.train), ("validation", parts.val)):
        if len(part) < need:
            raise AmpscopeError(
                f"{source} has {len(tokens):,} tokens; its {name} part ({len(part):,}) is "
                f"shorter than one batch of {batch}×{seq} (+1); give more text or a smaller "
                "--batch/--seq")
    return parts


class DataLoaderLite:
    """Batches (x, y) of shape (B, T) taken in order from a token stream; y is x shifted by one.

    Batch i covers tokens [p, p + B·T] with p = i·B·T: x is the first B·T of them and y the
    last B·T, so y[b, t] is the token that follows x[b, t]. When the next batch would run past
    the end, the loader goes back to the start (one more epoch).
    """

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int):
        self.tokens, self.B, self.T = tokens, batch, seq
        self.position, self.epoch = 0, 0  # a resumed run sets them from its checkpoint

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.B, self.T
        buf = self.tokens[self.position : self.position + B * T + 1]
        x = buf[:-1].view(B, T)  # inputs
        y = buf[1:].view(B, T)  # targets
        self.position += B * T
        if self.position + B * T + 1 > len(self.tokens):
            self.position, self.epoch = 0, self.epoch + 1
        return x, y

    def state(self) -> dict[str, int]:
        """Where the loader is: all a checkpoint needs to continue the same batch sequence."""
        return {"position": self.position, "epoch": self.epoch}
