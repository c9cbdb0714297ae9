"""Atomic file writes (a crash leaves the old file or the new one, never half of either), and
JSON that is always valid JSON."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    """Write ``text`` to a temp file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, default_file_mode())  # mkstemp makes 0600; a written output gets what open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
