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
4. One run per directory: :func:`lock_run_dir` takes an OS file lock (``flock`` on
   ``out_dir/.nla.lock``, released by the kernel when the process ends, crashed or not) for the
   whole run; a second writer is refused with the holder's pid and command. Two ``nla rl`` on one
   out_dir used to both run and both report success, their logs interleaved and one run's
   checkpoints lost.
5. ``--overwrite`` cannot lose inputs: it deletes only what a run writes in out_dir
   (:data:`RUN_OUTPUTS`), naming each entry (a user's notes or a datagen folder beside them stay),
   and refuses when a path of the config (an AV checkpoint, a dataset, a base model) lies inside
   one of those (it used to delete the dir, then fail on its own input). What it deletes must carry
   nla's mark (:func:`not_written_by_nla`): every entry of ``checkpoints/`` a ``step_*`` dir with
   nla's training state (or a temp dir of an interrupted save), ``tensorboard/`` only nla's
   logs, and a ``*_curves.png`` only beside the ``*.jsonl`` it was drawn from (a quickstart dir's
   report plots have no log beside them). Anything else is refused, named, never deleted: a
   user's model in ``checkpoints/`` was deleted as "the previous run" (issue 58).
6. ``--resume`` trains on the same data: each checkpoint records the size and SHA-256 of the
   config's dataset files (:data:`INPUTS_FILE`, :func:`write_input_fingerprints`); a dataset
   replaced at the same path is refused, named, with both digests (it used to continue silently
   on other rows, its data cursor pointing into another file) (issue 58).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from nla.util.validation import InputError, load_yaml

logger = logging.getLogger(__name__)

__all__ = ["ADDED_FIELDS", "INPUTS_FILE", "LOCK_FILE", "RESUME_MAY_CHANGE", "RUN_OUTPUTS", "STATE_FILES", "RunDirError", "RunLock",
           "input_fingerprints", "inputs_inside", "lock_run_dir", "not_written_by_nla", "prepare_run_dir",
           "remove_stale_temp_dirs", "write_input_fingerprints"]

LOCK_FILE = ".nla.lock"
# What a checkpoint records of the files it was trained on (write_input_fingerprints), and which fields
INPUTS_FILE = "inputs.json"
INPUT_FILE_FIELDS = ("dataset", "eval_dataset")
# What a run of nla train / nla rl writes at the top of its out_dir (nla.train.loop, nla.rl.loop,
# nla.util.metrics): the only entries --overwrite deletes.
RUN_OUTPUTS = ("checkpoints", "tensorboard", "rl_config.yaml", "rl_summary.json",
               *(f"{name}{suffix}" for name in ("ar", "av", "rl") for suffix in (".jsonl", "_curves.png")))

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


# Locks this process holds: resolved out_dir -> [fd, count] (re-entrant: the quickstart holds its
# out_dir while its stages, in the same process, take their own).
_HELD: dict[str, list[int]] = {}


class RunLock:
    """A held run-dir lock (a context manager); :meth:`release` gives it back."""

    def __init__(self, key: str | None) -> None:
        self.key = key

    def release(self) -> None:
        if self.key is None or self.key not in _HELD:
            return
        held = _HELD[self.key]
        held[1] -= 1
        if held[1] == 0:
            import fcntl

            del _HELD[self.key]
            fcntl.flock(held[0], fcntl.LOCK_UN)
            os.close(held[0])
        self.key = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_run_dir(out_dir: str | os.PathLike, command: str | None = None) -> RunLock:
    """Take ``out_dir``'s lock for this process (creating the dir), or raise :class:`RunDirError`
    naming the process that holds it. The file stays; the lock is the kernel's and ends with the
    process that holds it (a crash, kill -9 included), so a stale file never blocks a run."""
    import json
    import sys
    import time

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(out)
    if key in _HELD:
        _HELD[key][1] += 1
        return RunLock(key)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, said once per dir
        logger.warning("%s: this platform has no flock; two runs on one out_dir are not prevented here", out)
        return RunLock(None)
    path = out / LOCK_FILE
    if path.is_symlink():  # never written through: its target was truncated to the lock record (issue 58)
        raise RunDirError(
            f"{path} is a symbolic link (to {os.readlink(path)}); nla's run lock is a plain file it writes itself. "
            "Remove the link and run again")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        try:
            holder = json.loads(path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            holder = {}
        who = (f"pid {holder.get('pid', '?')}, `{holder.get('command', '?')}`, since {holder.get('since', '?')}"
               if holder else "a process that did not say which")
        raise RunDirError(
            f"out_dir {out} is in use by another nla run ({who}); wait for it to end, or write to another --out. "
            f"The lock ({path}) ends with that process, also if it crashes") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "command": command or " ".join(["nla", *sys.argv[1:]]),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    _HELD[key] = [fd, 1]
    return RunLock(key)


def _inside(path: str, root: str) -> bool:
    p = os.path.realpath(path)
    return p == root or p.startswith(root.rstrip(os.sep) + os.sep)


def inputs_inside(config: dict[str, Any], roots: list[str | os.PathLike], prefix: str = "") -> list[str]:
    """``field = path`` for every existing path in ``config`` (any depth; ``out_dir`` itself aside)
    that lies inside one of ``roots``: what deleting them would take with it."""
    real = [os.path.realpath(r) for r in roots]
    found = []
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            found.extend(inputs_inside(value, roots, f"{key}."))
        elif (isinstance(value, str) and key != "out_dir" and value and os.path.exists(value)
              and any(_inside(value, r) for r in real)):
            found.append(f"{key} = {value}")
    return found


# What a training or RL step dir holds that nothing else does (nla.train.checkpoint, nla.rl.loop).
STATE_FILES = ("training_state.pt", "rl_state.pt")


def not_written_by_nla(out: Path) -> list[str]:
    """What in ``out``'s run outputs (:data:`RUN_OUTPUTS`) does not carry nla's mark: the paths
    ``--overwrite`` must not delete (see the module docstring)."""
    strangers = []
    ckpts = out / "checkpoints"
    if ckpts.is_dir() and not ckpts.is_symlink():
        for p in sorted(ckpts.iterdir()):
            ours = (p.is_dir() and not p.is_symlink() and p.name.startswith("step_")
                    and any((p / f).is_file() for f in STATE_FILES)) or \
                (p.name.startswith((".step_", "..step_")) and (".tmp-" in p.name or ".old-" in p.name))
            if not ours:
                strangers.append(f"{p} (no {' or '.join(STATE_FILES)}: not a checkpoint nla wrote)")
    board = out / "tensorboard"
    if board.is_dir() and not board.is_symlink():
        strangers.extend(f"{p} (not one of nla's ar/av/rl logs)" for p in sorted(board.iterdir())
                         if p.name not in ("ar", "av", "rl"))
    return strangers


def _overwrite(out: Path, config: dict[str, Any]) -> bool:
    """Delete the previous run's outputs in ``out`` (see the module docstring); False when there are none."""
    def present(name: str) -> bool:
        if not ((out / name).exists() or (out / name).is_symlink()):
            return False
        if name.endswith("_curves.png"):  # a plot nla drew beside its log; a report's copy stays
            log = out / name.replace("_curves.png", ".jsonl")
            return log.exists() or log.is_symlink()
        return True

    doomed = [out / name for name in RUN_OUTPUTS if present(name)]
    if not doomed:
        return False
    strangers = not_written_by_nla(out)
    if strangers:
        raise RunDirError(
            f"--overwrite would delete what nla did not write in {out}: {'; '.join(strangers)}. Move it out of "
            "the run's folders first, or write this run to another --out")
    inside = inputs_inside(config, doomed)
    if inside:
        raise RunDirError(
            f"--overwrite would delete inputs of this run, which live in the previous run's outputs in {out}: "
            f"{'; '.join(inside)}. Copy them out of it first, or write this run to another --out")
    kept = sorted(p.name for p in out.iterdir() if out / p.name not in doomed and p.name != LOCK_FILE)
    logger.warning("--overwrite: deleting the previous run in %s: %s%s", out, ", ".join(p.name for p in doomed),
                   f"; keeping what a run does not write: {', '.join(kept)}" if kept else "")
    for p in doomed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    return True


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
                    overwrite: bool, command: str | None = None) -> RunLock:
    """Make ``out_dir`` ready for this run (see the module docstring) and return its lock, held: keep
    it for the run (``with prepare_run_dir(...):``). Raise :class:`RunDirError` if it is not ready.

    ``config`` is the new run's resolved config as a dict; ``config_name`` the file each
    checkpoint saves it under (``train_config.yaml`` / ``rl_config.yaml``); ``command`` what the
    lock says holds it (default: this process's command line).
    """
    out = Path(out_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: continue the run, or replace it")
    lock = lock_run_dir(out, command)
    try:
        _prepare(out, config, config_name, resume=resume, overwrite=overwrite)
    except BaseException:
        lock.release()
        raise
    log_cpu_paths()
    return lock


def log_cpu_paths() -> None:
    """Name, in a run's first lines, the code paths the numeric libraries run, read back
    (nla.util.numerics), and warn where the pin did not hold: that run's numbers are this machine's."""
    from nla.util.numerics import describe_cpu_paths, pin_shortfalls

    logger.info("CPU paths: %s", describe_cpu_paths())
    for shortfall in pin_shortfalls():
        logger.warning("the CPU pin did not hold: %s; another machine gives other numbers (docs/index.md, "
                       "\"CPU kernels\")", shortfall)


def _prepare(out: Path, config: dict[str, Any], config_name: str, *, resume: bool, overwrite: bool) -> None:
    remove_stale_temp_dirs(out)
    ckpts = _checkpoints(out)
    if overwrite and _overwrite(out, config):
        return
    if not ckpts:
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
    _check_same_inputs(ckpts[-1], config)


def input_fingerprints(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{field: {"path", "size", "sha256"}}`` of the config's dataset files that exist
    (:data:`INPUT_FILE_FIELDS`); the digest is the machine's verified one when the file is unchanged
    (``nla.util.checkpoint_files.file_sha256``), so a run hashes its dataset once."""
    from nla.util.checkpoint_files import file_sha256

    out = {}
    for field in INPUT_FILE_FIELDS:
        value = config.get(field)
        if isinstance(value, str) and value and Path(value).is_file():
            f = Path(value)
            out[field] = {"path": str(f.resolve()), "size": f.stat().st_size, "sha256": file_sha256(f, use_record=True)}
    return out


def write_input_fingerprints(checkpoint_dir: str | os.PathLike, config: dict[str, Any]) -> None:
    """Record in a checkpoint being saved what :func:`input_fingerprints` finds (``--resume`` compares it)."""
    import json

    Path(checkpoint_dir, INPUTS_FILE).write_text(json.dumps(input_fingerprints(config), indent=1), encoding="utf-8")


def _check_same_inputs(ckpt: Path, config: dict[str, Any]) -> None:
    """Refuse ``--resume`` when a dataset the checkpoint recorded is another file now (same path or not)."""
    import json

    record = ckpt / INPUTS_FILE
    if not record.is_file():  # a checkpoint from before issue 58 round 5: nothing to compare
        return
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RunDirError(f"--resume: {record} is unreadable ({err}); it records the run's datasets. Resume from an "
                          "earlier checkpoint, or start a new run (another --out, or --overwrite)") from None
    now = input_fingerprints(config)
    for field, was in (saved or {}).items():
        if not isinstance(was, dict):
            continue
        cur = now.get(field)
        if cur is None:
            raise RunDirError(f"--resume: {field} {config.get(field)!r} is not a file; the run trained on "
                              f"{was.get('path')} ({was.get('size')} bytes). Resume with that dataset")
        if (cur["size"], cur["sha256"]) != (was.get("size"), was.get("sha256")):
            raise RunDirError(
                f"--resume: {field} {cur['path']} is not the file this run trained on: {was.get('size')} bytes, "
                f"sha256 {str(was.get('sha256'))[:16]}... in {record}; {cur['size']} bytes, sha256 "
                f"{cur['sha256'][:16]}... now. Put the run's dataset back, or start a new run on this one "
                "(another --out, or --overwrite)")
