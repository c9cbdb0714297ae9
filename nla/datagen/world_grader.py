"""The grader of world datasets (``nla.core.graders`` name ``world``): facts, format checks, oracle.

What ``nla eval``, the RL loop and the format penalty read from a world dataset, through the
registry in ``nla.core.graders``: the core imports none of this module. It speaks the world's
explanation language (``nla.world``) and reads the datagen settings a dataset's sidecar records
(``DatagenConfig``), so it sits in datagen, the layer above the world.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nla.core.graders import DatasetGrader, split_sentences
from nla.datagen.config import datagen_config_of
from nla.datagen.explain import FACTS_HELD, FACTS_UNSURE
from nla.world.explain import (
    FACT_TEMPLATES,
    HEDGE_WORD,
    PHRASINGS,
    QUOTE_HELD,
    QUOTE_RE,
    Grade,
    QuoteGrade,
    TextExplainer,
    cut_quote,
    degeneracy,
    grade,
    grade_quote,
    hedge,
    is_hedged,
    named_in_text,
    oracle_explanation,
    parse_facts,
    parse_hedged_facts,
    stale_claims,
    table_quotes,
    unheld_quote,
)
from nla.world.facts import KINDS, SURFACE_INDEX, VOCAB, Fact, words_with_spans

logger = logging.getLogger(__name__)

__all__ = ["WorldGrader"]


def _same_case(word: str, like: str) -> str:
    return word.capitalize() if like[:1].isupper() else word


def _quote_units(dataset_path: Path) -> int | None:
    """``world_explainer.quote_units`` of the dataset's datagen settings (None: quote all of ``text_end``)."""
    dc = datagen_config_of(dataset_path, "the oracle's quotation")
    return None if dc is None else dc.world_explainer.quote_units


def _truth(facts: Sequence[str] | None) -> list[Fact]:
    try:
        return [Fact.parse(s) for s in (facts or [])]
    except ValueError as err:
        raise ValueError(f"{err}; the facts column must hold 'kind=value' strings of the world") from None


class WorldGrader(DatasetGrader):
    """Fact recall / precision against the row's facts (``nla.world.grade``: quotations are not
    fact claims), the quotation of the text's end graded unit by unit against the row's ``text_end``
    and ``context`` (``nla.world.explain.grade_quote``), the world's degeneracy checks
    (``nla.world.explain.degeneracy``), its oracle and its ``TextExplainer``, both quoting as many
    units as the dataset's datagen settings say (``world_explainer.quote_units``)."""

    name = "world"
    kinds = KINDS
    degeneracy_checks = ("repeated", "broken_quote", "outside_language")

    def grade(self, explanation: str, truth: Sequence[str]) -> Grade:
        return grade(explanation, _truth(truth))

    def earlier(self, table: Any) -> list[frozenset[Fact] | None] | None:
        """Per row, every fact the text read (its ``context``) named up to the token (``named_in_text``); None
        for a table without ``context``, and in a row whose context is null."""
        if "context" not in table.column_names:
            return None
        return [None if c is None else named_in_text(c) for c in table.column("context").to_pylist()]

    def stale(self, explanation: str, truth: Sequence[str], earlier: Any) -> dict[str, int]:
        return stale_claims(explanation, _truth(truth), earlier)

    def degeneracy(self, text: str | None) -> dict[str, bool]:
        d = degeneracy(text)
        return {"repeated": d.repeated_sentence, "broken_quote": d.broken_quote,
                "outside_language": d.outside_language}

    def oracle(self, truth: Sequence[str], quote: str | None, key: int, hedged: Sequence[str] = ()) -> str:
        return oracle_explanation(_truth(truth), quote, key, _truth(hedged))

    def oracle_facts(self, table: Any, dataset_path: Path | None, facts: list[Any]
                     ) -> tuple[list[Any], list[list[str]] | None]:
        """With a ``facts_held`` column (``world_explainer.fact_min_prob``): the held facts firm and, under
        ``fact_unheld: hedge``, the others unsure, the data explainer's rule; else every fact firm."""
        if FACTS_HELD not in table.column_names:
            return facts, None
        held = [set(h or []) for h in table.column(FACTS_HELD).to_pylist()]
        firm = [None if fs is None else [f for f in fs if f in h] for fs, h in zip(facts, held, strict=True)]
        dc = datagen_config_of(dataset_path, "the oracle's facts") if dataset_path is not None else None
        if dc is None or dc.world_explainer.fact_unheld != "hedge":
            return firm, None
        if FACTS_UNSURE in table.column_names:  # fact_omit_below: only these said unsure, the rest left out
            return firm, [list(u or []) for u in table.column(FACTS_UNSURE).to_pylist()]
        return firm, [[f for f in (fs or []) if f not in h] for fs, h in zip(facts, held, strict=True)]

    def hedged_facts(self, text: str | None) -> list[str]:
        return [str(f) for f in parse_hedged_facts(text or "")]

    def quotes(self, table: Any, dataset_path: Path | None = None) -> list[str | None]:
        """The row's ``text_end`` (``current_word`` in older datasets), cut to the dataset's
        ``world_explainer.quote_units`` when its datagen settings set it, and None where its
        ``quote_held`` column is false (``world_explainer.quote_min_prob``): the data explainer's rule."""
        quotes = table_quotes(table) or [None] * table.num_rows
        dc = datagen_config_of(dataset_path, "the oracle's quotation") if dataset_path is not None else None
        w = dc.world_explainer if dc is not None else None
        if w is not None and w.quote_units is not None:
            quotes = [cut_quote(q, w.quote_units) for q in quotes]
        if QUOTE_HELD in table.column_names:  # world_explainer.quote_min_prob: quote only what the vector holds
            unheld = w.quote_unheld if w is not None else "omit"
            quotes = [unheld_quote(q, held, unheld)
                      for q, held in zip(quotes, table.column(QUOTE_HELD).to_pylist(), strict=True)]
        return quotes

    def quote_truths(self, table: Any, dataset_path: Path | None = None) -> list[tuple[str, str | None] | None] | None:
        """Per row ``(text_end, context)`` (context None when the table has none; the row None when its
        ``text_end`` is null); None for a table without ``text_end`` (older datasets quote
        ``current_word``, the last whole word, which is not graded). ``text_end`` is cut to the
        dataset's ``world_explainer.quote_units`` when its datagen settings set it, the rule the data
        explainer and the oracle quote by: a unit the rule does not quote is not a recall target."""
        cols = table.column_names
        if "text_end" not in cols:
            return None
        ends = table.column("text_end").to_pylist()
        n_units = _quote_units(dataset_path) if dataset_path is not None else None
        if n_units is not None:
            ends = [None if e is None else cut_quote(e, n_units) for e in ends]
        contexts = table.column("context").to_pylist() if "context" in cols else [None] * len(ends)
        return [None if e is None else (e, c) for e, c in zip(ends, contexts, strict=True)]

    def grade_quote(self, explanation: str | None, truth: Any) -> QuoteGrade:
        end, context = truth
        return grade_quote(explanation, end, context)

    def quote_truth_of(self, read: str) -> tuple[str, str]:
        """The world's data explainer's quotation of ``read`` (its last TEXT_END_UNITS units)."""
        from nla.world.facts import end_of_text

        return end_of_text(read), read

    def quote_units(self, quoted: str) -> list[str]:
        from nla.world.facts import text_units

        return text_units(quoted)

    # --- the explanation suite (nla.eval.suite): one claim per sentence, the language's phrasings
    def is_quotation(self, claim: str) -> bool:
        return bool(QUOTE_RE.match(claim.strip()))

    def named_facts(self, text: str | None) -> frozenset[str]:
        return frozenset(str(f) for f in parse_facts(text or ""))

    def paraphrase(self, claim: str, rng: Any) -> str | None:
        """The same fact in another of its kind's phrasings (the same surface word), or None for a
        sentence outside the fact phrasings (the quotation, a generic remark, free text). A fact said
        unsure (``Perhaps …``) stays unsure in its new phrasing."""
        if is_hedged(claim):
            rest = claim.strip()[len(HEDGE_WORD):].strip()
            new = self.paraphrase(rest[:1].upper() + rest[1:], rng)
            return None if new is None else hedge(new)
        for kind, i, pattern in PHRASINGS:
            m = pattern.match(claim.strip())
            if m:
                others = [t for j, t in enumerate(FACT_TEMPLATES[kind]) if j != i]
                word = m.group(1)
                template = rng.choice(others)
                w = word.capitalize() if kind == "person" else word.lower()
                return template.format(w=w)
        return None

    def fact_of_word(self, word: str) -> str | None:
        f = SURFACE_INDEX.get(word.strip().lower())
        return None if f is None else str(f)

    def fact_words(self, fact: str) -> tuple[str, ...]:
        return Fact.parse(fact).surfaces

    def facts_of_kind(self, kind: str) -> tuple[str, ...]:
        return tuple(str(Fact(kind, v)) for v in sorted(VOCAB.get(kind, {})))

    def edit_fact(self, text: str, fact: str, new_fact: str) -> str | None:
        """Every surface word of ``fact`` outside quotations becomes ``new_fact``'s canonical word
        (same case); None when no claim names ``fact``."""
        old, new = Fact.parse(fact), Fact.parse(new_fact)
        out, changed = [], False
        for sentence in split_sentences(text):
            if not self.is_quotation(sentence):
                for w, a, b in reversed(words_with_spans(sentence)):
                    if SURFACE_INDEX.get(w) == old:
                        sentence = sentence[:a] + _same_case(new.value, sentence[a:b]) + sentence[b:]
                        changed = True
            out.append(sentence)
        return " ".join(out) if changed else None

    def recall_slots(self, table: Any, dataset_path: Path, subject: Any, tokenizer: Any, layer: int,
                     max_rows: int | None, seed: int = 0) -> dict[str, Any] | None:
        """The recall slots (``nla.world.slots``) of the stories the dataset's rows were read from,
        regenerated from the world seed its datagen settings record; None without those settings
        or a ``doc_id`` column."""
        dc = datagen_config_of(dataset_path)
        if dc is None or dc.source != "world" or "doc_id" not in table.column_names:
            return None
        import numpy as np
        import torch

        from nla.world.build import seeded_config
        from nla.world.generator import generate_documents
        from nla.world.slots import recall_slots

        world_seed = seeded_config(dc.world_preset, dc.world_seed).seed
        docs = [generate_documents(world_seed, 1, start_id=int(d))[0]
                for d in sorted(set(table.column("doc_id").to_pylist()))]
        slots = recall_slots(subject, tokenizer, docs, layer, max_len=dc.max_len)
        n = len(slots["context"])
        if max_rows is not None and n > max_rows:
            keep = np.sort(np.random.default_rng(seed).choice(n, size=max_rows, replace=False))
            slots = {k: (v[torch.as_tensor(keep)] if k == "vectors" else [v[i] for i in keep]) for k, v in slots.items()}
        return slots

    def text_explainer(self, table: Any, dataset_path: Path) -> list[str] | None:
        """The world ``TextExplainer``'s output per row, with the datagen settings recorded in the
        dataset sidecar's provenance (defaults when they cannot be found); None when the table
        carries its own ``explanation`` column or lacks ``facts`` / ``doc_id`` / ``position``."""
        cols = table.column_names
        if "explanation" in cols or not {"facts", "doc_id", "position"} <= set(cols):
            return None
        from nla.datagen.explainer_base import row_key

        seed, kw = 0, {}
        dc = datagen_config_of(dataset_path, "text explainer baseline")
        if dc is not None:
            w = dc.world_explainer
            seed, kw = dc.seed, dict(min_facts=w.min_facts, max_facts=w.max_facts, wrong_rate=w.wrong_rate,
                                     word_rate=w.word_rate, fact_rate=w.fact_rate, quote_units=w.quote_units)
        explainer = TextExplainer(seed=seed, **kw)
        words = self.quotes(table, dataset_path)
        firm, unsure = self.oracle_facts(table, dataset_path, table.column("facts").to_pylist())
        unsure = unsure or [[] for _ in firm]
        return [explainer.explain(frozenset(_truth(fs)), row_key(doc, pos), word, hedged=frozenset(_truth(h)))
                for fs, h, doc, pos, word in zip(firm, unsure, table.column("doc_id").to_pylist(),
                                                 table.column("position").to_pylist(), words, strict=True)]
