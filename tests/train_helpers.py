"""Tiny datasets for the warm-start tests: parquets + sidecars built against the conftest tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nla.core.sidecar import NLAConfig, write_sidecar
from nla.core.templates import (
    AV_PLACEHOLDER,
    DEFAULT_AR_TEMPLATE,
    DEFAULT_AV_TEMPLATE,
    DEFAULT_INJECTION_CHAR,
)
from nla.datagen.io import vectors_to_arrow

SUBJECTS = ["cat", "dog", "bird", "fish", "Alice", "Bob", "Carol", "Dave"]
PLACES = ["house", "garden", "river", "city", "forest", "village", "market", "school"]


def dataset_sidecar(tokenizer, base_dir: Path, d_model: int, layer_index: int, injection_scale=None) -> NLAConfig:
    return NLAConfig.from_tokenizer(
        tokenizer, kind="nla_dataset", role=None, d_model=d_model, layer_index=layer_index,
        av_template=DEFAULT_AV_TEMPLATE, ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR,
        injection_scale=injection_scale, base_model=str(base_dir),
    )


def explanations(n: int) -> list[str]:
    return [f"{SUBJECTS[i % 8]} walks to the {PLACES[(i // 8) % 8]} in the morning" for i in range(n)]


def write_ar_dataset(path: Path, side: NLAConfig, vectors: np.ndarray, docs: list[int] | None = None) -> Path:
    n = len(vectors)
    expl = explanations(n)
    table = pa.table({
        "activation_vector": vectors_to_arrow(vectors.astype(np.float32)),
        "doc_id": pa.array(docs if docs is not None else list(range(n)), pa.int64()),
        "prompt": pa.array([side.ar_text(e) for e in expl]),
        "explanation": pa.array(expl),
    })
    pq.write_table(table, path)
    write_sidecar(path, side)
    return path


def write_av_dataset(path: Path, side: NLAConfig, vectors: np.ndarray, responses_expl: list[str]) -> Path:
    n = len(vectors)
    msgs = [[{"role": "user", "content": DEFAULT_AV_TEMPLATE.format(injection_char=AV_PLACEHOLDER)}]] * n
    table = pa.table({
        "activation_vector": vectors_to_arrow(vectors.astype(np.float32)),
        "doc_id": pa.array(list(range(n)), pa.int64()),
        "prompt": pa.array(msgs),
        "response": pa.array([f"<explanation>\n{e}\n</explanation>" for e in responses_expl]),
        "explanation": pa.array(responses_expl),
    })
    pq.write_table(table, path)
    write_sidecar(path, side)
    return path
