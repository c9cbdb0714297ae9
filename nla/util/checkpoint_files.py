"""A checkpoint directory's files are whole and are the ones that were saved (docs/design.md §3.3).

1. ``config.json`` parses, the weights are safetensors (pickles are refused: nla never unpickles)
   and every safetensors file is complete (its header parses and its data section is as long as
   the header says): :func:`check_checkpoint`, :func:`check_safetensors_file`.
2. nla's own saves record each safetensors file's SHA-256 (``nla_checksums.sha256``,
   :func:`write_checksums`), checked at load (:func:`verify_checksums`), which catches a flipped
   bit, once per file and machine by default (``NLA_VERIFY_CHECKSUMS``: once | always | off;
   ``VERIFY_MODES``).
3. Other checkpoints have no such record (safetensors has no checksum of its own), so for them
   every floating weight is checked finite at load instead (:func:`check_finite_weights`, once
   per file).

Each failure is an :class:`~nla.util.validation.InputError` naming the file (and the tensor) and
the fix. A checkpoint directory appears whole or not at all: :func:`atomic_dir`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from nla.util.validation import InputError

__all__ = [
    "CHECKSUM_FILE",
    "CheckpointSaveError",
    "VERIFY_MODES",
    "atomic_dir",
    "check_checkpoint",
    "check_finite_weights",
    "check_model_source",
    "check_safetensors_file",
    "file_sha256",
    "read_checksums",
    "verify_checksums",
    "verify_mode",
    "write_checksums",
]

logger = logging.getLogger(__name__)


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
_verified: dict[tuple[str, int, int, int], str] = {}  # _file_key -> sha256, so a load hashes once

# How often a recorded SHA-256 is checked (environment variable NLA_VERIFY_CHECKSUMS):
#   once   (default) once per file and machine: the digest of a file, keyed by its resolved path, size,
#          mtime, ctime and inode, is kept in $NLA_CACHE/verified-checksums.jsonl, so the policy, reference
#          and rollout copies and every rank of every later run load it without hashing (a 7B model's
#          ~15 GB took minutes per start, on every rank); a file that changes is hashed again. Any write
#          moves the ctime, which (unlike the mtime) no user can set back, so a bit flipped in place with
#          the mtime restored is hashed again too (issue 58);
#   always every load of every process hashes (a bit that flips on disk without a write is caught too);
#   off    never hash (the files are still checked complete and well-formed).
VERIFY_MODES = ("once", "always", "off")


def verify_mode() -> str:
    mode = os.environ.get("NLA_VERIFY_CHECKSUMS", "once").strip().lower() or "once"
    if mode not in VERIFY_MODES:
        raise InputError(f"NLA_VERIFY_CHECKSUMS: expected one of {', '.join(VERIFY_MODES)}, found {mode!r}; unset it "
                         "for the default (once per file)")
    return mode


def _file_key(path: Path) -> tuple[str, int, int, int]:
    """(resolved path, size, mtime_ns, ctime_ns): a file's identity for the once-per-file checks below
    (the ctime: a write with the mtime set back still moves it)."""
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _record_path() -> Path:
    return Path(os.environ.get("NLA_CACHE", "~/.cache/nla")).expanduser() / "verified-checksums.jsonl"


def _disk_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"


def _recorded(path: Path) -> str | None:
    """The digest this machine recorded for ``path`` as it is now (same size, mtime, inode, ctime), or None."""
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


_finite: set[tuple[str, int, int, int]] = set()  # _file_key of files found finite, so a load checks once


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


# ---------------------------------------------------------------- atomic checkpoint dirs
def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    with contextlib.suppress(OSError):  # directory fsync is not supported everywhere
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_dir(final_path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; on clean exit it replaces ``final_path``.

    The previous ``final_path`` (if any) is kept until the new one is complete and fsynced,
    then swapped out by rename; an exception removes the temporary dir and leaves the old
    checkpoint untouched.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        # Each folder of weights records their SHA-256: a flipped bit is caught at load (nla.util.checkpoint_files).
        for folder in sorted({f.parent for f in tmp.rglob("*.safetensors")}):
            write_checksums(folder)
        _fsync_tree(tmp)
        old = None
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_disk_full(exc):
            # save_pretrained's safetensors writer raises SafetensorError("... No space left on device (os error
            # 28)"), neither an OSError nor a RuntimeError: it was a traceback (issue 48).
            free = shutil.disk_usage(final.parent).free
            raise CheckpointSaveError(
                f"saving the checkpoint {final} failed: the disk is full (no space left on device; "
                f"{free / 2**20:.0f} MB are free under {final.parent} now). The previous checkpoint is intact; free "
                "space (or pick another out_dir) and rerun with --resume"
            ) from exc
        if isinstance(exc, (OSError, RuntimeError)) and not isinstance(exc, CheckpointSaveError):
            # torch.save on a full disk says only "[enforce fail at inline_container.cc] unexpected pos".
            free = shutil.disk_usage(final.parent).free
            raise CheckpointSaveError(
                f"saving the checkpoint {final} failed ({' '.join(str(exc).split())}); {free / 2**20:.0f} MB are free "
                f"on that disk now. The previous checkpoint is intact; free space (or pick another out_dir) and "
                "rerun with --resume"
            ) from exc
        raise


def _is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a full disk: an OSError with errno
    ENOSPC / EDQUOT, or a writer's message carrying it (safetensors' ``os error 28``)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and not isinstance(e, CheckpointSaveError):
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if f"os error {errno.ENOSPC})" in text or "No space left on device" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (full disk, permissions); nothing partial was left in its place."""
