"""Atomic file writes (a crash leaves the old file or the new one, never half of either), JSON
that is always valid JSON, and the one rule for the files nla reads or writes in a run directory.

The run-dir rule (:func:`run_file`, issue 58): a file nla reads or writes inside a run directory
(a lock, a metrics log, a plot, a report) must lie inside that directory once symbolic links are
followed. A link that leads out of it is refused, on read (the explorer served ``/etc/passwd`` as a
plot that ``report.json`` named) and on write (a ``.nla.lock`` or ``av.jsonl`` link had its target
truncated). Whole-file writes go through a temp file renamed into place, which replaces a link
rather than writing through it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_via_temp(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """``write(tmp)`` to a temp file beside ``path``, give it the mode ``open()`` would (mkstemp makes
    0600), then rename it into place: a crash leaves the old file or the new one, and a link at
    ``path`` is replaced, never written through. The temp file is removed when ``write`` fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    """Write ``text`` to a temp file beside ``path``, then rename it into place."""
    return write_via_temp(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def copy_file_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy ``src`` to a temp file beside ``dst``, then rename it into place (a link at ``dst`` is
    replaced, never written through)."""
    import shutil

    return write_via_temp(dst, lambda tmp: shutil.copyfile(src, tmp))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def run_file(root: str | os.PathLike, path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` (relative paths are taken under ``root``) if it stays inside the run directory
    ``root`` once symbolic links are followed; else an ``InputError`` naming the link, where it
    leads and what to do. ``what`` names the file's role in the message (``"metrics log"``)."""
    from nla.util.validation import InputError

    root_path = Path(root)
    p = Path(path)
    if not p.is_absolute():
        p = root_path / p
    real_root = os.path.realpath(root_path)
    real = os.path.realpath(p)
    if not _inside(real, real_root):
        link = next((q for q in (p, *p.parents) if q.is_symlink()), p)
        raise InputError(
            f"{p}: the {what} leads out of the run directory {root_path} (through the symbolic link {link} -> "
            f"{real}); nla reads and writes only files inside a run directory. Remove the link (copy the file in "
            "if you meant it) and run again")
    return p


def json_ready(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) as None, so ``json.dumps(..., allow_nan=False)``
    writes valid JSON (Python's ``NaN`` / ``Infinity`` are not JSON; other readers refuse them)."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps_json(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``json_ready(obj)``: always valid JSON (non-finite numbers become null)."""
    return json.dumps(json_ready(obj), allow_nan=False, **kwargs)


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less the process's umask (read from /proc, so the
    umask is never changed, not even for an instant other threads could see)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc: the usual way (it sets the mask back at once)
    os.umask(mask)
    return 0o666 & ~mask
