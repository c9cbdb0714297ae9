"""The world's explanation language: render facts to English, parse them back, grade.

Explanations use a controlled vocabulary: each fact is named by one of its surface
words (see ``nla.world.facts.VOCAB``); the glue words of the templates never collide
with surface words, so ``parse_facts`` recovers exactly the facts a text names,
whatever its casing, punctuation or word order.

Scoring conventions (``grade``):
1. ``recall = n_correct / n_true``; with nothing to recall (``n_true == 0``) recall is 1.0.
2. ``precision = n_correct / n_pred``; an empty prediction gets precision 1.0 when the
   truth is empty too (it claimed nothing, and nothing was there) and 0.0 otherwise, so
   saying nothing is never a free win.
3. Text inside double quotes is a quotation, not a fact claim: ``The text ends with "to the shore".``
   quotes the token being read and the words before it, and is not graded as the fact
   place=beach. It is graded on its own (``grade_quote``), unit by unit: each quoted word or mark
   is a claim about the text at its position from the end (0 = the token read), true when the text
   has that unit there.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

from nla.core.graders import has_repeated_sentence, split_sentences  # the generic text checks (any language)
from nla.world.facts import (
    KINDS,
    SURFACE_INDEX,
    VOCAB,
    Fact,
    all_facts,
    end_of_text,
    text_units,
    words_with_spans,
)

# Several phrasings per kind; "{w}" is the fact's canonical word.
FACT_TEMPLATES: dict[str, tuple[str, ...]] = {
    "person": (
        "The story is about {w}.",
        "{w} is one of the characters.",
        "It mentions someone named {w}.",
        "A person called {w} appears.",
    ),
    "place": (
        "The scene is set at the {w}.",
        "It takes place at the {w}.",
        "The location is the {w}.",
        "Someone is at the {w}.",
    ),
    "activity": (
        "Someone is {w}.",
        "The activity is {w}.",
        "There is some {w} going on.",
        "It involves {w}.",
    ),
    "object": (
        "There is a {w} in the story.",
        "The text mentions a {w}.",
        "An object appears: a {w}.",
        "Someone has a {w}.",
    ),
    "mood": (
        "The mood is {w}.",
        "Someone feels {w}.",
        "The tone is {w}.",
        "A character seems {w}.",
    ),
    "time": (
        "It happens in the {w}.",
        "The time of day is {w}.",
        "This is set at {w}.",
        "It is {w} in the story.",
    ),
}

# Said when nothing is revealed yet; contains no surface word, so it parses to no facts.
GENERIC_EXPLANATIONS: tuple[str, ...] = (
    "This is the start of a story.",
    "The text has only just begun.",
    "Nothing specific has been said yet.",
    "A new story is beginning.",
)


# A fact said unsure starts with this word (``hedge``): ``Perhaps someone has a kite.`` The grader counts it
# as not said (``parse_facts`` skips it; ``Grade.hedged`` records whether it is true anyway), as it does a
# quotation said unsure (``Hedged``). No surface word is "perhaps".
HEDGE_WORD = "Perhaps"


def hedge(sentence: str) -> str:
    """``sentence`` (a fact phrasing) said unsure: ``Perhaps`` before it, its first letter lowered unless it
    starts with a name (``{w} is one of the characters.`` keeps its capital)."""
    first = sentence.split(" ", 1)[0].rstrip(".,").lower()
    keep = SURFACE_INDEX.get(first) is not None and SURFACE_INDEX[first].kind == "person"
    return f"{HEDGE_WORD} {sentence if keep else sentence[:1].lower() + sentence[1:]}"


def is_hedged(sentence: str) -> bool:
    """Is ``sentence`` said unsure (its first word ``Perhaps``, any case)?"""
    return sentence.lstrip().split(" ", 1)[0].rstrip(",").lower() == HEDGE_WORD.lower()


def render_fact(fact: Fact, rng: random.Random, hedged: bool = False) -> str:
    w = fact.value.capitalize() if fact.kind == "person" else fact.value
    text = rng.choice(FACT_TEMPLATES[fact.kind]).format(w=w)
    return hedge(text) if hedged else text


_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}  # person, place, activity, object, mood, time


def render_facts(facts: Iterable[Fact], rng: random.Random, hedged: Iterable[Fact] = ()) -> str:
    """English sentences naming each fact once, with random phrasing, in a fixed order of kinds
    (who, where, doing what, holding what, feeling how, when).

    The fixed order is what a careful describer would use, and it lets a verbalizer decoding
    greedily go through the kinds one by one instead of stopping after the likeliest few
    (measured: with shuffled order the warm-start AV named no activity or object at all).
    An empty set renders a generic sentence that parses to no facts. ``hedged``: facts said unsure
    (``hedge``), in the same order of kinds among the others (a fact in both is said firmly).
    """
    firm = set(facts)
    ordered = sorted(firm | set(hedged), key=lambda f: (_KIND_ORDER[f.kind], f.value))
    if not ordered:
        return rng.choice(GENERIC_EXPLANATIONS)
    return " ".join(render_fact(f, rng, hedged=f not in firm) for f in ordered)


_QUOTED = re.compile(r'"[^"]*"')


def _facts_in(text: str) -> set[Fact]:
    return {SURFACE_INDEX[w] for w, _, _ in words_with_spans(text) if w in SURFACE_INDEX}


def parse_facts(text: str) -> set[Fact]:
    """Every fact named anywhere in ``text`` (any surface word, any case or order), quotations and
    sentences said unsure (``is_hedged``) excepted."""
    claims = _QUOTED.sub(" ", text)
    if HEDGE_WORD.lower() in claims.lower():
        claims = " ".join(s for s in split_sentences(claims) if not is_hedged(s))
    return _facts_in(claims)


def named_in_text(text: str) -> frozenset[Fact]:
    """Every fact the story text ``text`` has named (each surface word reveals one fact, which held from that
    word on, whether or not it still holds at the text's end: an object put down, a place left)."""
    return frozenset(_facts_in(text))


def stale_claims(text: str, truth: Iterable[Fact], earlier: Iterable[Fact]) -> dict[str, int]:
    """kind -> the claims of ``text`` (``parse_facts``) that are false against ``truth`` (what holds now) but
    that the text read named earlier (``earlier``: ``named_in_text`` of it): said of the past, not made up.
    Kinds with none are left out."""
    truth, earlier = set(truth), set(earlier)
    out: dict[str, int] = {}
    for f in parse_facts(text):
        if f not in truth and f in earlier:
            out[f.kind] = out.get(f.kind, 0) + 1
    return out


def parse_hedged_facts(text: str) -> list[Fact]:
    """The facts ``text`` names in sentences said unsure (``Perhaps …``), in order (quotations excepted)."""
    claims = _QUOTED.sub(" ", text)
    if HEDGE_WORD.lower() not in claims.lower():
        return []
    return [SURFACE_INDEX[w] for s in split_sentences(claims) if is_hedged(s)
            for w, _, _ in words_with_spans(s) if w in SURFACE_INDEX]


def render_text_end(quote: str) -> str:
    """Quotes the end of the text read (``nla.world.facts.text_end``: the token and the two words or
    marks before it), so the grader does not count its words as fact claims.

    The language's one non-fact sentence. It used to quote only the current word, which left out
    what a vector at a middle layer mostly holds: the token itself (at a full stop the word before
    it was quoted) and the previous words; a linear read of the vectors from the true facts and the
    current word explained 0.76-0.78 of their variance, with the token and the two units before it
    0.84-0.87 (dev/LOG.md, 2026-12-01, "What the explanation language cannot say").

    A ``Hedged`` quote is said unsure: ``The text may end with "…".`` (issue 57)."""
    verb = "may end" if isinstance(quote, Hedged) else "ends"
    return f'The text {verb} with "{" ".join(quote.replace(chr(34), "").split())}".'


class Hedged(str):
    """A quotation said unsure (``The text may end with "…".``): where the vector does not hold the
    token read (``world_explainer.quote_unheld: hedge``), the language still says its likeliest word
    but does not claim it; the grader counts it as not said (``QuoteGrade.hedged``) and the suite as
    no claim. A ``str``, so every path that carries a quotation carries this one unchanged."""

    __slots__ = ()


QUOTE_RE = re.compile(r'^The text (?:ends|may end) with "[^"]+"\.$')  # as render_text_end writes it

# Where a world dataset keeps the text to quote: ``text_end`` (datagen since the quotation of the
# text's end), else ``current_word`` (datasets written before it: the quotation is that word).
QUOTE_COLUMNS = ("text_end", "current_word")
# Where a row says whether its vector holds the token read (``world_explainer.quote_min_prob``, a
# probe's verdict; ``nla.datagen.explain.add_quote_held``): false, the data explainer and the oracle
# quote nothing there. Absent: every row quotes.
QUOTE_HELD = "quote_held"


def row_quote(row: dict) -> str | None:
    """The quotation for one dataset row (a dict of its columns), or None when it has none."""
    for c in QUOTE_COLUMNS:
        if row.get(c) is not None:
            return row[c]
    return None


def unheld_quote(quote: str | None, held: bool, unheld: str = "omit") -> str | None:
    """What the language quotes of a row: ``quote`` where the vector holds the token read (``held``),
    else nothing (``unheld`` "omit") or ``quote`` said unsure (``Hedged``; "hedge")."""
    if held or quote is None:
        return quote
    if unheld == "hedge":
        return Hedged(quote)
    if unheld == "omit":
        return None
    raise ValueError(f"quote_unheld: expected omit or hedge, found {unheld!r}")


def table_quotes(table) -> list[str | None] | None:
    """The quotation of every row of a pyarrow ``table``, or None when it has no quote column."""
    for c in QUOTE_COLUMNS:
        if c in table.column_names:
            return table.column(c).to_pylist()
    return None


def cut_quote(quote: str | None, n_units: int | None) -> str | None:
    """The last ``n_units`` units of ``quote`` (a ``text_end``), or ``quote`` itself when ``n_units`` is
    None: what a language that quotes ``n_units`` units of the text's end says
    (``world_explainer.quote_units``; 1 = the token read only)."""
    if quote is None or n_units is None:
        return quote
    if isinstance(n_units, bool) or not isinstance(n_units, int) or n_units < 1:
        raise ValueError(f"quote_units: expected an integer >= 1 or None, found {n_units!r}")
    cut = end_of_text(quote, n_units)
    return Hedged(cut) if isinstance(quote, Hedged) else cut


# The quotation inside one sentence, as render_text_end writes it (its closing full stop may be missing).
_QUOTATION = re.compile(r'^The text (ends|may end) with "([^"]*)"')


def quotation(text: str | None) -> str | None:
    """The span the explanation quotes as the text's end (its first ``The text ends with "…"``
    sentence; a ``Hedged`` span from ``The text may end with "…"``), or None when it has none (a
    broken quote, with no closing mark, is none)."""
    for sentence in split_sentences(text or ""):
        m = _QUOTATION.match(sentence)
        if m:
            return Hedged(m.group(2)) if m.group(1) == "may end" else m.group(2)
    return None


@dataclass(frozen=True)
class QuoteGrade:
    """The quotation of one explanation graded unit by unit against the text read.

    Units are words or marks (``nla.world.facts.text_units``), counted from the end: position 0 is the
    token read (its last unit), 1 the unit before it, and so on.

    quoted: the quoted span as written (None: the explanation quotes nothing).
    claims[p]: the quotation's p-th unit from the end is the text's p-th unit from the end (one entry
        per quoted unit; a unit past the start of the text is false).
    recalled[p]: for each unit of the text's end (the row's ``text_end``, what the language quotes),
        whether the quotation says it at its position (False when not quoted).
    exact: the quotation is exactly the text's end (unit for unit; spacing aside).
    hedged: for a quotation said unsure (``Hedged``), whether each of its units is true, as ``claims``
        would be; it is not said (no ``claims``, nothing ``recalled``, not ``exact``). None otherwise.
    """

    quoted: str | None
    claims: tuple[bool, ...]
    recalled: tuple[bool, ...]
    exact: bool
    hedged: tuple[bool, ...] | None = None

    @property
    def said(self) -> bool:
        return self.quoted is not None and self.hedged is None

    @property
    def all_true(self) -> bool:
        """A quotation was said and every unit of it is true."""
        return self.said and all(self.claims)


def grade_quote(text: str | None, end: str, context: str | None = None, *, quoted: str | None | bool = False,
                unit_re: re.Pattern[str] | None = None, what: str = "text_end") -> QuoteGrade:
    """Grade the quotation of ``text`` against the text read: ``end`` is the row's ``text_end`` (the
    units the language quotes: the recall targets), ``context`` the whole text read up to and
    including the token, when known; it must end with ``end``. A quoted unit is checked against
    ``context`` (else ``end``) at its position from the end; one before the start of what is known
    is false (a quotation longer than the text, or than the row records without a context).
    ``quoted``: the span the explanation quotes when the caller's language finds it (False: this
    language's ``quotation(text)``); ``unit_re``: what a unit is (``text_units``'s default: the world's);
    ``what``: how an error names ``end``."""
    if end is None:
        raise ValueError("grade_quote: end is None; the row has no text_end to grade the quotation against")
    target = text_units(end, unit_re)
    full = text_units(context, unit_re) if context is not None else target
    if target and full[-len(target):] != target:
        raise ValueError(f"grade_quote: the context ends with {' '.join(full[-len(target) - 1:])!r}, not with its "
                         f"{what} {end!r}")
    if quoted is False:
        quoted = quotation(text)
    q = text_units(quoted, unit_re) if quoted is not None else []
    claims = tuple(p < len(full) and q[-1 - p] == full[-1 - p] for p in range(len(q)))
    if isinstance(quoted, Hedged):  # said unsure: graded for calibration, counted as not said
        return QuoteGrade(quoted, (), (False,) * len(target), False, hedged=claims)
    recalled = tuple(p < len(q) and q[-1 - p] == target[-1 - p] for p in range(len(target)))
    return QuoteGrade(quoted, claims, recalled, quoted is not None and q == target)


def _template_regex(template: str, kind: str) -> re.Pattern[str]:
    """``template`` as a regex over any surface word of ``kind``; group 1 is the word written."""
    words = sorted({w for v in VOCAB[kind].values() for w in v}, key=len, reverse=True)
    head, _, tail = template.partition("{w}")
    return re.compile("^" + re.escape(head) + "(" + "|".join(words) + ")" + re.escape(tail) + "$", re.IGNORECASE)


# Every sentence the explanation language has (docs/design.md §5): a fact template with any surface
# word of its kind, a generic remark, or the quoted end of the text. PHRASINGS: (kind, template
# index, regex) of every fact phrasing.
PHRASINGS = tuple((k, i, _template_regex(t, k)) for k, ts in FACT_TEMPLATES.items() for i, t in enumerate(ts))


def in_language(sentence: str) -> bool:
    """Is ``sentence`` one the explainer could have written (any phrasing, any surface word)?"""
    if is_hedged(sentence):  # a fact phrasing said unsure (hedge): "Perhaps" and a space, then the phrasing
        rest = sentence.lstrip()[len(HEDGE_WORD):]
        return rest.startswith(" ") and any(p.match(rest[1:]) for _, _, p in PHRASINGS)
    return (bool(QUOTE_RE.match(sentence)) or sentence in GENERIC_EXPLANATIONS
            or any(p.match(sentence) for _, _, p in PHRASINGS))


@dataclass(frozen=True)
class Degeneracy:
    """Why an explanation is degenerate (any flag set), for the eval's degeneracy column."""

    repeated_sentence: bool
    broken_quote: bool
    outside_language: bool

    @property
    def any(self) -> bool:
        return self.repeated_sentence or self.broken_quote or self.outside_language


def degeneracy(text: str | None) -> Degeneracy:
    """Flags for one explanation (None or empty: a failed sample, not degenerate here; failures
    are counted on their own).

    1. repeated sentence: the same sentence (case-insensitive) twice;
    2. broken quote: an odd number of double quotes, or a quotation that is not the whole
       ``The text ends with "…".`` sentence;
    3. outside the language: a sentence the explainer could not have written (``in_language``).
    """
    if not text or not text.strip():
        return Degeneracy(False, False, False)
    sentences = split_sentences(text)
    broken = text.count('"') % 2 == 1 or any('"' in s and not QUOTE_RE.match(s) for s in sentences)
    outside = any(not in_language(s) for s in sentences)
    return Degeneracy(has_repeated_sentence(sentences), broken, outside)


def oracle_explanation(facts: Iterable[Fact], quote: str | None, key: int, hedged: Iterable[Fact] = ()) -> str:
    """Every true fact and the quoted end of the text (``quote``), nothing else: the most faithful explanation the
    language can say (phrasing drawn from an RNG keyed on ``key``). Read by an AR it gives the
    ceiling of the round trip for explanations that only say true things. ``hedged``: true facts said
    unsure (``world_explainer.fact_unheld: hedge``), as the data explainer says them."""
    rng = random.Random(f"nla-oracle:{key}")
    text = render_facts(facts, rng, hedged)
    if quote and quote.strip():
        text = render_text_end(quote) + " " + text
    return text


@dataclass(frozen=True)
class Grade:
    """Fact-level faithfulness of one explanation (conventions in the module docstring).

    ``by_kind[kind] = (recall, precision)`` for each kind present in truth or prediction.
    ``hedged[kind]``: for each kind the text names only unsure (``Perhaps …``; not counted above),
    whether the first such fact is true (``nla.core.graders.faithfulness`` reports the share).
    ``said[kind] = (claims of it named, of those true)`` for each kind the text names: precision over
    the claims made (``by_kind`` counts a row that names nothing of a true kind as precision 0, so a
    short, true explanation of a vector that holds little reads as imprecise there; issue 59).
    """

    recall: float
    precision: float
    n_pred: int
    n_true: int
    n_correct: int
    by_kind: dict[str, tuple[float, float]]
    hedged: dict[str, bool] | None = None
    said: dict[str, tuple[int, int]] | None = None

    @property
    def f1(self) -> float:
        s = self.recall + self.precision
        return 0.0 if s == 0 else 2 * self.recall * self.precision / s


def _recall_precision(pred: set[Fact], truth: set[Fact]) -> tuple[float, float, int]:
    n_correct = len(pred & truth)
    recall = 1.0 if not truth else n_correct / len(truth)
    if pred:
        precision = n_correct / len(pred)
    else:
        precision = 1.0 if not truth else 0.0
    return recall, precision, n_correct


def grade(text: str, truth: Iterable[Fact]) -> Grade:
    """Parse ``text`` for facts and score them against ``truth``."""
    truth = set(truth)
    pred = parse_facts(text)
    recall, precision, n_correct = _recall_precision(pred, truth)
    by_kind: dict[str, tuple[float, float]] = {}
    said: dict[str, tuple[int, int]] = {}
    for kind in KINDS:
        p = {f for f in pred if f.kind == kind}
        t = {f for f in truth if f.kind == kind}
        if p or t:
            r, pr, n = _recall_precision(p, t)
            by_kind[kind] = (r, pr)
            if p:
                said[kind] = (len(p), n)
    hedged: dict[str, bool] = {}
    for f in parse_hedged_facts(text):
        hedged.setdefault(f.kind, f in truth)
    return Grade(recall, precision, len(pred), len(truth), n_correct, by_kind, hedged or None, said or None)


class TextExplainer:
    """Mimics an API model reading the context: names a few revealed facts, imperfectly.

    ``explain(facts, key, quote)`` names ``min_facts..max_facts`` of the revealed
    facts (fewer if fewer are known), or, with ``fact_rate`` set, each revealed fact on its own
    with that probability (at least one), and with probability ``wrong_rate`` adds one fact that
    is *not* revealed (a plausible mistake), so RL has room to improve on the SFT data.
    Like an API model describing the token it reads, it also quotes the end of the text (``quote``,
    ``nla.world.facts.text_end``: the token and the two words or marks before it; with probability
    ``word_rate``, when one is given): in a small subject model the residual stream at a middle
    layer is dominated by the current token and its neighbours, so an explanation without them
    cannot be reconstructed. With ``quote_units`` it quotes only that many units of the end (1: the
    token read), the rule the oracle follows too (``cut_quote``). The RNG is keyed on ``(seed, key)``:
    the same row always gets the same explanation.
    """

    def __init__(self, seed: int = 0, min_facts: int = 3, max_facts: int = 6, wrong_rate: float = 0.1,
                 word_rate: float = 1.0, fact_rate: float | None = None, quote_units: int | None = None):
        if not 1 <= min_facts <= max_facts:
            raise ValueError(
                f"TextExplainer: need 1 <= min_facts <= max_facts, found min_facts={min_facts}, max_facts={max_facts}"
            )
        if not 0.0 <= wrong_rate <= 1.0:
            raise ValueError(f"TextExplainer.wrong_rate: expected a probability in [0, 1], found {wrong_rate}")
        self.seed = seed
        self.min_facts = min_facts
        self.max_facts = max_facts
        if not 0.0 <= word_rate <= 1.0:
            raise ValueError(f"TextExplainer.word_rate: expected a probability in [0, 1], found {word_rate}")
        self.wrong_rate = wrong_rate
        self.word_rate = word_rate
        if fact_rate is not None and not 0.0 < fact_rate <= 1.0:
            raise ValueError(f"TextExplainer.fact_rate: expected a probability in (0, 1] or None, found {fact_rate}")
        self.fact_rate = fact_rate
        cut_quote("", quote_units)  # checks it
        self.quote_units = quote_units
        self._all = all_facts()

    def choose(self, facts: frozenset[Fact], key: int) -> tuple[list[Fact], random.Random]:
        """The facts the explanation will name (true ones first, then any wrong one)."""
        rng = random.Random(f"nla-explainer:{self.seed}:{key}")
        known = sorted(facts)
        chosen: list[Fact] = []
        if known and self.fact_rate is not None:
            # Each true fact on its own draw, so every kind is named at the same rate wherever it is
            # true; at least one (the draw's first pick among them) so a row is never fact-free.
            draws = [rng.random() for _ in known]
            chosen = [f for f, u in zip(known, draws, strict=True) if u < self.fact_rate]
            if not chosen:
                chosen = [known[min(range(len(known)), key=draws.__getitem__)]]
        elif known:
            k = min(len(known), rng.randint(self.min_facts, self.max_facts))
            chosen = rng.sample(known, k)
        if rng.random() < self.wrong_rate:
            wrong = [f for f in self._all if f not in facts]
            chosen.append(rng.choice(wrong))
        return chosen, rng

    def explain(self, facts: frozenset[Fact], key: int, quote: str | None = None,
                hedged: frozenset[Fact] = frozenset()) -> str:
        """``facts``: the true facts it may name firmly; ``hedged``: true facts it says unsure
        (``Perhaps …``, every one of them: the vector may not hold them; ``world_explainer.fact_unheld``)."""
        chosen, rng = self.choose(facts, key)
        hedged = frozenset(hedged) - frozenset(chosen)
        if not facts and not hedged:
            # Nothing revealed yet: a generic remark, plus the occasional wrong guess.
            generic = rng.choice(GENERIC_EXPLANATIONS)
            text = generic if not chosen else generic + " " + render_facts(chosen, rng)
        else:
            text = render_facts(chosen, rng, hedged)
        # A separate stream, so adding the quotation never changes which facts a row names.
        word_rng = random.Random(f"nla-explainer-word:{self.seed}:{key}")
        quote = cut_quote(quote, self.quote_units)
        if quote and quote.strip() and word_rng.random() < self.word_rate:
            text = render_text_end(quote) + " " + text
        return text
