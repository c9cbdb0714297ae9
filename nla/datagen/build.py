"""Stage 4, build: training parquets + dataset sidecars (docs/design.md §3.1, §3.2).

- `av_sft.parquet`: prompt = AV chat messages with the literal `<INJECT>`
  placeholder, response = `<explanation>\\n{e}\\n</explanation>`, explanation.
- `ar_sft.parquet`: prompt = the full AR template text around the explanation.
- `rl.parquet`: prompt = AV chat messages; no explanation.
- optional `*.shuffled.parquet`: the SFT sets with activation vectors permuted
  across rows (the "is the vector used at all?" baseline).
Every parquet gets `{file}.parquet.nla_meta.yaml` (kind nla_dataset), written
before the parquet itself, so a parquet on disk always has its sidecar.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from nla.core.arch import hidden_size, num_layers
from nla.core.templates import (
    AV_PLACEHOLDER,
    DEFAULT_AR_TEMPLATE,
    DEFAULT_AV_TEMPLATE,
    LAYERED_AR_TEMPLATE,
    LAYERED_AV_TEMPLATE,
)
from nla.datagen.io import DatagenError, read_parquet, read_vectors, write_parquet_atomic

log = logging.getLogger(__name__)

_SHUFFLE_SALT = 0x5_4FF1E


@dataclass
class BuildResult:
    """Files written by build: path -> row count."""

    files: dict[str, int] = field(default_factory=dict)


def format_response(explanation: str) -> str:
    return f"<explanation>\n{explanation}\n</explanation>"


def _messages_column(messages: list[dict], n: int) -> pa.Array:
    struct = pa.struct([("role", pa.string()), ("content", pa.string())])
    one = pa.array([messages], pa.list_(struct))
    return one.take(pa.array(np.zeros(n, dtype=np.int64)))


def _row_layers(table: pa.Table) -> list[int | None]:
    """Each row's block (``activation_layer``), or None throughout for a table without the column."""
    if "activation_layer" not in table.column_names:
        return [None] * table.num_rows
    return table.column("activation_layer").to_pylist()


def _av_prompts(cfg: Any, table: pa.Table) -> pa.Array:
    """The AV prompt column: the one canonical prompt, or for a pair of several blocks each row's with
    its block named."""
    if cfg.layers is None:
        return _messages_column(cfg.av_messages(placeholder=AV_PLACEHOLDER), table.num_rows)
    struct = pa.struct([("role", pa.string()), ("content", pa.string())])
    by_block = {k: cfg.av_messages(placeholder=AV_PLACEHOLDER, layer=k) for k in cfg.layers}
    return pa.array([by_block[k] for k in _row_layers(table)], pa.list_(struct))


def _vector_width(table: pa.Table, name: str) -> int:
    if table.num_rows == 0:
        return 0
    return read_vectors(table).shape[1]


def dataset_config(
    model_dir: str | os.PathLike,
    layer_index: int | Sequence[int],
    *,
    av_template: str | None = None,
    ar_template: str | None = None,
    injection_char: str,
    injection_scale: float | str | None = "sqrt_d_model",
    mse_scale: float | str | None = "sqrt_d_model",
    training: dict[str, Any] | None = None,
) -> Any:
    """The dataset NLAConfig, with token metadata computed from the model's live tokenizer.
    ``layer_index`` a list of blocks: a pair of several blocks, whose templates name the block
    (``nla.core.templates.LAYERED_*`` when none is given)."""
    from transformers import AutoConfig, AutoTokenizer

    from nla.core.sidecar import NLAConfig

    layers = None if isinstance(layer_index, int) else [int(k) for k in layer_index]
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    n = num_layers(config)
    for k in layers or [layer_index]:
        if not 0 <= k < n:
            raise DatagenError(
                f"layer_index {k} is out of range: the model has {n} decoder blocks, valid range 0..{n - 1}"
            )
    if layers is not None:
        layer_index = max(layers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return NLAConfig.from_tokenizer(
        tokenizer,
        kind="nla_dataset",
        role=None,
        d_model=hidden_size(config),
        layer_index=layer_index,
        layers=layers,
        av_template=av_template or (DEFAULT_AV_TEMPLATE if layers is None else LAYERED_AV_TEMPLATE),
        ar_template=ar_template or (DEFAULT_AR_TEMPLATE if layers is None else LAYERED_AR_TEMPLATE),
        injection_char=injection_char,
        injection_scale=injection_scale,
        mse_scale=mse_scale,
        base_model=str(model_dir),
        training=training,
    )


def _check_split(table: pa.Table, name: str, d_model: int, layers: Sequence[int], need_explanation: bool) -> None:
    width = _vector_width(table, name)
    if table.num_rows and width != d_model:
        raise DatagenError(
            f"{name}: activation vectors have d={width} but the model's hidden size is {d_model} "
            "(d_model mismatch); the activations were extracted from a different model - rerun extract"
        )
    if table.num_rows and "activation_layer" in table.column_names:
        found = set(np.unique(table.column("activation_layer").to_numpy()).tolist())
        if not found <= set(layers):
            raise DatagenError(
                f"{name}: activation_layer is {sorted(found)}, expected {list(layers)[0] if len(layers) == 1 else list(layers)}; "
                "rerun extract"
            )
    elif table.num_rows and len(layers) > 1:
        raise DatagenError(f"{name}: no activation_layer column, but the dataset is for blocks {list(layers)}; "
                           "rerun extract")
    if need_explanation:
        if "explanation" not in table.column_names:
            raise DatagenError(f"{name}: no 'explanation' column; run the explain stage first")
        if table.column("explanation").null_count:
            raise DatagenError(
                f"{name}: {table.column('explanation').null_count} rows have a null explanation"
            )


def _write_with_sidecar(table: pa.Table, path: Path, cfg: Any, **provenance: Any) -> None:
    from nla.core.sidecar import write_sidecar

    write_sidecar(path, cfg, **provenance)  # sidecar first: a parquet never exists without one
    write_parquet_atomic(table, path)


def _offset(table: pa.Table, offset: np.ndarray) -> pa.Table:
    """``table`` with ``offset`` ([d], or [rows, d]: one a row) subtracted from every row's vector (float32)."""
    from nla.datagen.io import vectors_to_arrow

    if not table.num_rows:
        return table
    idx = table.column_names.index("activation_vector")
    vectors = read_vectors(table) - (offset if offset.ndim == 2 else offset[None, :])
    return table.set_column(idx, "activation_vector", vectors_to_arrow(vectors.astype(np.float32)))


def _shuffled(table: pa.Table, seed: int) -> pa.Table:
    perm = np.random.default_rng([seed, _SHUFFLE_SALT]).permutation(table.num_rows)
    idx = table.column_names.index("activation_vector")
    return table.set_column(idx, "activation_vector", table.column(idx).take(pa.array(perm)))


def build_datasets(
    splits: dict[str, pa.Table],
    model_dir: str | os.PathLike,
    layer_index: int | Sequence[int],
    out_dir: str | os.PathLike,
    *,
    av_template: str | None = None,
    ar_template: str | None = None,
    injection_char: str,
    injection_scale: float | str | None = "sqrt_d_model",
    mse_scale: float | str | None = "sqrt_d_model",
    shuffled_baseline: bool = True,
    seed: int = 0,
    provenance: dict[str, Any] | None = None,
    center: bool = False,
    grader: str | None = None,
) -> BuildResult:
    """Write the training parquets for the splits present in `splits` (av_sft, ar_sft, rl).

    center: subtract the mean vector of the av_sft and ar_sft rows (float64 mean, stored float32)
    from every split's vectors and record it as the sidecars' ``vector_offset``; with several blocks,
    each block's own mean from its rows, recorded as ``layer_offsets``.
    grader: the ``nla.core.graders`` name written into each parquet's metadata (None: none written).
    layer_index a list of blocks: rows of several blocks (``activation_layer``), each row's prompts
    naming its block; the sidecars record the blocks and their training rows' median norms.
    """
    cfg = dataset_config(
        model_dir, layer_index, av_template=av_template, ar_template=ar_template, injection_char=injection_char,
        injection_scale=injection_scale, mse_scale=mse_scale,
    )  # fmt: skip
    if cfg.layers is not None:
        norms, offsets = {}, {}
        train = [n for n in ("av_sft", "ar_sft") if n in splits and splits[n].num_rows]
        vectors = np.concatenate([read_vectors(splits[n]) for n in train]) if train else np.zeros((0, cfg.d_model))
        blocks = np.asarray([k for n in train for k in _row_layers(splits[n])])
        for k in cfg.layers:
            v = vectors[blocks == k]
            if not len(v):
                raise DatagenError(f"build: no training rows (av_sft, ar_sft) of block {k}; every block of "
                                   f"{list(cfg.layers)} needs some")
            norms[k] = float(f"{np.median(np.linalg.norm(v.astype(np.float64), axis=1)):.6g}")
            offsets[k] = v.astype(np.float64).mean(axis=0).astype(np.float32)
        cfg = cfg.replace(layer_norms=norms)
        log.info("build: blocks %s, median norms %s", list(cfg.layers), norms)
        if center:  # one offset a block: a block's rows are centred on their own mean, not on all blocks'
            cfg = cfg.replace(layer_offsets={k: tuple(o.tolist()) for k, o in offsets.items()})
            splits = {n: _offset(t, np.stack([offsets[k] for k in _row_layers(t)])) if t.num_rows else t
                      for n, t in splits.items()}
            log.info("build: vectors centred a block at a time on its training rows' mean (norms %s; recorded as "
                     "layer_offsets)", {k: round(float(np.linalg.norm(o)), 2) for k, o in offsets.items()})
    elif center:
        train = [read_vectors(splits[n]) for n in ("av_sft", "ar_sft") if n in splits and splits[n].num_rows]
        if not train:
            raise DatagenError("build: center needs rows in av_sft or ar_sft (their mean is the offset); found none")
        offset = np.concatenate(train).astype(np.float64).mean(axis=0).astype(np.float32)
        cfg = cfg.replace(vector_offset=tuple(offset.tolist()))
        splits = {n: _offset(t, offset) for n, t in splits.items()}
        log.info("build: vectors centred on the training splits' mean (norm %.2f; recorded as vector_offset)",
                 float(np.linalg.norm(offset)))
    out_dir = Path(out_dir)
    prov = dict(provenance or {})
    result = BuildResult()
    for name, table in splits.items():
        if name not in ("av_sft", "ar_sft", "rl"):
            raise DatagenError(f"build: unknown split {name!r}; expected av_sft, ar_sft or rl")
        _check_split(table, name, cfg.d_model, cfg.layers or [cfg.layer_index], need_explanation=name != "rl")
        n = table.num_rows
        if name == "av_sft":
            expl = table.column("explanation").to_pylist()
            table = table.append_column("prompt", _av_prompts(cfg, table))
            table = table.append_column("response", pa.array([format_response(e) for e in expl], pa.string()))
        elif name == "ar_sft":
            expl = table.column("explanation").to_pylist()
            table = table.append_column("prompt", pa.array(
                [cfg.ar_text(e, layer=k if cfg.layers else None) for e, k in zip(expl, _row_layers(table), strict=True)],
                pa.string()))
        else:
            table = table.append_column("prompt", _av_prompts(cfg, table))
        if grader is not None:
            from nla.core.graders import tag_grader

            table = tag_grader(table, grader)
        path = out_dir / f"{name}.parquet"
        _write_with_sidecar(table, path, cfg, dataset=name, rows=n, **prov)
        result.files[str(path)] = n
        if shuffled_baseline and name != "rl":
            spath = out_dir / f"{name}.shuffled.parquet"
            _write_with_sidecar(
                _shuffled(table, seed), spath, cfg, dataset=name, rows=n, shuffled_vectors=True, **prov
            )
            result.files[str(spath)] = n
        log.info(
            "build: wrote %s (%d rows)%s",
            path,
            n,
            " + shuffled copy" if shuffled_baseline and name != "rl" else "",
        )
    return result


def load_dataset(path: str | os.PathLike, model_dir: str | os.PathLike | None = None) -> tuple[pa.Table, Any]:
    """Read a built parquet and its sidecar, checking they agree (and agree with `model_dir` if given)."""
    from nla.core.sidecar import load_sidecar, sidecar_path_for

    path = Path(path)
    side = sidecar_path_for(path)
    if not side.is_file():
        raise DatagenError(
            f"{path}: sidecar {side.name} is missing; datasets are only usable with their sidecar - "
            "rebuild with `nla datagen build --force`"
        )
    cfg = load_sidecar(path)
    table = read_parquet(path)
    width = _vector_width(table, path.name)
    if table.num_rows and width != cfg.d_model:
        raise DatagenError(
            f"{path}: vectors have d={width} but the sidecar says d_model={cfg.d_model}; rebuild the dataset"
        )
    if model_dir is not None:
        from transformers import AutoConfig

        mc = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        d, n = hidden_size(mc), num_layers(mc)
        if d != cfg.d_model:
            raise DatagenError(
                f"{path}: sidecar d_model={cfg.d_model} but model {model_dir} has hidden size {d} (d_model mismatch); "
                "use the model the dataset was extracted from"
            )
        if not 0 <= cfg.need_layer(f"{path}: checking the dataset against {model_dir}") < n:
            raise DatagenError(
                f"{path}: sidecar layer_index={cfg.layer_index} is out of range for {model_dir} "
                f"({n} blocks, valid range 0..{n - 1})"
            )
    return table, cfg
