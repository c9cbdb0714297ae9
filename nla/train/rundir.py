"""A run directory belongs to one run: refuse to mix runs, check configs on resume, clear stale temp dirs.

Used by ``nla train`` and ``nla rl`` before any work starts:

1. Temporary checkpoint directories that a killed save left behind (``checkpoints/.step_*.tmp-*``
   and ``.old-*``; up to a full checkpoint each) are removed, with a log line. The last
   complete checkpoint is never touched: saves are atomic (docs/design.md §3.3).
2. A directory that already holds checkpoints is refused unless ``--resume`` (continue it) or
   ``--overwrite`` (delete it and start over): a fresh run used to write its checkpoints next
   to the old run's, and ``--resume`` picked whichever was newest.
3. ``--resume`` compares the new config with the one saved in the last checkpoint, field by
   field (a config section, such as RL's ``loss``, field by field too, named by its dotted
   path); any difference outside :data:`RESUME_MAY_CHANGE` is refused with the fields named
   (resuming with another lr or step count used to continue silently with the old one's state).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from nla.util.validation import InputError, load_yaml

logger = logging.getLogger(__name__)

__all__ = ["ADDED_FIELDS", "RESUME_MAY_CHANGE", "RunDirError", "prepare_run_dir", "remove_stale_temp_dirs"]

# Fields that only say how this invocation runs or reports, not what it trains; a field of a
# config section (RL) is named by its dotted path.
RESUME_MAY_CHANGE = frozenset({
    "stop_after_steps", "progress", "tensorboard", "device", "keep_last", "log_every", "eval_every", "save_every",
    "eval_max_rows", "checkpointing.keep_last", "checkpointing.save_every", "backend.ray_address",
    "allow_mixed_provenance", "out_dir",  # a run copied or moved elsewhere is still that run
})


# Fields added after runs were saved without them, with the default that keeps such a run what it
# was: a run saved before a field existed resumes when the field is at this default now.
ADDED_FIELDS = {
    "gradient_checkpointing": False,  # nla train ar|av
    "optimiser.gradient_checkpointing": False, "reconstructor.gradient_checkpointing": False,
    "rollout.decode": "eager",
}


class RunDirError(InputError):
    """The run directory holds another run, or a config that does not match the resumed one."""


def _checkpoints(out: Path) -> list[Path]:
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")), key=lambda p: p.name)


def remove_stale_temp_dirs(out_dir: str | os.PathLike) -> list[Path]:
    """Delete ``checkpoints/.step_*.tmp-*`` / ``.old-*`` left by interrupted saves, and the AR's own
    temp dir beside one (``..step_*.tmp-*.tmp-*``: ``Reconstructor.save_pretrained`` writes next to
    its target, itself a temp dir); returns what was removed."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.iterdir()
                   if p.name.startswith((".step_", "..step_")) and (".tmp-" in p.name or ".old-" in p.name))
    for p in stale:
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        logger.info("removing %s (%.1f MB) left by an interrupted checkpoint save", p, size / 2**20)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


def _same_path(a: Any, b: Any) -> bool:
    """Two spellings of one existing file or directory (``runs/x`` and ``/home/me/runs/x``, a
    trailing slash, ``./``): a resume from the same place spelled another way is the same run."""
    if not (isinstance(a, str) and isinstance(b, str)) or not (os.path.exists(a) or os.path.exists(b)):
        return False
    return os.path.realpath(a) == os.path.realpath(b)


def _differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for name in sorted(set(saved) | set(now)):
        key = f"{prefix}{name}"
        if key in RESUME_MAY_CHANGE:
            continue
        if name not in saved and key in ADDED_FIELDS and now.get(name) == ADDED_FIELDS[key]:
            continue  # saved before the field existed, and it is at the default that ran then
        a, b = saved.get(name, "<absent>"), now.get(name, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):  # a config section: compare field by field
            out.extend(_differences(a, b, f"{key}."))
            continue
        if isinstance(a, tuple):
            a = list(a)
        if isinstance(b, tuple):
            b = list(b)
        if a != b and not _same_path(a, b):
            out.append(f"{key}: {a!r} in the run, {b!r} now")
    return out


def prepare_run_dir(out_dir: str | os.PathLike, config: dict[str, Any], config_name: str, *, resume: bool,
                    overwrite: bool) -> None:
    """Make ``out_dir`` ready for this run (see the module docstring); raise :class:`RunDirError` if it is not.

    ``config`` is the new run's resolved config as a dict; ``config_name`` the file each
    checkpoint saves it under (``train_config.yaml`` / ``rl_config.yaml``).
    """
    out = Path(out_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: continue the run, or replace it")
    remove_stale_temp_dirs(out)
    ckpts = _checkpoints(out)
    if not ckpts:
        return
    if overwrite:
        logger.warning("--overwrite: deleting the previous run in %s (%d checkpoints)", out, len(ckpts))
        shutil.rmtree(out)
        return
    if not resume:
        raise RunDirError(
            f"out_dir {out} already holds a run (checkpoints up to {ckpts[-1].name}); pass --resume to continue it "
            "(with the same config), --overwrite to delete it and start over, or choose another --out"
        )
    saved_file = ckpts[-1] / config_name
    if not saved_file.is_file():
        logger.warning("--resume: %s has no %s; the config cannot be compared", ckpts[-1], config_name)
        return
    saved = load_yaml(saved_file, "saved run config") or {}
    diff = _differences(saved, config)
    if diff:
        raise RunDirError(
            f"--resume: the config differs from the run's ({saved_file}): {'; '.join(diff)}. Resume with the run's "
            "config, or start a new run (another --out, or --overwrite)"
        )
