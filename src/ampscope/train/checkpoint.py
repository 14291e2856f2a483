"""Checkpoints in safetensors, complete enough to resume a run bit for bit.

A checkpoint is a folder `OUT/step-000100/` of three files, `model.safetensors`,
`optimizer.safetensors` and `trainer.safetensors`, each listed with what it holds in
docs/training.md ("Checkpoints and exact resume").

Exact resume needs all of it: the same weights and Adam moments, the same step (the learning
rate schedule and Adam's bias correction depend on it), the same next batch, and the same
random state. safetensors rather than `torch.save`: loading one runs no pickled code.
Floats in the JSON round-trip exactly (Python writes the shortest repr that reads back equal).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ampscope.errors import AmpscopeError, first_line

FORMAT = "ampscope.train-checkpoint/1"


def _safetensors():
    """safetensors' torch API and its `safe_open` (an optional dependency)."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:
        raise AmpscopeError("checkpoints are written with safetensors: "
                            "pip install safetensors") from e
    return safetensors.torch, safetensors.safe_open


def checkpoint_dir(out: str | Path, step: int) -> Path:
    return Path(out) / f"step-{step:06d}"


def latest_checkpoint(path: str | Path) -> Path:
    """`path` itself when it is a checkpoint, else its newest `step-*` checkpoint."""
    path = Path(path)
    if (path / "trainer.safetensors").is_file():
        return path
    found = sorted(p for p in path.glob("step-*") if (p / "trainer.safetensors").is_file())
    if not found:
        raise AmpscopeError(f"no checkpoint in {path} (expected a step-NNNNNN folder written "
                            "by `ampscope train --out`)")
    return found[-1]


def save(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
         scaler: torch.amp.GradScaler | None, step: int, loader: dict, config: dict,
         history: dict) -> Path:
    """Write a checkpoint folder; written under a temporary name first, so an interrupted save
    never leaves a half-written checkpoint where `--resume` would find it. A failed write (a
    full disk, a folder that went away) is one sentence, and leaves no temporary folder."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write(tmp, model=model, optimizer=optimizer, scaler=scaler, step=step, loader=loader,
               config=config, history=history)
        # The old checkpoint stays until the new one is complete and in its place.
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise AmpscopeError(f"cannot write the checkpoint {path}: {e.strerror or e}; free some "
                            "space or give another --out") from e
    return path


def _write(tmp: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
           scaler: torch.amp.GradScaler | None, step: int, loader: dict, config: dict,
           history: dict) -> None:
    st, _ = _safetensors()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    st.save_model(model, str(tmp / "model.safetensors"))  # drops the tied duplicate

    state = optimizer.state_dict()
    tensors, other = {}, {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                other[f"{index}.{key}"] = value
    meta = {"param_groups": json.dumps(state["param_groups"]), "other": json.dumps(other)}
    st.save_file(tensors, str(tmp / "optimizer.safetensors"), metadata=meta)

    rng = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"rng.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    trainer = {"format": FORMAT, "step": step, "loader": loader, "config": config,
               "scaler": scaler.state_dict() if scaler is not None else None,
               "history": history}
    st.save_file(rng, str(tmp / "trainer.safetensors"), metadata={"trainer": json.dumps(trainer)})


def _metadata(path: Path) -> dict[str, str]:
    _, safe_open = _safetensors()
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


@dataclass
class Checkpoint:
    """A checkpoint read back: what `restore` puts in place, and the run's own record."""

    path: Path
    step: int
    loader: dict
    config: dict
    scaler: dict | None
    history: dict
    rng: dict[str, torch.Tensor]


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """A checkpoint that cannot be read (a damaged or missing file, foreign metadata) is one
    sentence that says what to do, not safetensors' or json's own exception."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise AmpscopeError(f"cannot read the checkpoint {path} ({first_line(e)}); resume from "
                            "another step-NNNNNN folder, or train again without --resume") from e


def read(path: str | Path) -> Checkpoint:
    st, _ = _safetensors()
    path = latest_checkpoint(path)
    with _readable(path):
        meta = json.loads(_metadata(path / "trainer.safetensors").get("trainer", "{}"))
        rng = st.load_file(str(path / "trainer.safetensors"))
        if meta.get("format") != FORMAT:
            raise AmpscopeError(f"{path} is not an ampscope training checkpoint")
        return Checkpoint(path, meta["step"], meta["loader"], meta["config"], meta["scaler"],
                          meta["history"], rng)


def restore(checkpoint: Checkpoint, *, model: nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler | None) -> None:
    """Put the weights, optimizer state, scaler state and RNG states back in place."""
    st, _ = _safetensors()
    with _readable(checkpoint.path):
        missing, unexpected = st.load_model(model, str(checkpoint.path / "model.safetensors"),
                                            strict=False)
        if missing or unexpected:
            raise AmpscopeError(f"{checkpoint.path} holds another model's weights "
                                f"({len(missing)} missing, {len(unexpected)} unexpected tensors)")
        path = checkpoint.path / "optimizer.safetensors"
        state: dict[int, dict] = {}
        for key, tensor in st.load_file(str(path)).items():
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = tensor
        meta = _metadata(path)
        for key, value in json.loads(meta.get("other", "{}")).items():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = value
        groups = json.loads(meta["param_groups"])
    for group in groups:  # JSON has no tuples; AdamW's betas were one
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    # load_state_dict moves each moment to its parameter's device and dtype, and `step` where
    # AdamW keeps it: on the CPU, or on the parameter's device when fused (CUDA) or capturable.
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if scaler is not None and checkpoint.scaler is not None:
        scaler.load_state_dict(checkpoint.scaler)
    torch.set_rng_state(checkpoint.rng["rng.cpu"])
    cuda = [checkpoint.rng[f"rng.cuda.{i}"]
            for i in range(sum(k.startswith("rng.cuda.") for k in checkpoint.rng))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
