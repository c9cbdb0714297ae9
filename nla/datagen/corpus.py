"""Corpus sources for extraction: the synthetic world, or a local text file.

A corpus is a list of `CorpusDoc` with unique, stable integer ids (the RNG for
positions is keyed on them). World documents keep their source object so the
extractor can attach ground-truth facts per token.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nla.datagen.io import DatagenError, read_parquet


@dataclass(frozen=True)
class CorpusDoc:
    """One document: `doc_id` (stable int), `text`, the world Document when there is one, and
    `topic`: the corpus's label of the document (Wikipedia's topic) when it has one; a corpus whose
    documents all have a topic is annotated with the claims of `nla.datagen.wiki` at extraction."""

    doc_id: int
    text: str
    world_doc: Any = None
    topic: str | None = None


def read_text_corpus(path: str | os.PathLike, text_column: str = "text") -> list[CorpusDoc]:
    """Load documents from a local file.

    - `.txt`: one document per blank-line-separated paragraph; a file with no
      blank lines is read as one document per line.
    - `.jsonl`: one JSON object per line, text in `text_column`.
    - `.parquet`: a string column `text_column`.
    Doc ids are the 0-based document order. Empty documents are skipped (ids stay stable).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus_path {path} not found")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        raw = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        if re.search(r"\n[ \t]*\n", raw):
            texts = [" ".join(b.split()) for b in re.split(r"\n[ \t]*\n", raw)]
        else:
            texts = [line.strip() for line in raw.split("\n")]
    elif suffix == ".jsonl":
        texts = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatagenError(
                        f"{path}:{lineno}: invalid JSON ({exc}); one object per line expected"
                    ) from exc
                if not isinstance(obj, dict) or not isinstance(obj.get(text_column), str):
                    raise DatagenError(
                        f"{path}:{lineno}: expected an object with a string field {text_column!r} "
                        f"(config text_column), found {str(obj)[:80]!r}"
                    )
                texts.append(obj[text_column])
    elif suffix == ".parquet":
        table = read_parquet(path)
        if text_column not in table.column_names:
            raise DatagenError(
                f"{path}: no column {text_column!r} (config text_column); found {table.column_names}"
            )
        texts = [t if isinstance(t, str) else "" for t in table.column(text_column).to_pylist()]
    else:
        raise DatagenError(f"corpus_path {path}: unsupported suffix {suffix!r}; use .txt, .jsonl or .parquet")
    docs = [CorpusDoc(i, t) for i, t in enumerate(texts) if t.strip()]
    if not docs:
        raise DatagenError(f"corpus_path {path}: no non-empty documents found; the corpus is empty")
    return docs


def world_corpus(seed: int, n_docs: int, start_id: int = 0) -> list[CorpusDoc]:
    """Documents from the world generator (`nla.world.generate_documents`)."""
    from nla.world import generate_documents

    docs = generate_documents(seed, n_docs, start_id=start_id)
    if not docs:
        raise DatagenError(f"world generator returned no documents for seed={seed}, n_docs={n_docs}")
    return [CorpusDoc(int(d.doc_id), d.text, d) for d in docs]
