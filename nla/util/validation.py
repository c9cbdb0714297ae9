"""Input checks shared by every entry point: vectors, YAML files, checkpoint files, output paths, flags.

Each check raises :class:`InputError` (a ``ValueError``, so the CLI prints it as one line and
exits 2) whose message names the culprit (file, row, field), what was expected, what was
found and what to do. They run before any work starts, so a bad input never leaves a
half-written artifact behind.

1. Vectors: real floats only (complex, bool, integer and string data are refused, not cast);
   rows with NaN/Inf, with an all-zero vector, or whose norm overflows float32 are refused
   with their row numbers (a zero or infinite norm has no direction, and ``mse_nrm`` divides by it).
2. YAML: a syntax error names the file, line and column; a key repeated in one mapping (at any
   depth) is refused with both line numbers (plain YAML keeps the last one silently).
3. Checkpoints: ``config.json`` parses, the weights are safetensors and every safetensors file
   is complete (its header parses and its data section is as long as the header says). nla's
   own saves also record each safetensors file's SHA-256 (``nla_checksums.sha256``), checked at
   load, which catches a flipped bit, once per file and machine by default
   (``NLA_VERIFY_CHECKSUMS``: once | always | off; ``VERIFY_MODES``); other checkpoints have no such record (safetensors has
   no checksum of its own), so for them every floating weight is checked finite at load instead
   (``check_finite_weights``, once per file).
4. Output paths: the nearest existing folder must accept a file now, not after an hour of work.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "InputError",
    "check_checkpoint",
    "check_device",
    "check_model_source",
    "check_output_path",
    "check_finite_weights",
    "check_safetensors_file",
    "bad_rows",
    "check_vectors",
    "describe_rows",
    "verify_checksums",
    "write_checksums",
    "file_sha256",
    "read_checksums",
    "drop_bad_rows",
    "load_yaml",
    "safe_load_unique",
    "seed_flag",
    "sample_count_flag",
    "check_sample_count",
    "MAX_SAMPLES_PER_VECTOR",
    "non_negative_int",
    "positive_int",
]

logger = logging.getLogger(__name__)


class InputError(ValueError):
    """An input (file, vector, flag) is unusable; the message names it and the fix."""


# ---------------------------------------------------------------------------------------------
# Vectors
# ---------------------------------------------------------------------------------------------
def describe_rows(rows: Sequence[int] | np.ndarray, n: int, limit: int = 10) -> str:
    """``"rows 3, 17 (2 of 100)"``; at most ``limit`` row numbers, then ``...``."""
    rows = [int(r) for r in rows]
    shown = ", ".join(str(r) for r in rows[:limit]) + (", ..." if len(rows) > limit else "")
    return f"{'row' if len(rows) == 1 else 'rows'} {shown} ({len(rows)} of {n})"


def _as_float32(vectors: Any, source: str) -> np.ndarray:
    arr = np.asarray(vectors)
    kind = arr.dtype.kind
    if kind != "f":
        what = {"c": "complex numbers", "b": "booleans", "i": "integers", "u": "integers", "U": "strings",
                "S": "bytes", "O": "Python objects"}.get(kind, f"dtype {arr.dtype}")
        raise InputError(
            f"{source}: expected real floating-point activation vectors, found {what} (dtype {arr.dtype}); "
            "save the RAW float activations (float16/32/64) and nothing else"
        )
    if arr.ndim != 2:
        raise InputError(f"{source}: expected an array of shape [N, d], found shape {arr.shape}")
    with np.errstate(over="ignore"):  # overflow to Inf is reported by row
        return np.ascontiguousarray(arr, dtype=np.float32)


# Why a row is unusable, in the order rows are classified (a row gets the first reason that applies).
BAD_ROW_REASONS = {
    "nonfinite": "hold NaN or Inf (after conversion to float32)",
    "zero": "are all-zero vectors; a zero vector has no direction to verbalize or score (mse_nrm normalises by "
            "the norm)",
    "overflow": "have a norm that overflows float32 (entries around 1e19 or more); these are not activations of "
                "a working model",
}


def bad_rows(arr: np.ndarray) -> dict[str, np.ndarray]:
    """Row indices of a float32 [N, d] array per reason in :data:`BAD_ROW_REASONS` (disjoint)."""
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        return {k: np.zeros(0, dtype=np.int64) for k in BAD_ROW_REASONS}
    nonfinite = ~np.isfinite(arr).all(axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.linalg.norm(arr, axis=1)
    zero = ~nonfinite & (norms == 0)
    overflow = ~nonfinite & ~np.isfinite(norms)
    return {"nonfinite": np.flatnonzero(nonfinite), "zero": np.flatnonzero(zero), "overflow": np.flatnonzero(overflow)}


def check_vectors(vectors: Any, source: str = "vectors") -> np.ndarray:
    """RAW vectors [N, d] as contiguous float32, or an :class:`InputError` naming the bad rows.

    ``source`` names where the vectors came from (a file, a column) in the message.
    """
    arr = _as_float32(vectors, source)
    found = [f"{describe_rows(rows, arr.shape[0])} {BAD_ROW_REASONS[reason]}"
             for reason, rows in bad_rows(arr).items() if len(rows)]
    if found:
        raise InputError(
            f"{source}: {'; '.join(found)}. Drop or recompute those rows (--skip-bad-rows where offered; datagen's "
            "bad_vectors: drop at extraction)"
        )
    return arr


def drop_bad_rows(vectors: Any, source: str = "vectors") -> tuple[np.ndarray, np.ndarray, str | None]:
    """``(kept vectors [M, d] float32, their original row numbers [M], a report or None)``.

    The dtype and shape are still checked (an :class:`InputError`); only bad rows are dropped,
    and the report counts and names them.
    """
    arr = _as_float32(vectors, source)
    bad = bad_rows(arr)
    dropped = np.sort(np.concatenate(list(bad.values())))
    keep = np.setdiff1d(np.arange(arr.shape[0]), dropped)
    if not len(dropped):
        return arr, keep, None
    parts = [f"{describe_rows(rows, arr.shape[0])} {BAD_ROW_REASONS[r].split(';')[0]}" for r, rows in bad.items()
             if len(rows)]
    report = f"{source}: skipped {len(dropped)} of {arr.shape[0]} rows: " + "; ".join(parts)
    if not len(keep):
        raise InputError(f"{report}; no usable row is left")
    return np.ascontiguousarray(arr[keep]), keep, report


# ---------------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------------
class DuplicateKeyError(ValueError):
    """A YAML mapping names the same key twice; ``key``, ``first`` and ``again`` (1-based lines)."""

    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(f"the key {key!r} appears twice in one mapping (line {first} and line {again})")
        self.key, self.first, self.again = key, first, again


def _unique_key_loader() -> type:
    """A ``yaml.SafeLoader`` that refuses a key repeated within one mapping, at any depth.

    Plain YAML loaders keep the last value silently: a second ``loss:`` section replaced the first,
    a repeated ``steps:`` changed the run (issue 48). Merge keys (``<<: *base``) may still be
    overridden by explicit keys; only explicit keys are compared.
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # an unhashable key: the base loader reports it
                        continue
                    line = key_node.start_mark.line + 1
                    if first is not None:
                        raise DuplicateKeyError(key, first, line)
                    seen[key] = line
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


_LOADER: type | None = None


def safe_load_unique(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` for a key repeated in one mapping.

    Every YAML nla reads goes through here (configs via :func:`load_yaml`, ``--set`` values);
    ``nla.core.sidecar`` reads sidecars with :func:`load_yaml` too.
    """
    import yaml

    global _LOADER
    if _LOADER is None:
        _LOADER = _unique_key_loader()
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 (a SafeLoader subclass)


def load_yaml(path: str | os.PathLike, what: str = "config") -> Any:
    """Parse a YAML file; a syntax error names the file, line and column (1-based), a repeated key
    names the key and both lines."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{p}: the {what} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        return safe_load_unique(text)
    except DuplicateKeyError as err:
        raise InputError(
            f"{p}:{err.again}: the {what} repeats the key {err.key!r} (first at line {err.first}, again at line "
            f"{err.again}); YAML would keep only the last one silently: delete or merge one of them"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context = getattr(err, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise InputError(f"{where}: the {what} is not valid YAML: {detail}; fix the syntax there") from None


# ---------------------------------------------------------------------------------------------
# Checkpoint files
# ---------------------------------------------------------------------------------------------
def check_safetensors_file(path: str | os.PathLike) -> None:
    """A safetensors file is present, readable and complete: ``safetensors.safe_open`` parses its
    header and checks that the data covers exactly the tensors it announces (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    fix = "re-download or re-save the checkpoint (the copy is incomplete or damaged)"
    if not p.is_file():
        raise InputError(f"{p}: missing; {fix}")
    size = p.stat().st_size
    if size < 8:  # not even the header's length: say so plainly
        raise InputError(f"{p}: truncated safetensors file ({size} bytes, no header); {fix}")
    try:
        with safe_open(str(p), framework="pt") as fh:
            fh.keys()
    except PermissionError:
        raise InputError(f"{p}: not readable (permission denied); fix the file's permissions") from None
    except SafetensorError as err:
        raise InputError(f"{p}: truncated or corrupt safetensors file ({size} bytes; safetensors: {err}); {fix}") from None


WEIGHTS_NAME, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def check_checkpoint(path: str | os.PathLike, what: str, extra: Sequence[str] = ()) -> Path:
    """An HF model directory with a readable ``config.json`` and complete safetensors weights.

    ``extra`` lists further safetensors files the role needs (the AR's ``value_head.safetensors``).
    Pickled weights (``pytorch_model.bin``) are refused: nla never unpickles (docs/design.md §3.3).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what}: no directory at {p}; check the path")
    if not p.is_dir():
        raise InputError(f"{what}: {p} is a file, expected a checkpoint directory (config.json, model.safetensors)")
    config = p / "config.json"
    if not config.is_file():
        raise InputError(f"{what}: {p} has no config.json; it is not a Hugging Face model directory")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{what}: {config} is not valid JSON ({err}); re-download or re-save the checkpoint") from None
    if (p / WEIGHTS_INDEX).is_file():
        try:
            index = json.loads((p / WEIGHTS_INDEX).read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise InputError(f"{what}: {p / WEIGHTS_INDEX} is not a valid shard index ({err!r}); re-save the "
                             "checkpoint") from None
        files = [p / s for s in shards]
    elif (p / WEIGHTS_NAME).is_file():
        files = [p / WEIGHTS_NAME]
    else:
        pickled = [f.name for f in p.glob("*.bin")] + [f.name for f in p.glob("*.pt")]
        found = f"only pickled weights {sorted(pickled)}" if pickled else "no weights"
        raise InputError(
            f"{what}: {p} has no {WEIGHTS_NAME} ({found}); nla loads safetensors only (never unpickles): re-save "
            "the model with save_pretrained(..., safe_serialization=True)"
        )
    for f in [*files, *(p / e for e in extra)]:
        check_safetensors_file(f)
    verify_checksums(p)
    return p


CHECKSUM_FILE = "nla_checksums.sha256"
_verified: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, so a load hashes once

# How often a recorded SHA-256 is checked (environment variable NLA_VERIFY_CHECKSUMS):
#   once   (default) once per file and machine: the digest of a file, keyed by its resolved path, size,
#          mtime and inode, is kept in $NLA_CACHE/verified-checksums.jsonl, so the policy, reference and
#          rollout copies and every rank of every later run load it without hashing (a 7B model's
#          ~15 GB took minutes per start, on every rank); a file that changes is hashed again;
#   always every load of every process hashes (a flipped bit on disk that leaves mtime alone is caught);
#   off    never hash (the files are still checked complete and well-formed).
VERIFY_MODES = ("once", "always", "off")


def verify_mode() -> str:
    mode = os.environ.get("NLA_VERIFY_CHECKSUMS", "once").strip().lower() or "once"
    if mode not in VERIFY_MODES:
        raise InputError(f"NLA_VERIFY_CHECKSUMS: expected one of {', '.join(VERIFY_MODES)}, found {mode!r}; unset it "
                         "for the default (once per file)")
    return mode


def _file_key(path: Path) -> tuple[str, int, int]:
    """(resolved path, size, mtime_ns): a file's identity for the once-per-file checks below."""
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def _record_path() -> Path:
    return Path(os.environ.get("NLA_CACHE", "~/.cache/nla")).expanduser() / "verified-checksums.jsonl"


def _disk_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _recorded(path: Path) -> str | None:
    """The digest this machine recorded for ``path`` as it is now (same size, mtime, inode), or None."""
    try:
        lines = _record_path().read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    key = _disk_key(path)
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a torn line of a writer that died: ignore it
        if isinstance(entry, dict) and entry.get("file") == key and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    return None


def _remember(path: Path, digest: str) -> None:
    """Append ``path``'s digest to the machine's record (one line per write: concurrent ranks may append)."""
    try:
        rec = _record_path()
        rec.parent.mkdir(parents=True, exist_ok=True)
        with rec.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"file": _disk_key(path), "sha256": digest}) + "\n")
    except OSError as err:  # a read-only cache costs a hash per process, nothing else
        logger.debug("cannot record the checksum of %s in %s: %s", path, _record_path(), err)


def file_sha256(path: Path, *, use_record: bool = False) -> str:
    """SHA-256 of a file, once per process; ``use_record``: also taken from (and kept in) this
    machine's record of verified files (``$NLA_CACHE/verified-checksums.jsonl``)."""
    import hashlib

    key = _file_key(path)
    if key not in _verified:
        digest = _recorded(path) if use_record else None
        if digest is None:
            h = hashlib.sha256()
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
            digest = h.hexdigest()
            if use_record:
                _remember(path, digest)
        _verified[key] = digest
    return _verified[key]


def read_checksums(directory: str | os.PathLike) -> dict[str, str] | None:
    """``directory``'s checksum record as ``{file name: sha256}``; None when it has none."""
    record = Path(directory) / CHECKSUM_FILE
    if not record.is_file():
        return None
    listed = {}
    for line in record.read_text(encoding="utf-8").splitlines():
        digest, _, name = line.partition("  ")
        if name:
            listed[name] = digest
    return listed


def write_checksums(directory: str | os.PathLike) -> Path | None:
    """Record the SHA-256 of every ``*.safetensors`` in ``directory`` (``sha256sum`` format); None if there are none."""
    d = Path(directory)
    files = sorted(f for f in d.glob("*.safetensors") if f.is_file())
    if not files:
        return None
    out = d / CHECKSUM_FILE
    out.write_text("".join(f"{file_sha256(f)}  {f.name}\n" for f in files), encoding="utf-8")
    return out


_finite: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) of files found finite, so a load checks once


def check_finite_weights(path: str | os.PathLike) -> None:
    """Every floating tensor of the safetensors file ``path`` is finite (no NaN or Inf).

    For checkpoints without a checksum record (a user's own, or one from elsewhere): a model with
    NaN weights otherwise loads and "verbalizes" padding or scores NaN (issue 21). Reads each
    tensor once through ``safe_open`` (memory-mapped); a file already found finite is not re-read.
    """
    import torch
    from safetensors import safe_open

    f = Path(path)
    key = _file_key(f)
    if key in _finite:
        return
    with safe_open(str(f), framework="pt") as fh:
        for name in fh.keys():
            t = fh.get_tensor(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise InputError(
                    f"{f}: tensor {name!r} holds {bad} non-finite value(s) (NaN or Inf) of {t.numel()}; these "
                    "weights are broken (a diverged training run, or a damaged copy without a checksum record): "
                    "retrain, or re-download the checkpoint"
                )
    _finite.add(key)


def verify_checksums(directory: str | os.PathLike) -> None:
    """Compare ``directory``'s safetensors files with the recorded SHA-256s, as often as
    ``NLA_VERIFY_CHECKSUMS`` says (``VERIFY_MODES``). Without a record (a checkpoint nla did not
    write), check instead that every weight is finite."""
    d = Path(directory)
    record = d / CHECKSUM_FILE
    mode = verify_mode()
    if mode == "off" and record.is_file():
        return
    if not record.is_file():
        for f in sorted(d.glob("*.safetensors")):
            if f.is_file():
                check_finite_weights(f)
        return
    for i, line in enumerate(record.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        f = d / name
        if not f.is_file():
            raise InputError(f"{f}: missing, but {record.name} (line {i + 1}) lists it; the checkpoint is incomplete: "
                             "re-download or re-save it")
        if mode == "always":
            _verified.pop(_file_key(f), None)
        if file_sha256(f, use_record=mode == "once") != digest:
            raise InputError(
                f"{f}: its SHA-256 differs from the one recorded when it was saved ({record.name}); the file is "
                "corrupted (a flipped bit, a bad copy): re-download or re-save the checkpoint"
            )


def check_model_source(spec: str | os.PathLike, what: str = "base_model") -> str:
    """A local directory (checked with :func:`check_checkpoint`) or something that can only be a hub id.

    A value that looks like a path (absolute, ``./``, ``~``, or more than one ``/``) but is not a
    directory is an error naming it, instead of the hub's "Repo id must be in the form" message.
    """
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if p.is_dir():
        check_checkpoint(p, what)
        return s
    looks_like_path = (
        p.is_absolute() or s.startswith((".", "~")) or s.count("/") > 1 or s.endswith("/")
        or (os.sep != "/" and os.sep in s) or p.exists()
    )
    if looks_like_path:
        raise FileNotFoundError(
            f"{what}: no model directory at {s!r}; give the directory of a saved Hugging Face model "
            "(config.json + model.safetensors) or a hub id like 'org/name'"
        )
    return s


# ---------------------------------------------------------------------------------------------
# Outputs, devices, flags
# ---------------------------------------------------------------------------------------------
def check_output_path(path: str | os.PathLike, what: str = "--out", *, is_file: bool = False) -> Path:
    """Fail now, naming the path, if ``path`` (a folder, or a file when ``is_file``) cannot be written.

    Nothing is created: the nearest existing folder on the way must accept a new file.
    """
    p = Path(path).expanduser()
    if is_file and p.is_dir():
        raise InputError(f"{what}: {p} is a directory, expected a file path")
    if not is_file and p.exists() and not p.is_dir():
        raise InputError(f"{what}: {p} is a file, expected a directory")
    folder = p.parent if is_file else p
    probe, first_missing = folder, None
    while not probe.exists():
        if probe.parent == probe:
            break
        first_missing, probe = probe, probe.parent
    if first_missing is not None and first_missing.absolute().parent == Path(first_missing.absolute().anchor):
        raise InputError(f"{what}: {p} would create the new top-level directory {first_missing.absolute()}; that is "
                         "almost always a typo: create it yourself if you mean it, or choose another path")
    if first_missing is not None and first_missing != folder:
        logger.info("%s: creating %s (missing folders on the way to %s)", what, first_missing, p)
    if not probe.is_dir():
        raise InputError(f"{what}: cannot create {p}: {probe} is a file, not a directory; choose another path")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".nla-write-check-", dir=probe)
    except OSError as err:
        raise InputError(
            f"{what}: cannot write under {probe} ({err.strerror or err}), so {p} cannot be written; choose a "
            "writable location or fix the permissions"
        ) from None
    os.close(fd)
    os.unlink(tmp)
    return p


def check_device(spec: str) -> str:
    """``auto``, ``cpu``, ``cuda[:i]`` or ``mps``, refused clearly when this torch build lacks it."""
    import torch

    if spec in ("auto", "cpu"):
        return spec
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise InputError(f"device: expected auto, cpu or cuda[:i], found {spec!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else "no visible CUDA device"
            raise InputError(f"device: {spec!r} asked for, but this machine has {build}; use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(
                f"device: {spec!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"device: {spec!r} asked for, but MPS is not available here; use --device cpu")
    return spec


def _int_flag(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, found {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, found {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = _int_flag(1)
non_negative_int = _int_flag(0)


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, found {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, found {text}")
    return value


def _bounded_int_flag(text: str, lo: int, hi: int, not_int: str, out_of_range: str) -> int:
    """An argparse type's body: ``text`` as an integer in ``lo..hi``; the messages get ``{text}`` / ``{value}``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(not_int.format(text=repr(text))) from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(out_of_range.format(value=value))
    return value


def seed_flag(text: str) -> int:
    """argparse type of ``--seed``: an integer in the range every RNG nla seeds accepts
    (``nla.util.configcheck.SEED_MAX``: numpy's legacy seeds need < 2**32)."""
    from nla.util.configcheck import SEED_MAX

    return _bounded_int_flag(text, 0, SEED_MAX, f"expected an integer seed in 0..{SEED_MAX}, found {{text}}",
                             f"expected an integer seed in 0..{SEED_MAX} (the range numpy's and torch's seeds share), "
                             "found {value}; pick a seed in that range")


# The most explanations drawn for one vector (verbalize --n-samples, eval --best-of, NLAClient.verbalize's
# n_samples / best_of). Every sample of a vector is decoded in the same batch, so memory grows with the
# count: --best-of 100000 ran for a minute and was killed at 23 GB (issue 48). A count under the cap is
# still checked against the memory it needs (NLAClient.verbalize) before decoding starts.
MAX_SAMPLES_PER_VECTOR = 1024


def check_sample_count(value: int, what: str) -> int:
    """``value`` explanations per vector: 1..MAX_SAMPLES_PER_VECTOR, or an :class:`InputError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SAMPLES_PER_VECTOR:
        raise InputError(f"{what}: expected a sample count in 1..{MAX_SAMPLES_PER_VECTOR} per vector (every sample "
                         f"of a vector is decoded in one batch), found {value!r}; ask for fewer samples")
    return value


def sample_count_flag(text: str) -> int:
    """argparse type of a per-vector sample count (``--n-samples``): 1..MAX_SAMPLES_PER_VECTOR."""
    return _bounded_int_flag(text, 1, MAX_SAMPLES_PER_VECTOR,
                             f"expected an integer in 1..{MAX_SAMPLES_PER_VECTOR}, found {{text}}",
                             f"expected a sample count in 1..{MAX_SAMPLES_PER_VECTOR} per vector (every sample of a "
                             "vector is decoded in one batch), found {value}")
