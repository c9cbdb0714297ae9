"""Input checks shared by every entry point: vectors, YAML files, output paths, devices, sample counts.

Each check raises :class:`InputError` (a ``ValueError``, so the CLI prints it as one line and
exits 2) whose message names the culprit (file, row, field), what was expected, what was
found and what to do. They run before any work starts, so a bad input never leaves a
half-written artifact behind. A checkpoint directory's files are checked in
``nla.util.checkpoint_files``; the commands' flag types are ``nla.util.flags``.

1. Vectors: real floats only (complex, bool, integer and string data are refused, not cast);
   rows with NaN/Inf, with an all-zero vector, or whose norm overflows float32 are refused
   with their row numbers (a zero or infinite norm has no direction, and ``mse_nrm`` divides by it).
2. YAML: a syntax error names the file, line and column; a key repeated in one mapping (at any
   depth) is refused with both line numbers (plain YAML keeps the last one silently); a file over
   ``MAX_YAML_BYTES`` or a document that expands (aliases counted each time they are used) to
   more than ``MAX_YAML_VALUES`` values is refused before anything reads it (an alias bomb in
   ``lora.target_modules`` gave a 58 MB error line, one level deeper ran past a minute: issue 58).
3. Output paths: the nearest existing folder must accept a file now, not after an hour of work.
4. Sampling settings (:func:`check_sampling`): the one check of a temperature and a top_p, used by
   ``nla verbalize``, ``nla serve``, ``nla explore``, ``nla eval --suite`` and RL's config.
"""

from __future__ import annotations

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
    "load_json",
    "MAX_SAMPLES_PER_VECTOR",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "bad_rows",
    "check_device",
    "check_output_path",
    "check_sampling",
    "check_sample_count",
    "check_vectors",
    "describe_rows",
    "drop_bad_rows",
    "load_yaml",
    "safe_load_unique",
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

# Bounds of any YAML nla reads (configs, sidecars, --set values): far above any real config
# (a Qwen sidecar is ~4 kB, the largest config ~200 values).
MAX_YAML_BYTES = 4 * 2**20
MAX_YAML_VALUES = 100_000


class YAMLTooLargeError(ValueError):
    """A YAML document over MAX_YAML_BYTES, or expanding to more than MAX_YAML_VALUES values."""


def _check_expansion(doc: Any) -> None:
    """Count the values of ``doc`` as a reader walking it would (an object reached through several
    aliases counts each time), stopping at the cap: the walk itself stays bounded."""
    count = 0
    stack = [doc]
    while stack:
        obj = stack.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise YAMLTooLargeError(
                f"the document expands to more than {MAX_YAML_VALUES:,} values (YAML aliases *name count once for "
                "every place they are used): an alias bomb, or data that does not belong in a config")
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)


def safe_load_unique(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` for a key repeated in one mapping.

    Every YAML nla reads goes through here (configs via :func:`load_yaml`, ``--set`` values);
    ``nla.core.sidecar`` reads sidecars with :func:`load_yaml` too.
    """
    import yaml

    global _LOADER
    if _LOADER is None:
        _LOADER = _unique_key_loader()
    if len(text) > MAX_YAML_BYTES:
        raise YAMLTooLargeError(f"the document is {len(text):,} characters; the cap is {MAX_YAML_BYTES:,} (no "
                                "config or sidecar comes near it)")
    doc = yaml.load(text, Loader=_LOADER)  # noqa: S506 (a SafeLoader subclass)
    _check_expansion(doc)
    return doc


def load_json(path: str | os.PathLike, what: str, fix: str, *, kind: type | None = dict) -> Any:
    """Parse a JSON file nla reads back (a summary, a manifest, a record): an error names the file, the
    line and column, what the file is and what to do (``fix``), instead of a bare JSONDecodeError.
    ``kind``: the type the document must have (None: any)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{p}: the {what} is missing; {fix}") from None
    except UnicodeDecodeError as err:
        raise InputError(f"{p}: the {what} is not UTF-8 text ({err.reason} at byte {err.start}); {fix}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{p}:{err.lineno}:{err.colno}: the {what} is not valid JSON ({err.msg}); {fix}") from None
    if kind is not None and not isinstance(doc, kind):
        raise InputError(f"{p}: the {what} should be a JSON {'object' if kind is dict else kind.__name__}, found "
                         f"{type(doc).__name__}; {fix}")
    return doc


def load_yaml(path: str | os.PathLike, what: str = "config") -> Any:
    """Parse a YAML file; a syntax error names the file, line and column (1-based), a repeated key
    names the key and both lines."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file not found: {p}")
    if p.stat().st_size > MAX_YAML_BYTES:
        raise InputError(f"{p}: the {what} is {p.stat().st_size:,} bytes; the cap is {MAX_YAML_BYTES:,} (no config or "
                         "sidecar comes near it): is it the right file?")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{p}: the {what} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        return safe_load_unique(text)
    except YAMLTooLargeError as err:
        raise InputError(f"{p}: the {what} is refused: {err}; write the values out plainly") from None
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
# Outputs, devices, sample counts
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


# A sampling temperature divides the logits: below ~1e-37 every logit overflows float32 to +-inf, the
# softmax is NaN and every token drawn is the suppressed marker, silently (issue 58: `--temperature
# 1e-40` failed every rollout with exit 0). 1e-4 leaves logits of |x| < 1e30 finite and is already
# greedy in effect (a logit gap of 0.01 is a factor e^100); above 100 the distribution is uniform
# noise. 0 means greedy where a caller allows it (SGLang's sampling_params).
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 100.0


def check_sampling(temperature: Any, top_p: Any = 1.0, *, what: str = "temperature", top_p_what: str = "top_p",
                   zero_is_greedy: bool = False) -> tuple[float, float]:
    """``(temperature, top_p)`` as floats, or an :class:`InputError` naming ``what`` / ``top_p_what``:
    a temperature is a finite number in [MIN_TEMPERATURE, MAX_TEMPERATURE] (or 0 when
    ``zero_is_greedy``), a top_p a number in (0, 1]. The one place sampling settings are checked."""
    def number(value: Any, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"{name}: expected a number, found {type(value).__name__} {value!r}")
        return float(value)

    t, p = number(temperature, what), number(top_p, top_p_what)
    if not (zero_is_greedy and t == 0.0) and not (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        zero = "0 (greedy) or " if zero_is_greedy else ""
        raise InputError(
            f"{what}: expected {zero}a finite number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], found {t!r}; below "
            f"{MIN_TEMPERATURE:g} the logits divided by it overflow and every token drawn is garbage: for the most "
            "likely text decode greedily instead")
    if not (math.isfinite(p) and 0.0 < p <= 1.0):
        raise InputError(f"{top_p_what}: expected a number in (0, 1] (1 = off), found {p!r}")
    return t, p
