"""Claims a real model's vector can be explained by, each one checkable against the row: the
language of ``source: wikipedia`` datasets, their data explainer (``wiki``) and their grader (``wiki``).

A row is one token of a Wikipedia lead extract read by the subject (SmolLM2-135M-Instruct in the
``smollm2`` quickstart). What is true of it, and only that, is said, one sentence a claim:

============  ===========================================  =============================================
kind          sentence                                     true when
============  ===========================================  =============================================
``quote``     ``The text ends with "city".``                the quoted span is the last ``QUOTE_UNITS``
                                                            word or mark of the text read, as written
                                                            (``text_end``): the token read's unit
``topic``     ``The article is about Geography.``           the article's topic label (the corpus's own)
``next``      ``The model expects "," next.``               the subject's most likely next token there
                                                            (its own forward pass, at extraction)
``position``  ``This is early in the article.``             the token's index falls in that bucket
                                                            (``POSITION_BUCKETS``)
============  ===========================================  =============================================

The truth of a row is the list of these claims as ``"kind=value"`` strings in its ``facts`` column
(``row_claims``), so ``nla eval`` grades recall and precision per kind as it does the world's facts:
recall of a kind = the row's true claim of that kind said; precision = the claims of that kind said
that are true. A sentence in none of these forms is a claim nothing can check: it counts against
precision (kind ``other``) and the format check ``outside_language`` flags it.

Truth grades explanations; it never enters a reward (the reward is the reconstruction alone, and
the format checks read only the explanation's text).

Why our own code: the claims are specific to how nla reads a real model (the quotation's units,
the subject's next token from the extraction's forward pass); no library grades them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nla.core.graders import DatasetGrader, has_repeated_sentence, split_sentences
from nla.datagen.explainer_base import Explainer, register_explainer

__all__ = ["HELD_COLUMN", "KINDS", "POSITION_BUCKETS", "QUOTE_UNITS", "UNHELD", "WikiExplainer", "WikiGrader",
           "add_claims_held", "claim_sentence", "explanation_of", "hedged_claims", "parse_claims", "parse_hedged",
           "position_bucket", "row_claims", "text_end"]

logger = logging.getLogger(__name__)

KINDS = ("quote", "topic", "next", "position")
UNHELD = ("omit", "hedge")  # what is said of a claim the vector does not hold (wiki_explainer.unheld)
# The quotation is the unit the token read ends (1), not more: a linear probe on SmolLM2's block-10
# vectors (dev/experiments/wiki_probe.py, 9,600 training rows, other articles' rows held out) names the
# token read on 0.59 of rows, the one before it on 0.32 and the one before that on 0.17; the preset's AV
# quoting three units had the token read right on 0.52-0.60 of rows and each earlier unit on ~0.05, so
# two of every three quoted units were false (BENCHMARKS.md, "SmolLM2-135M explained"; issue 57's rule:
# quote only what the vector holds).
QUOTE_UNITS = 1
# (bucket, first token index of the bucket); a token at index p is in the last bucket whose start <= p
POSITION_BUCKETS = (("start", 0), ("early", 8), ("later", 32))
_POSITION_SENTENCES = {"start": "This is at the start of the article.", "early": "This is early in the article.",
                       "later": "This is later in the article."}

# A unit of the text: a run of letters or digits (any script), or one other non-space character.
_UNIT_RE = re.compile(r"[^\W_]+|[^\s]", re.UNICODE)
_QUOTE_RE = re.compile(r'^The text ends with "(.+)"\.$')
# A claim said unsure (``wiki_explainer.unheld: hedge``): where a probe does not read the claim's value
# from the vector, the data explainer still says it, but as "may"; the grader counts it as not said.
_HEDGED_POSITION = {"start": "This may be at the start of the article.", "early": "This may be early in the article.",
                    "later": "This may be later in the article."}
_HEDGED_RE = (("quote", re.compile(r'^The text may end with "(.+)"\.$')),
              ("topic", re.compile(r"^The article may be about (.+)\.$")),
              ("next", re.compile(r'^The model may expect "(.+)" next\.$')))
HELD_COLUMN = "claims_held"  # the kinds a probe reads from the row's vector (add_claims_held)
_TOPIC_RE = re.compile(r"^The article is about (.+)\.$")
_NEXT_RE = re.compile(r'^The model expects "(.+)" next\.$')
_POSITION_RE = {v: k for k, v in _POSITION_SENTENCES.items()}


def text_end(context: str, n_units: int = QUOTE_UNITS) -> str:
    """The last ``n_units`` words or marks of ``context`` as written (runs of white space made one
    space, double quotes dropped; ``nla.world.facts.end_of_text`` over this language's units); it ends
    where ``context`` ends, so a token inside a word quotes the word's part read so far, and a mark is
    quoted with the words before it ("" when empty).

    >>> text_end("It lies on the Seine, in")
    'Seine, in'
    >>> text_end("The Oscars (")
    'The Oscars ('
    """
    if n_units < 1:
        raise ValueError(f"text_end: n_units must be >= 1, found {n_units}")
    from nla.world.facts import end_of_text  # here: importing nla.datagen must not load the world (RL, eval)

    return end_of_text(context, n_units, _UNIT_RE)


def text_units(text: str) -> list[str]:
    """The words and marks of ``text`` in order, as ``text_end`` counts them (double quotes dropped)."""
    from nla.world.facts import text_units as world_units

    return world_units(text, _UNIT_RE)


def position_bucket(position: int) -> str:
    """The bucket of a token index (``POSITION_BUCKETS``)."""
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ValueError(f"position: expected a token index >= 0, found {position!r}")
    return [name for name, start in POSITION_BUCKETS if position >= start][-1]


def _clean(value: str) -> str:
    return " ".join(value.replace('"', "").split())


def row_claims(context: str, position: int, topic: str | None, next_token: str | None) -> list[str]:
    """Every claim true of a row, as ``"kind=value"`` (the ``facts`` column): the quotation of the
    text's end (when the text has a word or mark), the topic (when the corpus labels one), the
    subject's next token (when it is more than white space or a double quote) and the position."""
    out = []
    quote = text_end(context)
    if quote:
        out.append(f"quote={quote}")
    if topic and _clean(topic):
        out.append(f"topic={_clean(topic)}")
    nxt = _clean(next_token or "")
    if nxt:
        out.append(f"next={nxt}")
    out.append(f"position={position_bucket(position)}")
    return out


def claim_sentence(claim: str, hedged: bool = False) -> str:
    """The sentence that states a ``"kind=value"`` claim; ``hedged``: the same claim said unsure."""
    kind, sep, value = claim.partition("=")
    if not sep or kind not in KINDS or not value:
        raise ValueError(f"claim: expected 'kind=value' with kind one of {KINDS}, found {claim!r}")
    if kind == "quote":
        return f'The text may end with "{value}".' if hedged else f'The text ends with "{value}".'
    if kind == "topic":
        return f"The article may be about {value}." if hedged else f"The article is about {value}."
    if kind == "next":
        return f'The model may expect "{value}" next.' if hedged else f'The model expects "{value}" next.'
    if value not in _POSITION_SENTENCES:
        raise ValueError(f"claim {claim!r}: position must be one of {sorted(_POSITION_SENTENCES)}")
    return _HEDGED_POSITION[value] if hedged else _POSITION_SENTENCES[value]


def explanation_of(claims: Sequence[str], held: Sequence[str] | None = None, unheld: str = "hedge") -> str:
    """The explanation saying ``claims`` in the order of ``KINDS`` (the data explainer's and the oracle's).
    ``held``: the kinds said firmly (None: all); a claim of another kind is said unsure (``unheld``
    hedge) or left out (omit)."""
    if unheld not in UNHELD:
        raise ValueError(f"unheld: expected one of {UNHELD}, found {unheld!r}")
    order = {k: i for i, k in enumerate(KINDS)}
    out = []
    for c in sorted(claims, key=lambda c: order[c.partition("=")[0]]):
        firm = held is None or c.partition("=")[0] in held
        if firm or unheld == "hedge":
            out.append(claim_sentence(c, hedged=not firm))
    return " ".join(out)


def _sentences(text: str) -> list[str]:
    # a full stop inside a quotation does not end a sentence (split_sentences knows), and the
    # quotation may itself end in a mark: '"in 1990."' then '.'
    return [s.strip() for s in split_sentences(text or "") if s.strip()]


def parse_hedged(sentence: str) -> str | None:
    """The ``"kind=value"`` a sentence says unsure (``The article may be about X.``), or None."""
    s = sentence.strip()
    for kind, pattern in _HEDGED_RE:
        m = pattern.match(s)
        if m and _clean(m.group(1)):
            return f"{kind}={_clean(m.group(1))}"
    return next((f"position={k}" for k, v in _HEDGED_POSITION.items() if v == s), None)


def parse_claim(sentence: str) -> str | None:
    """The ``"kind=value"`` a sentence states, or None when it is in none of the claim forms."""
    s = sentence.strip()
    for kind, pattern in (("quote", _QUOTE_RE), ("topic", _TOPIC_RE), ("next", _NEXT_RE)):
        m = pattern.match(s)
        if m and _clean(m.group(1)):
            return f"{kind}={_clean(m.group(1))}"
    if s in _POSITION_RE:
        return f"position={_POSITION_RE[s]}"
    return None


def _parse(text: str | None) -> tuple[list[str], list[str], int]:
    """(the claims an explanation states, the claims it says unsure, its sentences in neither form)."""
    claims, hedged, other = [], [], 0
    for s in _sentences(text or ""):
        c = parse_claim(s)
        if c is not None:
            claims.append(c)
        elif (h := parse_hedged(s)) is not None:
            hedged.append(h)
        else:
            other += 1
    return claims, hedged, other


def parse_claims(text: str | None) -> tuple[list[str], int]:
    """(the claims an explanation states, in order; the number of its sentences in no claim form). A
    claim said unsure (``parse_hedged``) is neither: it states nothing and is in the language."""
    claims, _, other = _parse(text)
    return claims, other


def hedged_claims(text: str | None) -> list[str]:
    """The claims an explanation says unsure, in order (``parse_hedged``)."""
    return _parse(text)[1]


@dataclass(frozen=True)
class ClaimGrade:
    """One explanation's grade: overall recall / precision and ``by_kind[kind] = (recall, precision)``
    for every kind in the truth or the explanation (a kind said but not true: recall 1.0 by
    convention, as nothing was missed; a kind true but not said: precision 1.0)."""

    recall: float
    precision: float
    by_kind: dict[str, tuple[float, float]] = field(default_factory=dict)
    # kind -> whether the claim said unsure is true anyway (the first of each kind; not in the figures above)
    hedged: dict[str, bool] = field(default_factory=dict)
    # kind -> (claims of it said, of those true): precision over the claims said, where ``by_kind``'s
    # counts a row that does not say the kind as precise
    said: dict[str, tuple[int, int]] = field(default_factory=dict)


def grade_claims(explanation: str | None, truth: Sequence[str]) -> ClaimGrade:
    """Recall = share of the true claims said; precision = share of the claims said that are true
    (a sentence in no claim form counts as one false claim, kind ``other``). No claim said:
    precision 1.0 (nothing false was said), recall 0 unless nothing is true."""
    said, unsure, other = _parse(explanation)
    said_set, truth_set = list(dict.fromkeys(said)), set(truth)
    hits = [c for c in said_set if c in truth_set]
    n_said = len(said_set) + other
    recall = len(hits) / len(truth_set) if truth_set else 1.0
    precision = len(hits) / n_said if n_said else 1.0
    by_kind: dict[str, tuple[float, float]] = {}
    said_by_kind: dict[str, tuple[int, int]] = {}
    for kind in KINDS:
        t = {c for c in truth_set if c.startswith(kind + "=")}
        s = [c for c in said_set if c.startswith(kind + "=")]
        if not t and not s:
            continue
        h = sum(c in t for c in s)
        by_kind[kind] = (h / len(t) if t else 1.0, h / len(s) if s else 1.0)
        if s:
            said_by_kind[kind] = (len(s), h)
    if other:
        by_kind["other"] = (1.0, 0.0)
    hedged: dict[str, bool] = {}
    for c in unsure:
        hedged.setdefault(c.partition("=")[0], c in truth_set)
    return ClaimGrade(recall, precision, by_kind, hedged, said_by_kind)


class WikiGrader(DatasetGrader):
    """The grader of ``source: wikipedia`` datasets (``nla.core.graders`` name ``wiki``): claim recall and
    precision per kind, the format checks (a repeated sentence, an unbalanced quote, a sentence in
    no claim form), and the oracle (every true claim, said as the data explainer says it)."""

    name = "wiki"
    kinds = KINDS
    degeneracy_checks = ("repeated", "broken_quote", "outside_language")

    def grade(self, explanation: str, truth: Sequence[str]) -> ClaimGrade:
        for c in truth:
            if not isinstance(c, str) or c.partition("=")[0] not in KINDS:
                raise ValueError(f"claim {c!r}: expected 'kind=value' with kind one of {KINDS}")
        return grade_claims(explanation, truth)

    def degeneracy(self, text: str | None) -> dict[str, bool]:
        if not text or not text.strip():
            return dict.fromkeys(self.degeneracy_checks, False)
        sentences = _sentences(text)
        return {"repeated": has_repeated_sentence(sentences), "broken_quote": text.count('"') % 2 == 1,
                "outside_language": any(parse_claim(s) is None and parse_hedged(s) is None for s in sentences)}

    def oracle(self, truth: Sequence[str], quote: Any, key: int) -> str:
        """Every true claim; ``quote``: the row's entry of ``quotes`` (None: every claim firm, else
        (the kinds held, what is said of the others), as the data explainer said them)."""
        if quote is None:
            return explanation_of(truth)
        held, unheld = quote
        return explanation_of(truth, held, unheld)

    def quotes(self, table: Any, dataset_path: Any = None) -> list[Any]:
        """Per row what the oracle needs beside the truth: None (every claim firm) unless the dataset
        has a ``claims_held`` column (``wiki_explainer.*_min_prob``), then (the kinds held there, the
        dataset's ``wiki_explainer.unheld``: hedge when its datagen settings cannot be read)."""
        if HELD_COLUMN not in table.column_names:
            return [None] * table.num_rows
        unheld = "hedge"
        if dataset_path is not None:
            from nla.datagen.config import datagen_config_of

            dc = datagen_config_of(dataset_path, "the oracle's claims")
            unheld = dc.wiki_explainer.unheld if dc is not None else unheld
        return [None if h is None else (tuple(h), unheld) for h in table.column(HELD_COLUMN).to_pylist()]

    # --- the quotation graded unit by unit (as the world's: nla.world.explain.QuoteGrade), over this
    # language's units (letters or digits of any script, or one mark)
    def quote_truths(self, table: Any, dataset_path: Any = None) -> list[tuple[str, str | None] | None] | None:
        """Per row ``(the quote claim's value, context)`` (None where the row has no quote claim); None
        for a table without ``facts``."""
        cols = table.column_names
        if "facts" not in cols:
            return None
        facts = table.column("facts").to_pylist()
        contexts = table.column("context").to_pylist() if "context" in cols else [None] * len(facts)
        out: list[tuple[str, str | None] | None] = []
        for fs, ctx in zip(facts, contexts, strict=True):
            q = next((f.partition("=")[2] for f in fs or [] if f.startswith("quote=")), None)
            out.append(None if q is None else (q, ctx))
        return out

    def grade_quote(self, explanation: str | None, truth: Any) -> Any:
        from nla.world.explain import grade_quote

        end, context = truth
        said = [c.partition("=")[2] for c in parse_claims(explanation)[0] if c.startswith("quote=")]
        return grade_quote(explanation, end, context, quoted=said[0] if said else None, unit_re=_UNIT_RE,
                           what="quote claim")

    def quote_truth_of(self, read: str) -> tuple[str, str]:
        """This language's quotation of ``read``: the unit the token read ends (``text_end``)."""
        return text_end(read), read

    def quote_units(self, quoted: str) -> list[str]:
        return text_units(quoted)

    # --- the suite's causal edits (nla.eval.suite.causal): the next-token claim is the subject's own
    # prediction, so editing it and patching the AR's reading of the edited text into the subject
    # asks whether the claim moves what the model predicts. Its values are open (any token): the
    # suite edits to another value seen in the rows (facts_of_kind is empty).
    def fact_of_word(self, word: str) -> str | None:
        """The next-token claim a predicted token makes (``word`` as the tokenizer decodes it)."""
        value = _clean(word)
        return f"next={value}" if value else None

    def fact_words(self, fact: str) -> tuple[str, ...]:
        kind, _, value = fact.partition("=")
        return (value,) if kind == "next" and value else ()

    def edit_fact(self, text: str, fact: str, new_fact: str) -> str | None:
        """``text`` with its next-token claim of ``fact`` saying ``new_fact`` instead (other kinds: None)."""
        if not (fact.startswith("next=") and new_fact.startswith("next=")):
            return None
        old, new = claim_sentence(fact), claim_sentence(new_fact)
        return text.replace(old, new, 1) if old in text else None

    def claims(self, text: str | None) -> list[str]:
        return _sentences(text or "")

    def is_quotation(self, claim: str) -> bool:
        return False  # the quotation is a claim here, graded like the others

    def named_facts(self, text: str | None) -> frozenset[str]:
        return frozenset(parse_claims(text)[0])

    def hedged_facts(self, text: str | None) -> list[str]:
        return hedged_claims(text)


class WikiExplainer(Explainer):
    """The data explainer of ``source: wikipedia``: every claim true of the row (its ``facts``),
    in the order of ``KINDS``; it says nothing it cannot check. Where the row has a ``claims_held``
    column (``add_claims_held``), a claim whose kind is not in it is said unsure (``unheld``
    hedge) or left out (omit)."""

    name = "wiki"

    def __init__(self, unheld: str = "hedge") -> None:
        super().__init__()
        if unheld not in UNHELD:
            raise ValueError(f"wiki_explainer.unheld: expected one of {UNHELD}, found {unheld!r}")
        self.unheld = unheld

    def explain_batch(self, rows: list[dict[str, Any]]) -> list[str | None]:
        from nla.datagen.io import DatagenError

        out: list[str | None] = []
        for r in rows:
            facts = r.get("facts")
            if facts is None:
                raise DatagenError(f"wiki explainer: row doc_id={r.get('doc_id')} position={r.get('position')} has "
                                   "no 'facts' column; it needs source: wikipedia activations")
            text = explanation_of(facts, r.get(HELD_COLUMN), self.unheld) if facts else ""
            if not text:
                self.drops["wiki_no_claims"] += 1
                out.append(None)
            else:
                out.append(text)
        return out


def add_claims_held(tables: dict[str, Any], min_prob: dict[str, float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each table with a ``claims_held`` column: the kinds whose true value a linear probe reads from the
    row's vector with probability >= ``min_prob[kind]`` (``nla.core.probing.held_units``; a kind not in
    ``min_prob`` is always held). The probes learn from the warm-start splits (``av_sft``, ``ar_sft``),
    each row read by the probe fitted on the other half of their articles; the other splits (held-out
    articles, eval among them) by the probe fitted on all of them. The data explainer then says firmly
    only what the vector holds, so what the AV learns to claim is what it can read (issue 57's rule,
    as ``world_explainer.quote_min_prob`` does for the world's quotation). Returns the tables and a
    summary (the share held per kind and split)."""
    import numpy as np
    import pyarrow as pa

    from nla.core.probing import held_units
    from nla.datagen.io import DatagenError, read_vectors, require_split_columns

    bad = sorted(set(min_prob) - set(KINDS))
    if bad:
        raise DatagenError(f"wiki_explainer: min_prob names {bad}; the kinds are {list(KINDS)}")
    fit = [n for n in ("av_sft", "ar_sft") if n in tables]
    require_split_columns(tables, ("facts", "doc_id", "activation_vector"), "wiki_explainer",
                          "the probes need source: wikipedia activations (rerun extract)")
    if not fit:
        raise DatagenError("wiki_explainer: the probes learn from the warm-start splits (av_sft, ar_sft); none given")
    others = [n for n in tables if n not in fit]

    facts = {n: t.column("facts").to_pylist() for n, t in tables.items()}

    def values(name: str, kind: str) -> list[str | None]:
        return [next((f.partition("=")[2] for f in fs or [] if f.startswith(kind + "=")), None) for fs in facts[name]]

    x = np.concatenate([read_vectors(tables[n]) for n in fit])
    groups = [d for n in fit for d in tables[n].column("doc_id").to_pylist()]
    x_other = np.concatenate([read_vectors(tables[n]) for n in others]) if others else None
    held: dict[str, np.ndarray] = {}  # kind -> [rows of fit + others]
    for step, (kind, p) in enumerate(min_prob.items(), start=1):
        v = [w for n in fit for w in values(n, kind)]
        has = np.array([w is not None for w in v], dtype=bool)
        logger.info("explain: probe %d of %d (%s, p >= %.2f): fitting on %d rows, cross-fitted by article", step,
                    len(min_prob), kind, p, int(has.sum()))
        v_other = [w for n in others for w in values(n, kind)]
        h_fit, h_other = held_units(x[has], [w for w, k in zip(v, has, strict=True) if k],
                                    [g for g, k in zip(groups, has, strict=True) if k], p,
                                    x_other=x_other, units_other=[w or "" for w in v_other] if others else None)
        flags = np.zeros(len(v), dtype=bool)
        flags[has] = h_fit
        if others:
            flags = np.concatenate([flags, np.asarray(h_other, dtype=bool) & np.array([w is not None for w in v_other])])
        held[kind] = flags
    out, summary, start = dict(tables), {}, 0
    for n in fit + others:
        k = tables[n].num_rows
        rows = [[kind for kind in KINDS if kind not in held or bool(held[kind][start + i])] for i in range(k)]
        out[n] = tables[n].append_column(HELD_COLUMN, pa.array(rows, pa.list_(pa.string())))
        summary[n] = {kind: round(float(held[kind][start:start + k].mean()), 4) if k else None for kind in held}
        start += k
    for n, shares in summary.items():
        logger.info("explain: the probes read at min_prob %s: %s of %s's rows", min_prob,
                    ", ".join(f"{kind} {100 * (s or 0):.1f}%" for kind, s in shares.items()), n)
    return out, {"min_prob": dict(min_prob), "share": summary}


@register_explainer("wiki")
def _wiki(cfg: Any) -> Explainer:
    return WikiExplainer(cfg.wiki_explainer.unheld)
