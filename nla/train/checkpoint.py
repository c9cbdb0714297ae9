"""Checkpoints on disk: RNG and training state, checkpoint discovery.

Training state is saved as plain tensors / dicts and loaded with ``torch.load(weights_only=True)``:
nothing is ever unpickled. A checkpoint directory appears whole or not at all
(``nla.util.checkpoint_files.atomic_dir``, which datagen's model conversions use too).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nla.train.data import DataCursor

TRAINING_STATE_FILE = "training_state.pt"


# ---------------------------------------------------------------- RNG & training state
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as plain tensors / tuples (safe for weights_only loads)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gauss": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@dataclass
class TrainingState:
    """What :func:`load_training_state` returns; ``optimizer``/``scheduler`` are state dicts."""

    step: int
    data_cursor: dict[str, int]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    rng: dict[str, Any] | None
    extra: dict[str, Any]


def save_training_state(
    dir: str | os.PathLike,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    step: int,
    data_cursor: DataCursor | dict[str, int],
    rng: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``training_state.pt`` into ``dir`` (the checkpoint being built, usually an atomic_dir).

    ``rng`` defaults to :func:`capture_rng_state` now. ``extra`` holds small plain values
    (ints, floats, strings, tensors) a trainer needs back, e.g. counters.
    """
    cursor = data_cursor.state_dict() if isinstance(data_cursor, DataCursor) else dict(data_cursor)
    payload = {
        "step": int(step),
        "data_cursor": cursor,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng if rng is not None else capture_rng_state(),
        "extra": extra or {},
    }
    path = Path(dir) / TRAINING_STATE_FILE
    torch.save(payload, path)
    return path


def load_state_file(path: str | os.PathLike, what: str, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` (nothing is unpickled), with a damaged or truncated file
    named instead of torch's zip-reader message."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise ValueError(
            f"{path}: not a readable {what} ({' '.join(str(err).split())[:160]}); it is truncated or damaged (a "
            "kill while it was written?): resume from an earlier checkpoint, or start afresh with --overwrite"
        ) from None


def load_training_state(dir: str | os.PathLike, map_location: str | torch.device = "cpu") -> TrainingState:
    """Read ``training_state.pt`` from ``dir`` with ``weights_only=True`` (no unpickling)."""
    path = Path(dir) / TRAINING_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no training state at {path}: this checkpoint cannot be resumed (it was saved without "
            "optimizer state, or the save was interrupted); start a fresh run or pick another checkpoint"
        )
    payload = load_state_file(path, "training state", map_location)
    return TrainingState(
        step=int(payload["step"]),
        data_cursor=dict(payload["data_cursor"]),
        optimizer=payload["optimizer"],
        scheduler=payload["scheduler"],
        rng=payload["rng"],
        extra=dict(payload.get("extra") or {}),
    )


def apply_training_state(
    state: TrainingState,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    restore_rng: bool = True,
) -> None:
    optimizer.load_state_dict(state.optimizer)
    if scheduler is not None and state.scheduler is not None:
        scheduler.load_state_dict(state.scheduler)
    if restore_rng and state.rng is not None:
        restore_rng_state(state.rng)


# ---------------------------------------------------------------- checkpoint discovery
def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    """The highest ``step_*`` directory under ``ckpt_root`` holding a training state, or None."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return None
    cands = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / TRAINING_STATE_FILE).is_file()),
        key=lambda p: p.name,
    )
    return cands[-1] if cands else None


def prune_checkpoints(ckpt_root: str | os.PathLike, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` ``step_*`` directories (``keep_last <= 0`` keeps all)."""
    if keep_last <= 0:
        return
    root = Path(ckpt_root)
    dirs = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")), key=lambda p: p.name)
    for p in dirs[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)


def checkpoints_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def find_resume_checkpoint(out_dir: str | os.PathLike) -> Path:
    """The checkpoint ``--resume`` continues from; a clear error when there is none."""
    root = checkpoints_root(out_dir)
    last = latest_checkpoint(root)
    if last is None:
        raise FileNotFoundError(
            f"--resume: no resumable checkpoint under {root} (expected step_* dirs with {TRAINING_STATE_FILE}); "
            "run without --resume to start fresh, or point out_dir at the earlier run"
        )
    return last
