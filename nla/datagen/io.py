"""Parquet helpers shared by every datagen stage.

Vectors are read as one zero-copy numpy view of the flattened list column:
millions of Python float objects would stall the garbage collector (docs/design.md §3.2).
Every write goes to a temp file in the same directory and is renamed into
place, so a crash never leaves a partial file that looks complete. Every page
carries a CRC-32 (parquet's page checksum, written and verified by pyarrow), so
a flipped byte in a file nla wrote is refused on read instead of decoding into
wrong vectors (issue 21); files without checksums (older ones, other writers')
read as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nla.util.fsutil import dumps_json, write_text_atomic, write_via_temp

VECTOR_COLUMN = "activation_vector"


class DatagenError(ValueError):
    """Bad input or state in a datagen stage; the message names the field/row and the fix."""


def read_parquet(path: str | os.PathLike) -> pa.Table:
    """Read a parquet file, verifying page checksums where it has them; low-level arrow errors
    become one that names the path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: parquet file not found; run the stage that writes it first")
    if path.is_dir():
        raise DatagenError(f"{path}: is a directory, expected a .parquet file (e.g. {path / 'ar_sft.parquet'})")
    try:
        return pq.read_table(path, page_checksum_verification=True)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        what = "a page's checksum does not match its bytes" if "checksum" in str(exc).lower() else str(exc)
        raise DatagenError(
            f"{path}: not a readable parquet file ({what}); it is corrupted or truncated - "
            "delete it and rerun the stage that writes it (with --force)"
        ) from exc


def require_split_columns(tables: dict[str, pa.Table], columns: tuple[str, ...], what: str, hint: str) -> None:
    """Raise ``DatagenError`` naming the first split of ``tables`` that lacks any of ``columns``
    (``what``: the setting that needs them; ``hint``: what to do)."""
    for name, t in tables.items():
        missing = [c for c in columns if c not in t.column_names]
        if missing:
            raise DatagenError(f"{what}: split {name} has no {', '.join(missing)} column; {hint}")


def read_vectors(path_or_table: str | os.PathLike | pa.Table, column: str = VECTOR_COLUMN, *,
                 source: str | os.PathLike | None = None, check: bool = True) -> np.ndarray:
    """Return the vector column as a float32 array [N, d] without building Python floats.

    Rows must all have the same length; a ragged column is an error naming the first bad row.
    The values must be floats; with ``check`` (the default) rows with NaN/Inf, zero vectors and
    norms that overflow float32 are refused with their row numbers (``nla.util.validation.check_vectors``).
    ``source`` names the file in messages (defaults to the path when one is given).
    """
    from nla.util.validation import InputError, check_vectors

    if source is None and not isinstance(path_or_table, pa.Table):
        source = path_or_table
    where = f"{source}: column {column!r}" if source is not None else f"column {column!r}"
    table = path_or_table if isinstance(path_or_table, pa.Table) else read_parquet(path_or_table)
    if column not in table.column_names:
        raise DatagenError(f"column {column!r} missing; found columns {table.column_names}")
    col = table.column(column).combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type)):
        raise InputError(f"{where}: expected a list<float32> column of vectors, found {col.type}")
    n = len(col)
    if n == 0:
        return np.zeros((0, 0), dtype=np.float32)
    if col.null_count:
        bad = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise DatagenError(f"{where}: row {bad} is null; every row needs a vector")
    if pa.types.is_fixed_size_list(col.type):
        d = col.type.list_size
    else:
        lengths = np.diff(col.offsets.to_numpy())
        d = int(lengths[0])
        if not (lengths == d).all():
            bad = int(np.flatnonzero(lengths != d)[0])
            raise DatagenError(
                f"column {column!r}: row {bad} has {int(lengths[bad])} values, expected {d} like row 0; "
                "all vectors of one dataset must share d_model"
            )
    flat = col.flatten()
    if not pa.types.is_floating(flat.type):
        raise InputError(
            f"{where}: expected lists of floats (RAW activations), found lists of {flat.type}; "
            "rewrite the column as list<float32>"
        )
    if flat.null_count:  # a null inside a vector (not a null row)
        pos = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{where}: row {pos // max(d, 1)} has a null entry (position {pos % max(d, 1)}); every entry of "
                         "a vector must be a number: recompute or drop that row")
    if flat.type != pa.float32():
        flat = flat.cast(pa.float32())
    arr = flat.to_numpy(zero_copy_only=True).reshape(n, d)
    return check_vectors(arr, where) if check else arr


def vectors_to_arrow(vectors: np.ndarray) -> pa.Array:
    """[N, d] float array -> list<float32> arrow array (no Python floats involved)."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, d = vectors.shape
    offsets = pa.array(np.arange(0, (n + 1) * d, d, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(vectors.reshape(-1)))


def write_parquet_atomic(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write `table` to `path` through a temp file + rename, creating parent dirs."""
    path = Path(path)
    kwargs: dict[str, Any] = {"write_page_checksum": True}
    if VECTOR_COLUMN in table.column_names:
        # Raw float activations neither compress nor dictionary-encode; skipping both halves the read time.
        others = [c for c in table.column_names if c != VECTOR_COLUMN]
        kwargs["use_dictionary"] = others
        kwargs["compression"] = {**{c: "snappy" for c in others}, VECTOR_COLUMN: "none"}
    return write_via_temp(path, lambda tmp: pq.write_table(table, tmp, **kwargs))


def write_json_atomic(obj: Any, path: str | os.PathLike) -> Path:
    return write_text_atomic(dumps_json(obj, indent=2, sort_keys=True, default=str) + "\n", path)
