"""What a dataset brings to the core: its fact grader, its format checks and its oracle.

The reward, the RL loop and ``nla eval`` grade explanations through this registry and import
no dataset code. A grader is named by the dataset (or chosen by the caller):

- the parquet's schema metadata ``nla.grader`` (``tag_grader`` writes it), else
- ``world`` when the table has a ``facts`` column (every world dataset has one; datasets
  written before the tag existed read the same), else
- none: reconstruction is measured, faithfulness is not.

Built in: ``generic`` (format checks that hold in any language: a repeated sentence, an
unbalanced double quote; no facts, no oracle) and ``world`` (the grader of datasets made from the
synthetic world, ``nla.datagen.world_grader``, imported only when asked for). A user's corpus registers its own with
``register_grader(name, factory)`` or, from an installed package, the entry-point group
``nla.graders`` (``name = "package.module:Factory"``).

A grader whose language quotes the text read (the world's ``The text ends with "…".``) grades the
quotation too (``quote_truths`` / ``grade_quote``): each quoted unit is a claim about the text at its
position from the end, summed up per position by ``quotation_summary`` (``Quotation``), beside the
fact recall / precision, which it leaves as they are.

Ground truth grades explanations; it never enters a reward (the format checks read only the
explanation's text).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "GRADER_METADATA_KEY", "DatasetGrader", "FactGrade", "Faithfulness", "GenericGrader", "QuoteGrade", "Quotation",
    "available_graders", "faithfulness", "get_grader", "grader_for_table", "has_repeated_sentence", "quotation_summary",
    "register_grader", "split_sentences", "tag_grader",
]

GRADER_METADATA_KEY = b"nla.grader"


class FactGrade(Protocol):
    """Faithfulness of one explanation: ``by_kind[kind] = (recall, precision)`` for each kind
    present in the truth or the explanation."""

    recall: float
    precision: float
    by_kind: Mapping[str, tuple[float, float]]


class QuoteGrade(Protocol):
    """One explanation's quotation of the text read, graded unit by unit from the end (position 0 =
    the token read): ``claims[p]`` whether its p-th quoted unit is the text's (one per quoted unit),
    ``recalled[p]`` whether the p-th unit of the text's end is said (one per unit the language
    quotes), ``exact`` whether it is exactly the text's end, ``said`` whether there is a quotation."""

    claims: Sequence[bool]
    recalled: Sequence[bool]
    exact: bool
    said: bool


class DatasetGrader:
    """The base grader: format checks that hold in any language, and nothing that needs truth.

    Subclasses override what their dataset can say:

    - ``grade(explanation, truth) -> FactGrade | None``: truth is the row's ``facts`` strings;
    - ``degeneracy(text) -> {check: flagged}`` over ``degeneracy_checks`` (None/empty: nothing);
    - ``oracle(truth, quote, key) -> str | None``: the most faithful explanation the
      language can say (the ceiling row of ``nla eval``), ``quote`` being the row's entry of
      ``quotes(table)`` (what it quotes of the text read);
    - ``text_explainer(table, dataset_path) -> list[str] | None``: the data's own explainer
      output per row, when the table does not carry it;
    - ``quote_truths(table, dataset_path) -> list | None`` and ``grade_quote(explanation, truth) -> QuoteGrade``:
      what the text read ends with, per row, and an explanation's quotation graded against it
      (None: the language quotes nothing).
    """

    name = "generic"
    kinds: tuple[str, ...] = ()  # the fact kinds it grades, in the order reports list them
    degeneracy_checks: tuple[str, ...] = ("repeated", "broken_quote")

    def grade(self, explanation: str, truth: Sequence[str]) -> FactGrade | None:
        return None

    def earlier(self, table: Any) -> list[Any] | None:
        """Per row of ``table``, what the text read had named up to its token, whether or not it still holds
        (an object put down, a place left), for :meth:`stale`; None when the grader cannot tell (the base)."""
        return None

    def stale(self, explanation: str, truth: Sequence[str], earlier: Any) -> dict[str, int] | None:
        """kind -> the claims of ``explanation`` that are false against ``truth`` but that the text read named
        earlier (``earlier``: the row's entry of :meth:`earlier`): said of the past rather than made up; None
        when the grader cannot tell (the base)."""
        return None

    def degeneracy(self, text: str | None) -> dict[str, bool]:
        if not text or not text.strip():
            return dict.fromkeys(self.degeneracy_checks, False)
        return {"repeated": has_repeated_sentence(split_sentences(text)), "broken_quote": text.count('"') % 2 == 1}

    def degenerate(self, text: str | None) -> bool:
        """Whether any of the format checks flags ``text`` (the format penalty's test)."""
        return any(self.degeneracy(text).values())

    def oracle(self, truth: Sequence[str], quote: str | None, key: int) -> str | None:
        return None

    def oracle_facts(self, table: Any, dataset_path: Path | None, facts: list[Any]
                     ) -> tuple[list[Any], list[list[str]] | None]:
        """What the oracle row says of each row's ``facts`` (the table's ground truth): ``(firm, unsure)``,
        the facts said firmly and, when the data explainer says some unsure, those (passed to ``oracle``
        as ``hedged``; None: none). The base: every fact firm, as the data explainer names them."""
        return facts, None

    def quotes(self, table: Any, dataset_path: Path | None = None) -> list[str | None]:
        """What the oracle quotes of the text read, per row of ``table`` (the base: nothing, None);
        ``dataset_path``: where the table was read from (its settings may say how much to quote)."""
        return [None] * table.num_rows

    def quote_truths(self, table: Any, dataset_path: Path | None = None) -> list[Any] | None:
        """Per row of ``table``, what the text read ends with, for ``grade_quote`` (None in a row: not
        known there), by the dataset's rule of how much is quoted (``dataset_path``: where the table was
        read from, whose settings may say); None when the grader grades no quotation (the base)."""
        return None

    def grade_quote(self, explanation: str | None, truth: Any) -> QuoteGrade | None:
        """The quotation of ``explanation`` graded against ``truth`` (a row's entry of ``quote_truths``);
        None when the grader grades no quotation (the base)."""
        return None

    def quote_truth_of(self, read: str) -> Any:
        """What ``grade_quote`` grades against for any text ``read`` (the text up to and including the
        token), by this language's rule of what a quotation says (the explorer's typed text); None when
        the grader grades no quotation (the base)."""
        return None

    def quote_units(self, quoted: str) -> list[str]:
        """The units (words or marks) of a quotation in reading order, as this language counts them."""
        return quoted.split()

    def text_explainer(self, table: Any, dataset_path: Path) -> list[str] | None:
        return None

    # --- what the explanation suite (``nla.eval.suite``) reads; the base answers for any language, and
    # a grader without truth leaves the truth-based parts of the suite out.
    def claims(self, text: str | None) -> list[str]:
        """The claims of an explanation, in order (the base: its sentences)."""
        return split_sentences(text or "")

    def is_quotation(self, claim: str) -> bool:
        """Whether ``claim`` quotes the text read rather than saying something about it (the base: it
        holds a double-quoted span)."""
        return bool(re.search(r'"[^"]*"', claim))

    def named_facts(self, text: str | None) -> frozenset[str]:
        """The facts (``"kind=value"``) ``text`` claims (empty when the grader has no facts)."""
        return frozenset()

    def hedged_facts(self, text: str | None) -> list[str]:
        """The facts ``text`` says unsure, which it does not claim (the base: none; the wiki's "may")."""
        return []

    def claim_truth(self, claim: str, truth: Sequence[str], quote: Any = None) -> bool | None:
        """True / False when ``claim`` names facts and all of them are / one is not in ``truth``, or
        when it is a quotation and ``quote`` (the row's entry of ``quote_truths``) is given: every
        quoted unit true / one false; None when it names no fact and is not graded as a quotation (a
        generic remark) or the grader has no facts."""
        if quote is not None and self.is_quotation(claim):
            g = self.grade_quote(claim, quote)
            if g is not None:
                if getattr(g, "hedged", None) is not None:
                    return None  # said unsure: not a claim (nla.world.explain.Hedged)
                return bool(g.said and all(g.claims))
        named = self.named_facts(claim)
        return None if not named else named <= set(truth)

    def paraphrase(self, claim: str, rng: Any) -> str | None:
        """Another phrasing of the same claim (``rng``: a ``random.Random``); None when the grader
        cannot rephrase it (``nla.eval.suite`` then keeps the claim, or asks a provider)."""
        return None

    def fact_of_word(self, word: str) -> str | None:
        """The fact (``"kind=value"``) a word of the text names, or None."""
        return None

    def fact_words(self, fact: str) -> tuple[str, ...]:
        """Every word that names ``fact`` (empty when the grader has no facts)."""
        return ()

    def facts_of_kind(self, kind: str) -> tuple[str, ...]:
        """Every fact of ``kind`` the grader knows, as ``"kind=value"``."""
        return ()

    def recall_slots(self, table: Any, dataset_path: Path, subject: Any, tokenizer: Any, layer: int,
                     max_rows: int | None, seed: int = 0) -> dict[str, Any] | None:
        """Rows of the dataset's documents where the subject's next token names a fact already true
        (columns ``context``, ``facts``, ``vectors`` [N, d], at most ``max_rows``, a seeded subset),
        for the suite's causal edits; None when the grader cannot find its documents (the suite
        then uses the dataset's own rows)."""
        return None

    def edit_fact(self, text: str, fact: str, new_fact: str) -> str | None:
        """``text`` with its claim of ``fact`` changed to claim ``new_fact`` in the same words
        otherwise; None when ``text`` does not claim ``fact``."""
        return None


class GenericGrader(DatasetGrader):
    """``generic``: the base checks only."""


@dataclass(frozen=True)
class Quotation:
    """The quotation of the text read, graded per position from the end over ``n`` rows (those with a
    truth); ``by_position["quote[p]"] = (recall, precision)``:

    - recall: of the rows whose text's end has a unit at p, the share whose quotation says it there
      (a row without a quotation, or with a shorter one, counts against it: not said);
    - precision: of the quoted units at p, the share that are the text's (a row that quotes nothing
      at p does not count: None when no row does).

    ``claims["quote[p]"]``: units quoted at p. ``said``: share of rows that quote; ``exact``: share of
    the rows whose text's end is not empty whose quotation is exactly it; ``all_true``: share of the
    rows that quote whose every quoted unit is true (None when none quotes). ``hedged``: share of rows
    whose quotation is said unsure (``nla.world.explain.Hedged``: not said, in every figure above);
    ``hedged_true``: of those, the share whose every unit is true anyway (None when none hedges)."""

    n: int
    said: float | None
    exact: float | None
    all_true: float | None
    by_position: dict[str, tuple[float | None, float | None]]
    claims: dict[str, int]
    hedged: float | None = None
    hedged_true: float | None = None


def quotation_summary(texts: Sequence[str | None], truths: Sequence[Any], grader: DatasetGrader
                      ) -> Quotation | None:
    """``Quotation`` of ``texts`` (None: said nothing) against each row's quote truth (``truths``,
    the grader's ``quote_truths``; a None entry: ungraded row); None when the grader grades no
    quotation."""
    if len(texts) != len(truths):
        raise ValueError(f"quotation: {len(texts)} texts for {len(truths)} quote truths")
    grades = []
    for i, (t, q) in enumerate(zip(texts, truths, strict=True)):
        if q is None:
            continue
        try:
            g = grader.grade_quote(t, q)
        except ValueError as err:
            raise ValueError(f"text_end: row {i}: {err}") from None
        if g is None:
            return None
        grades.append(g)
    if not grades:
        return Quotation(0, None, None, None, {}, {})
    depth = max(max(len(g.claims), len(g.recalled)) for g in grades)
    by_position, claims = {}, {}
    for p in range(depth):
        hits = [g.recalled[p] for g in grades if p < len(g.recalled)]
        said = [g.claims[p] for g in grades if p < len(g.claims)]
        by_position[f"quote[{p}]"] = (float(np.mean(hits)) if hits else None, float(np.mean(said)) if said else None)
        claims[f"quote[{p}]"] = len(said)
    with_end = [g for g in grades if len(g.recalled)]
    quoting = [g for g in grades if g.said]
    hedging = [g.hedged for g in grades if getattr(g, "hedged", None) is not None]
    return Quotation(
        n=len(grades), said=len(quoting) / len(grades),
        exact=float(np.mean([g.exact for g in with_end])) if with_end else None,
        all_true=float(np.mean([all(g.claims) for g in quoting])) if quoting else None,
        by_position=by_position, claims=claims, hedged=len(hedging) / len(grades),
        hedged_true=float(np.mean([all(h) for h in hedging])) if hedging else None)


@dataclass(frozen=True)
class Faithfulness:
    """Mean fact recall / precision over the rows with ground truth; ``by_kind[kind] = (recall,
    precision)``; ``n`` rows graded. A row whose ``facts`` is null has no ground truth and is not
    graded (it is not a perfect row); when no row has any, ``recall`` / ``precision`` are None and
    ``note`` says so (``note`` also counts the ungraded rows when some are).
    ``quote``: the quotation of the text read graded per position (``Quotation``), when the grader
    grades one and the quote truths were given; the fact figures do not count it.

    A row whose ``facts`` is an empty list says "nothing holds": its recall is undefined (there is
    nothing to recall; graders call it 1.0, and a dataset of empty lists graded every explanation,
    the shuffled baseline's too, at recall 1.0: issue 58), so it is left out of ``recall``; it counts
    in ``precision`` only when the explanation names a fact (every such claim is false: 0), since
    naming nothing where nothing holds is neither right nor wrong. ``recall`` is None when no row
    has a fact to recall, ``precision`` None when no row has a claim or a truth to grade it by."""

    recall: float | None
    precision: float | None
    by_kind: dict[str, tuple[float, float]]
    n: int
    note: str | None = None
    quote: Quotation | None = None
    # kind -> (share of the graded rows that say a claim of it unsure, share of those true anyway), for a
    # grader whose grades carry ``hedged`` (the wiki's: ``wiki_explainer.unheld: hedge``); not in the above
    hedged: dict[str, tuple[float, float]] | None = None
    # kind -> (claims of it said over the graded rows, the share of them true), for a grader whose grades
    # carry ``said`` (the wiki's): precision over the claims made, where ``by_kind`` counts a row that does
    # not say the kind as precise
    said: dict[str, tuple[int, float]] | None = None
    # kind -> the share of its claims (those ``said`` counts) that are false but name something the text read
    # said earlier, no longer true at the token (an object put down), for a grader that tells them
    # (``DatasetGrader.stale``: the world's); a row whose ``earlier`` is unknown counts none
    stale: dict[str, float] | None = None


def faithfulness(texts: list[str | None], facts: list[list[str]], grader: DatasetGrader | None = None,
                 quotes: Sequence[Any] | None = None, earlier: Sequence[Any] | None = None) -> Faithfulness | None:
    """Mean recall / precision of ``texts`` (None = claimed nothing) against each row's ``facts``,
    graded by ``grader`` (the world grader when None: a ``facts`` column of "kind=value"
    strings); None when the grader grades no facts. A row whose facts are None (a null in the
    column) has no ground truth: it is left out, not graded as perfect; with none left, recall and
    precision are None and ``note`` says "no ground truth" (an empty list is a truth: nothing holds).
    ``quotes``: each row's quote truth (the grader's ``quote_truths``), for ``Faithfulness.quote``;
    ``earlier``: each row's entry of the grader's ``earlier``, for ``Faithfulness.stale``."""
    grader = grader or get_grader("world")
    if len(texts) != len(facts):
        raise ValueError(f"faithfulness: {len(texts)} texts for {len(facts)} fact lists")
    if earlier is not None and len(earlier) != len(texts):
        raise ValueError(f"faithfulness: {len(earlier)} rows of what the text said earlier for {len(texts)} texts")
    quote = quotation_summary(texts, quotes, grader) if quotes is not None else None
    recalls, precisions = [], []
    per_kind: dict[str, list[tuple[float, float]]] = {}
    missing = [i for i, fs in enumerate(facts) if fs is None]
    if missing and len(missing) == len(facts):
        if grader.grade("", []) is None:
            return None
        return Faithfulness(None, None, {}, 0, note=f"no ground truth: facts is null on every row ({len(facts)}); "
                                                   "recall and precision are not graded", quote=quote)
    empty = 0
    hedged: dict[str, list[bool]] = {}
    said: dict[str, list[int]] = {}
    stale: dict[str, int] = {}
    told_rows = 0  # graded rows whose earlier facts the grader told apart
    for i, (t, fs) in enumerate(zip(texts, facts, strict=True)):
        if fs is None:
            continue
        try:
            g = grader.grade(t or "", list(fs))
        except ValueError as err:
            raise ValueError(f"facts: row {i}: {err}") from None
        if g is None:
            return None
        if not len(fs):  # nothing holds: no recall; precision only of what it claims (see Faithfulness)
            empty += 1
            # a claim where nothing holds is false (precision below 1), whichever way the grader names facts
            if g.precision < 1.0 or grader.named_facts(t):
                precisions.append(g.precision)
            continue
        recalls.append(g.recall)
        precisions.append(g.precision)
        for k, rp in g.by_kind.items():
            per_kind.setdefault(k, []).append(rp)
        for k, right in (getattr(g, "hedged", None) or {}).items():
            hedged.setdefault(k, []).append(right)
        for k, (n_said, n_true) in (getattr(g, "said", None) or {}).items():
            tot = said.setdefault(k, [0, 0])
            tot[0] += n_said
            tot[1] += n_true
        if earlier is not None and earlier[i] is not None:
            told = grader.stale(t or "", list(fs), earlier[i])
            if told is not None:
                told_rows += 1
                for k, n_stale in told.items():
                    stale[k] = stale.get(k, 0) + n_stale
    order = [k for k in grader.kinds if k in per_kind] + sorted(set(per_kind) - set(grader.kinds))
    by_kind = {k: (float(np.mean([r for r, _ in per_kind[k]])), float(np.mean([p for _, p in per_kind[k]])))
               for k in order}
    notes = ([f"{len(missing)} of {len(facts)} rows have no ground truth (facts null) and are not graded"]
             if missing else [])
    if empty:
        notes.append(f"{empty} of {len(facts)} rows have no fact that holds (facts []): left out of recall, in "
                     "precision only where the explanation names a fact")
    return Faithfulness(float(np.mean(recalls)) if recalls else None,
                        float(np.mean(precisions)) if precisions else None, by_kind, len(recalls),
                        note="; ".join(notes) or None, quote=quote,
                        hedged={k: (len(v) / len(recalls), float(np.mean(v))) for k, v in hedged.items()}
                        if hedged and recalls else None,
                        said={k: (n, t / n) for k, (n, t) in said.items()} if said else None,
                        stale={k: stale.get(k, 0) / n for k, (n, _) in said.items()} if said and told_rows else None)


# ------------------------------------------------------------------ text helpers (any language)
# A sentence ends in . ? or !; a period inside a quotation does not end one.
_SENTENCE_RE = re.compile(r'(?:"[^"]*"|[^.?!"]|"(?=[^"]*$))*[.?!]')


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (ending in . ? or !; a period inside quotes does not end one); trailing
    text without a stop counts as a sentence too."""
    text = text.strip()
    out = [m.group().strip() for m in _SENTENCE_RE.finditer(text)]
    rest = _SENTENCE_RE.sub("", text).strip()
    return [s for s in out if s] + ([rest] if rest else [])


def shuffle_sentences(text: str, rng: Any) -> str:
    """``text``'s sentences (``split_sentences``) in a random order drawn from ``rng`` (a
    ``numpy.random.Generator``), joined by one space: the same claims, another order. A reader
    trained on such texts cannot use the order of the claims as a code (the suite's hidden-code
    test measures what re-ordering costs)."""
    sentences = split_sentences(text)
    return " ".join(sentences[i] for i in rng.permutation(len(sentences)))


def has_repeated_sentence(sentences: list[str]) -> bool:
    """The same sentence twice (case-insensitive), in any language."""
    lowered = [s.lower() for s in sentences]
    return len(set(lowered)) < len(lowered)


# ------------------------------------------------------------------ the registry
GraderFactory = Callable[[], DatasetGrader]
# name -> factory, or "module:attr" imported on first use (so this module imports no dataset code)
_REGISTRY: dict[str, GraderFactory | str] = {"generic": GenericGrader, "world": "nla.datagen.world_grader:WorldGrader",
                                                 "wiki": "nla.datagen.wiki:WikiGrader"}
_INSTANCES: dict[str, DatasetGrader] = {}
_ENTRY_POINTS_READ = False


def register_grader(name: str, factory: GraderFactory | str, *, replace: bool = False) -> None:
    """Make ``name`` resolve to ``factory()`` (a callable, or ``"module:attr"``). An existing name
    is refused unless ``replace``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_grader: name must be a non-empty string, found {name!r}")
    _read_entry_points()
    if name in _REGISTRY and not replace:
        raise ValueError(f"register_grader: {name!r} is already registered; pass replace=True to replace it")
    _REGISTRY[name] = factory
    _INSTANCES.pop(name, None)


def available_graders() -> list[str]:
    _read_entry_points()
    return sorted(_REGISTRY)


def get_grader(name: str) -> DatasetGrader:
    """The grader registered as ``name`` (one instance per name)."""
    _read_entry_points()
    if name not in _REGISTRY:
        raise ValueError(f"grader: expected one of {sorted(_REGISTRY)}, found {name!r}; register a dataset's "
                         "grader with nla.core.graders.register_grader(name, factory)")
    if name not in _INSTANCES:
        factory = _REGISTRY[name]
        if isinstance(factory, str):
            module, _, attr = factory.partition(":")
            factory = getattr(importlib.import_module(module), attr)
        grader = factory()
        if not isinstance(grader, DatasetGrader):
            raise TypeError(f"grader {name!r}: its factory returned {type(grader).__name__}, not a DatasetGrader")
        _INSTANCES[name] = grader
    return _INSTANCES[name]


def grader_for_table(table: Any) -> DatasetGrader | None:
    """The grader a pyarrow table names (module docstring): its ``nla.grader`` metadata, else
    ``world`` when it has a ``facts`` column, else None."""
    meta = table.schema.metadata or {}
    if GRADER_METADATA_KEY in meta:
        return get_grader(meta[GRADER_METADATA_KEY].decode())
    return get_grader("world") if "facts" in table.column_names else None


def tag_grader(table: Any, name: str) -> Any:
    """``table`` with its schema metadata naming the grader ``name`` (which must be registered)."""
    get_grader(name)
    meta = dict(table.schema.metadata or {})
    meta[GRADER_METADATA_KEY] = name.encode()
    return table.replace_schema_metadata(meta)


def _read_entry_points() -> None:
    global _ENTRY_POINTS_READ
    if _ENTRY_POINTS_READ:
        return
    _ENTRY_POINTS_READ = True
    from importlib.metadata import entry_points

    for ep in entry_points(group="nla.graders"):
        _REGISTRY.setdefault(ep.name, ep.value)
