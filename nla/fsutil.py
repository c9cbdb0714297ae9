"""Atomic file writes: a crash leaves the old file or the new one, never half of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    """Write ``text`` to a temp file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
