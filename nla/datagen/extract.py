"""Stage 1, extract: residual-stream activations of block K at random token positions.

Notation: B docs per batch, T padded length, d model width, K the layer index.

1. The vector at (doc, position) is the output of decoder block K, captured by a hook that
   stops the forward pass there (``nla.core.activations.block_outputs``: HF ``hidden_states[K+1]``,
   the raw block output for the last block too, which is what the reconstructor predicts).
2. Positions come from ``np.random.default_rng([seed, doc_id])``
   (``nla.core.activations.sample_positions``), so any shard or rerun draws the same positions;
   batches are fixed chunks of the sorted doc ids and shards take whole chunks, so padding (right
   side, masked) is identical too and rows are bit-identical across sharded and single runs.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from nla.core.activations import blocks_outputs, pad_right, sample_positions, tokenize_text
from nla.core.arch import hidden_size, num_layers
from nla.datagen.corpus import CorpusDoc
from nla.datagen.io import (
    DatagenError,
    read_parquet,
    vectors_to_arrow,
    write_json_atomic,
    write_parquet_atomic,
)
from nla.util.threads import adapt_threads
from nla.util.validation import load_json

log = logging.getLogger(__name__)

ACTIVATIONS_FILE = "activations.parquet"
SHARD_DIR = "shards"
_STATS_KEY = b"nla_extract_stats"


@dataclass
class ExtractResult:
    """What the extract stage wrote: the consolidated file (None for a non-final shard run) and counts."""

    path: Path | None
    n_rows: int
    n_docs: int
    d_model: int
    dropped: dict[str, int] = field(default_factory=dict)
    n_tokens: int = 0


def check_vectors(
    vectors: np.ndarray, doc_ids: np.ndarray, positions: np.ndarray, policy: str
) -> tuple[np.ndarray, Counter]:
    """Mask of rows to keep; NaN/inf or zero-norm rows raise (policy 'error') or are dropped and counted."""
    finite = np.isfinite(vectors).all(axis=1)
    norms = np.linalg.norm(np.where(np.isfinite(vectors), vectors, 0.0), axis=1)
    zero = finite & (norms == 0)
    counts: Counter = Counter()
    if (~finite).any() or zero.any():
        if policy == "error":
            i = int(np.flatnonzero(~finite | zero)[0])
            what = "NaN/inf values" if not finite[i] else "zero norm"
            raise DatagenError(
                f"activation at doc_id {int(doc_ids[i])} position {int(positions[i])} has {what} "
                f"({int((~finite).sum())} non-finite, {int(zero.sum())} zero-norm rows in this batch); "
                "check the model weights/dtype, or set bad_vectors: drop to drop and count such rows"
            )
        if policy != "drop":
            raise ValueError(f"bad_vectors: expected 'error' or 'drop', found {policy!r}")
        counts["non_finite_vector"] = int((~finite).sum())
        counts["zero_norm_vector"] = int(zero.sum())
    return finite & ~zero, +counts


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_subject(model_dir: str | os.PathLike, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) from a local HF directory, fp32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla.util.checkpoint_files import check_checkpoint

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise DatagenError(
            f"model_dir {model_dir}: no config.json; expected a local Hugging Face model directory"
        )
    check_checkpoint(model_dir, "model_dir")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32,
                                                 use_safetensors=True)
    model.to(resolve_device(device)).eval()
    return model, tokenizer


def check_layer_index(config: Any, layer_index: int) -> None:
    n = num_layers(config)
    if not isinstance(layer_index, int) or not 0 <= layer_index < n:
        raise DatagenError(
            f"layer_index {layer_index} is out of range: the model has {n} decoder blocks, valid range 0..{n - 1}"
        )


def _world_annotations(doc: CorpusDoc, offsets: list[tuple[int, int]] | None, positions: np.ndarray):
    from nla.world import current_word, text_end, token_facts

    if offsets is None:
        raise DatagenError(
            "world annotations need a fast tokenizer (offset mapping); the world tokenizer is fast"
        )
    facts = token_facts(doc.world_doc, offsets)
    return (
        [sorted(str(f) for f in facts[p]) for p in positions],
        [current_word(doc.world_doc, offsets[p][1]) for p in positions],
        [text_end(doc.world_doc, offsets[p][1]) for p in positions],
    )


def _next_tokens(model: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The subject's most likely next token id at every position [B, T] (a full forward pass)."""
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
    return logits.argmax(dim=-1).cpu()


def _chunk_rows(
    model: Any,
    tokenizer: Any,
    docs: list[CorpusDoc],
    *,
    layers: Sequence[int],
    positions_per_doc: int,
    skip_first: int,
    seed: int,
    batch_size: int,
    max_len: int,
    bad_vectors: str,
    world: bool,
    progress: tqdm | None = None,
) -> tuple[pa.Table, Counter, int]:
    """Rows for one chunk of docs (several batches): one a (document, position) and block of ``layers``."""
    device = next(model.parameters()).device
    cols: dict[str, list] = {k: [] for k in ("doc_id", "position", "n_raw_tokens", "context", "token")}
    # a corpus whose documents carry a topic (source: wikipedia) is annotated with the claims of
    # nla.datagen.wiki: the quotation of the text's end, the topic, the subject's next token, the position
    wiki = not world and bool(docs) and all(d.topic is not None for d in docs)
    if wiki:
        from nla.datagen.wiki import row_claims
    if world:
        cols["facts"], cols["current_word"], cols["text_end"] = [], [], []
    if wiki:
        cols["facts"], cols["topic"], cols["next_token"] = [], [], []
    vec_parts: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    dropped: Counter = Counter()
    n_tokens = 0
    for b0 in range(0, len(docs), batch_size):
        adapt_threads()
        batch = docs[b0 : b0 + batch_size]
        encoded = [tokenize_text(tokenizer, d.text, max_len) for d in batch]
        lengths = [len(ids) for ids, _ in encoded]
        n_tokens += sum(lengths)
        input_ids, mask = pad_right([ids for ids, _ in encoded], 0)  # [B, T]
        hidden = {k: h.float().cpu().numpy()  # [B, T, d] a block
                  for k, h in blocks_outputs(model, input_ids.to(device), mask.to(device), layers).items()}
        next_ids = _next_tokens(model, input_ids.to(device), mask.to(device)) if wiki else None
        start = len(cols["doc_id"])  # every column gets this batch's rows from here on
        b_vec: dict[int, list[np.ndarray]] = {k: [] for k in layers}
        for i, (doc, (ids, offsets)) in enumerate(zip(batch, encoded, strict=True)):
            positions = sample_positions(seed, doc.doc_id, len(ids), positions_per_doc, skip_first)
            if len(positions) == 0:
                dropped["doc_too_short"] += 1
                continue
            for k in layers:
                b_vec[k].append(hidden[k][i, positions])
            cols["doc_id"] += [doc.doc_id] * len(positions)
            cols["position"] += positions.tolist()
            cols["n_raw_tokens"] += [len(ids)] * len(positions)
            for p in positions:
                if offsets is not None:
                    cols["context"].append(doc.text[: offsets[p][1]])
                else:
                    cols["context"].append(tokenizer.decode(ids[: p + 1]))
                cols["token"].append(tokenizer.decode([ids[p]]))
            if world:
                facts, words, ends = _world_annotations(doc, offsets, positions)
                cols["facts"] += facts
                cols["current_word"] += words
                cols["text_end"] += ends
            if wiki:
                for k, p in enumerate(positions):
                    nxt = tokenizer.decode([int(next_ids[i, p])])
                    cols["topic"].append(doc.topic)
                    cols["next_token"].append(nxt)
                    cols["facts"].append(row_claims(cols["context"][-len(positions) + k], int(p), doc.topic, nxt))
        if progress is not None:
            progress.update(len(batch))
        if not b_vec[layers[0]]:
            continue
        vecs = {k: np.concatenate(b_vec[k]) for k in layers}
        keep = np.ones(len(vecs[layers[0]]), dtype=bool)
        for k in layers:  # a (document, position) bad at any block is dropped at every block
            ok, bad = check_vectors(
                vecs[k], np.array(cols["doc_id"][start:]), np.array(cols["position"][start:]), bad_vectors
            )
            keep &= ok
            dropped.update({(name if len(layers) == 1 else f"{name}_block_{k}"): n for name, n in bad.items()})
        if not keep.all():
            for values in cols.values():
                values[start:] = [v for v, k in zip(values[start:], keep, strict=True) if k]
            vecs = {k: v[keep] for k, v in vecs.items()}
        for k in layers:
            vec_parts[k].append(vecs[k])
    d = hidden_size(model.config)
    tables = [_rows_table(np.concatenate(vec_parts[k]) if vec_parts[k] else np.zeros((0, d), dtype=np.float32),
                          cols, k, world, wiki) for k in layers]
    return pa.concat_tables(tables), dropped, n_tokens


def _rows_table(vectors: np.ndarray, cols: dict[str, list], layer_index: int, world: bool, wiki: bool = False
                ) -> pa.Table:
    n = len(cols["doc_id"])
    data = {
        "activation_vector": vectors_to_arrow(vectors),
        "doc_id": pa.array(cols["doc_id"], pa.int64()),
        "position": pa.array(cols["position"], pa.int32()),
        "activation_layer": pa.array([layer_index] * n, pa.int32()),
        "n_raw_tokens": pa.array(cols["n_raw_tokens"], pa.int32()),
        "context": pa.array(cols["context"], pa.string()),
        "token": pa.array(cols["token"], pa.string()),
    }
    if world:
        data["facts"] = pa.array(cols["facts"], pa.list_(pa.string()))
        data["current_word"] = pa.array(cols["current_word"], pa.string())
        data["text_end"] = pa.array(cols["text_end"], pa.string())
    if wiki:
        data["facts"] = pa.array(cols["facts"], pa.list_(pa.string()))
        data["topic"] = pa.array(cols["topic"], pa.string())
        data["next_token"] = pa.array(cols["next_token"], pa.string())
    return pa.table(data)


def extract_activations(
    model_dir: str | os.PathLike,
    corpus: list[CorpusDoc],
    layer_index: int | Sequence[int],
    positions_per_doc: int,
    skip_first: int,
    seed: int,
    batch_size: int,
    out_dir: str | os.PathLike,
    max_len: int,
    *,
    bad_vectors: str = "error",
    batches_per_shard: int = 16,
    shard_index: int = 0,
    num_shards: int = 1,
    device: str = "cpu",
    progress: bool = True,
) -> ExtractResult:
    """Extract activations of block `layer_index` into `out_dir/activations.parquet`; a list of
    blocks gives a row per block for every (document, position), from one forward pass each batch.

    Work is cut into chunks of `batches_per_shard` batches; chunk c belongs to
    shard `c % num_shards`. Each chunk is written atomically to
    `out_dir/shards/part-{c}.parquet` and skipped if present (resume). With
    `num_shards == 1` the chunks are consolidated at once; otherwise call
    `consolidate_shards(out_dir)` after every shard has run.
    """
    if not corpus:
        raise DatagenError("corpus is empty: no documents to extract from; check corpus_path / n_docs")
    if not 0 <= shard_index < num_shards:
        raise DatagenError(
            f"shard_index {shard_index}: valid range 0..{num_shards - 1} for num_shards={num_shards}"
        )
    docs = sorted(corpus, key=lambda d: d.doc_id)
    ids = [d.doc_id for d in docs]
    dup = [i for i, c in Counter(ids).items() if c > 1]
    if dup:
        raise DatagenError(f"corpus has duplicate doc_id(s) {dup[:5]}; doc ids must be unique")
    world = all(d.world_doc is not None for d in docs)

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    layers = [layer_index] if isinstance(layer_index, int) else list(layer_index)
    for k in layers:
        check_layer_index(config, k)
    model, tokenizer = load_subject(model_dir, device)

    out_dir = Path(out_dir)
    shard_dir = out_dir / SHARD_DIR
    chunk_docs = batch_size * batches_per_shard
    n_chunks = (len(docs) + chunk_docs - 1) // chunk_docs
    manifest = {
        "n_chunks": n_chunks,
        "doc_ids_first_last": [ids[0], ids[-1]],
        "n_docs": len(docs),
        "layer_index": layer_index if isinstance(layer_index, int) else layers,
        "seed": seed,
        "positions_per_doc": positions_per_doc,
        "skip_first": skip_first,
        "batch_size": batch_size,
        "batches_per_shard": batches_per_shard,
        "max_len": max_len,
        "model_dir": str(model_dir),
    }
    manifest_path = shard_dir / "manifest.json"
    if manifest_path.exists():
        old = load_json(manifest_path, "extraction's shard manifest",
                        f"delete {shard_dir} (the shards are recomputed) or rerun with --force")
        if old != manifest:
            diff = {k: (old.get(k), v) for k, v in manifest.items() if old.get(k) != v}
            raise DatagenError(
                f"{shard_dir}: existing shards were made with different settings {diff} (old, new); "
                "delete the directory or rerun with --force"
            )
    write_json_atomic(manifest, manifest_path)

    mine = [c for c in range(n_chunks) if c % num_shards == shard_index]
    todo = [c for c in mine if not (shard_dir / f"part-{c:06d}.parquet").exists()]
    if len(todo) < len(mine):
        log.info(
            "extract: resuming, %d of %d chunks of this shard already written",
            len(mine) - len(todo),
            len(mine),
        )
    total_tokens = 0
    with tqdm(
        total=sum(len(docs[c * chunk_docs : (c + 1) * chunk_docs]) for c in todo), desc="extract", unit="doc",
        disable=not progress,
    ) as bar:
        for c in todo:
            chunk = docs[c * chunk_docs : (c + 1) * chunk_docs]
            table, dropped, n_tok = _chunk_rows(
                model, tokenizer, chunk, layers=layers, positions_per_doc=positions_per_doc,
                skip_first=skip_first, seed=seed, batch_size=batch_size, max_len=max_len,
                bad_vectors=bad_vectors, world=world, progress=bar,
            )  # fmt: skip
            total_tokens += n_tok
            stats = {"dropped": dict(dropped), "n_docs": len(chunk), "n_tokens": n_tok}
            table = table.replace_schema_metadata({_STATS_KEY: json.dumps(stats).encode()})
            write_parquet_atomic(table, shard_dir / f"part-{c:06d}.parquet")
    if num_shards == 1:
        return consolidate_shards(out_dir)
    log.info("extract: shard %d/%d done (%d chunks); run consolidate_shards when all shards are done",
             shard_index, num_shards, len(mine))  # fmt: skip
    return ExtractResult(None, 0, len(docs), hidden_size(config), {}, total_tokens)


def consolidate_shards(out_dir: str | os.PathLike) -> ExtractResult:
    """Merge `out_dir/shards/part-*.parquet` into `activations.parquet`, sorted by (doc_id, position)."""
    out_dir = Path(out_dir)
    shard_dir = out_dir / SHARD_DIR
    manifest_path = shard_dir / "manifest.json"
    if not manifest_path.exists():
        raise DatagenError(f"{shard_dir}: no manifest.json; run extract first")
    manifest = load_json(manifest_path, "extraction's shard manifest",
                         f"delete {shard_dir} and run extract again (or rerun with --force)")
    n_chunks = manifest["n_chunks"]
    paths = [shard_dir / f"part-{c:06d}.parquet" for c in range(n_chunks)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise DatagenError(
            f"{shard_dir}: {len(missing)} of {n_chunks} chunks missing ({missing[:3]}...); "
            "run the remaining extract shards before consolidating"
        )
    tables, dropped, n_tokens = [], Counter(), 0
    for p in paths:
        t = read_parquet(p)
        stats = json.loads((t.schema.metadata or {}).get(_STATS_KEY, b"{}"))
        dropped.update(stats.get("dropped", {}))
        n_tokens += stats.get("n_tokens", 0)
        tables.append(t.replace_schema_metadata(None))
    table = pa.concat_tables(tables).combine_chunks()
    if table.num_rows == 0:
        raise DatagenError(
            f"extract produced no rows from {manifest['n_docs']} documents (dropped: {dict(dropped)}); "
            "documents may be shorter than skip_first tokens, or every vector was bad"
        )
    order = pa.compute.sort_indices(table, sort_keys=[("doc_id", "ascending"), ("position", "ascending"),
                                                      ("activation_layer", "ascending")])
    table = table.take(order)
    path = write_parquet_atomic(table, out_dir / ACTIVATIONS_FILE)
    d = len(table.column("activation_vector")[0])
    log.info("extract: wrote %d rows (d=%d) from %d docs to %s; dropped %s",
             table.num_rows, d, manifest["n_docs"], path, dict(dropped) or "none")  # fmt: skip
    return ExtractResult(path, table.num_rows, manifest["n_docs"], d, dict(dropped), n_tokens)
