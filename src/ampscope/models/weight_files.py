"""The weight files of a local Hugging Face folder (`hf:PATH`, models/hf.py): the shards an
index names, each held to a regular file of the folder, and torch checkpoints loaded with
`torch.load(weights_only=True)`, which cannot run code from the file, and checked against the
model they are loaded into.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ampscope.errors import AmpscopeError, first_line


def torch_checkpoint(folder: Path) -> list[Path] | None:
    """The torch checkpoint file(s) in `folder`, or None when it has none."""
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        return shards(index)
    files = sorted(p for ext in ("bin", "pt", "pth") for p in folder.glob(f"*.{ext}"))
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise AmpscopeError(f"hf:{folder}: several checkpoints ({names}); keep one per folder")
    return [_inside(folder, p.name) for p in files] or None


def shards(index: Path) -> list[Path]:
    """The shards a sharded checkpoint's index names, each checked to lie in its folder (see
    `_inside`): an index is data from elsewhere, never a way out of the folder."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()), key=str)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise AmpscopeError(
            f"hf:{index.parent}: cannot read {index.name} ({type(e).__name__}); it should map "
            'each weight to its shard: {"weight_map": {"name": "file", ...}}'
        ) from e
    return [_inside(index.parent, name) for name in names]


def _inside(folder: Path, name: object) -> Path:
    """`folder / name`, refused unless it is a regular file of the folder: a plain file name
    (no `..`, no absolute path), and no symlink out of it except into the Hugging Face cache's
    `blobs` folder, where a hub snapshot's files link to."""
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise AmpscopeError(
            f"hf:{folder}: its index names the shard {name!r} outside the folder; a shard "
            "must be a file name in the folder itself"
        )
    path = folder / name
    real, home = path.resolve(), folder.resolve()
    blobs = home.parent.parent / "blobs"
    if real.parent != home and real.parent != blobs:
        raise AmpscopeError(
            f"hf:{folder}: {name} links to {real}, outside the folder; copy the file in instead"
        )
    if not real.is_file():
        raise AmpscopeError(f"hf:{folder}: {name} is missing or not a regular file")
    return path


def load_checkpoint(module: nn.Module, files: list[Path], folder: Path) -> None:
    """Load the torch checkpoint `files` of `folder` into `module`, refusing missing or
    unexpected weights (a tied weight may be stored under one of its names only)."""
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only refuses pickled code; say so in one line
            raise AmpscopeError(
                f"cannot load {file} with weights_only=True: {first_line(e)}"
            ) from e
        # Training scripts often save {"model": state_dict, "optimizer": ..., ...}.
        for key in ("state_dict", "model"):
            if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
                loaded = loaded[key]
        state.update(loaded)
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches raise even with strict=False
        detail = str(e).strip().splitlines()[-1].strip()  # the first line only names the class
        raise AmpscopeError(f"hf:{folder}: checkpoint does not match config.json ({detail})") from e
    # A checkpoint may store a tied weight under one of its names only (lm_head = embedding).
    names_by_param: dict[int, list[str]] = {}
    for param_name, param in module.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(param_name)
    aliases = {n: names for names in names_by_param.values() for n in names}
    missing = [k for k in missing if not any(alias in state for alias in aliases.get(k, []))]
    if missing or unexpected:
        keys, kind = (missing, "missing") if missing else (unexpected, "unexpected")
        problem = f"{len(keys)} {kind} keys such as {keys[0]!r}"
        raise AmpscopeError(
            f"hf:{folder}: checkpoint does not match config.json ({problem}); check both come from one model"
        )
