"""Typed facts, the world's vocabulary, and documents with exact ground truth.

The ground truth is the story's *state*: who is present, where the protagonist is, what
they hold, what they are doing, how they feel, the time of day. State changes as the
story goes (moves, objects picked up and put down, a friend arriving and leaving), and
the truth at a token is what is true *now* given the text so far.

Every fact has a set of *surface words* (its canonical word plus inflections and
synonyms). Surface words are unique across facts and never appear in story filler
text, so a surface word in a document reveals exactly one fact, at the end of that
word. This is what makes the ground truth exact and checkable.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

# activity -> (gerund surface words, base-verb surface words); templates pick the form
# that fits the sentence ("was {activity}" vs "wanted to {activity_verb}").
ACTIVITY_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "reading": (("reading",), ("read",)),
    "painting": (("painting",), ("paint",)),
    "cooking": (("cooking",), ("cook",)),
    "swimming": (("swimming",), ("swim",)),
    "running": (("running", "jogging"), ("run", "jog")),
    "singing": (("singing",), ("sing",)),
    "fishing": (("fishing",), ("fish",)),
    "dancing": (("dancing",), ("dance",)),
    "writing": (("writing",), ("write",)),
    "climbing": (("climbing",), ("climb",)),
    "hiking": (("hiking",), ("hike",)),
    "knitting": (("knitting",), ("knit",)),
}

# kind -> canonical value -> surface words (the canonical value first). Story templates
# draw from these; the explanation parser accepts any of them.
VOCAB: dict[str, dict[str, tuple[str, ...]]] = {
    "person": {
        name: (name,)
        for name in (
            "alice", "bruno", "clara", "daniel", "elena", "felix", "greta", "hugo",
            "iris", "jonas", "kira", "leo", "maya", "nico", "olga", "pablo",
        )
    },
    "place": {
        "park": ("park",),
        "library": ("library",),
        "beach": ("beach", "shore", "seaside"),
        "market": ("market", "bazaar"),
        "kitchen": ("kitchen",),
        "garden": ("garden",),
        "station": ("station",),
        "museum": ("museum",),
        "forest": ("forest", "woods"),
        "cafe": ("cafe", "coffeehouse"),
        "harbor": ("harbor", "docks"),
        "school": ("school", "classroom"),
    },
    "activity": {v: g + b for v, (g, b) in ACTIVITY_FORMS.items()},
    "object": {
        "umbrella": ("umbrella",),
        "lantern": ("lantern",),
        "guitar": ("guitar",),
        "notebook": ("notebook", "journal"),
        "kite": ("kite",),
        "basket": ("basket",),
        "camera": ("camera",),
        "bicycle": ("bicycle", "bike"),
        "teapot": ("teapot",),
        "map": ("map",),
        "scarf": ("scarf",),
        "compass": ("compass",),
    },
    "mood": {
        "happy": ("happy", "cheerful", "glad"),
        "sad": ("sad", "gloomy", "unhappy"),
        "tired": ("tired", "sleepy", "weary"),
        "curious": ("curious", "inquisitive"),
        "nervous": ("nervous", "anxious"),
        "calm": ("calm", "relaxed", "peaceful"),
        "excited": ("excited", "thrilled"),
        "angry": ("angry", "furious", "cross"),
    },
    "time": {
        "morning": ("morning",),
        "afternoon": ("afternoon",),
        "evening": ("evening", "dusk"),
        "night": ("night", "midnight"),
        "dawn": ("dawn", "sunrise"),
        "noon": ("noon", "midday"),
    },
}

KINDS: tuple[str, ...] = tuple(VOCAB)

_WORD_RE = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True, order=True)
class Fact:
    """One latent fact, e.g. ``Fact("place", "beach")``; ``str()`` gives ``"place=beach"``."""

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in VOCAB:
            raise ValueError(f"Fact.kind: expected one of {list(VOCAB)}, found {self.kind!r}")
        if self.value not in VOCAB[self.kind]:
            raise ValueError(
                f"Fact.value for kind {self.kind!r}: expected one of {sorted(VOCAB[self.kind])}, found {self.value!r}"
            )

    def __str__(self) -> str:
        return f"{self.kind}={self.value}"

    @classmethod
    def parse(cls, s: str) -> Fact:
        """Inverse of ``str()``: ``"place=beach"`` -> ``Fact("place", "beach")``."""
        kind, sep, value = s.partition("=")
        if not sep:
            raise ValueError(f"Fact.parse: expected 'kind=value', found {s!r}")
        return cls(kind.strip(), value.strip())

    @property
    def surfaces(self) -> tuple[str, ...]:
        return VOCAB[self.kind][self.value]


def all_facts() -> list[Fact]:
    """Every fact of the world, sorted (kind, value)."""
    return sorted(Fact(k, v) for k, vals in VOCAB.items() for v in vals)


def _build_surface_index() -> dict[str, Fact]:
    index: dict[str, Fact] = {}
    for kind, vals in VOCAB.items():
        for value, words in vals.items():
            for w in words:
                if w in index:  # a clash would make ground truth ambiguous
                    raise AssertionError(f"surface word {w!r} used by {index[w]} and {kind}={value}")
                index[w] = Fact(kind, value)
    return index


# lowercase surface word -> the fact it reveals
SURFACE_INDEX: dict[str, Fact] = _build_surface_index()


@dataclass(frozen=True)
class Document:
    """A generated story and its ground truth: what is true *now*, at every character.

    ``events``: ``(char_end, fact, present)`` triples sorted by ``char_end``. At
    ``char_end`` (the end offset of the word that makes it known) ``fact`` becomes true
    (``present=True``) or stops being true (``present=False``: the object was put down,
    the friend left, the place changed). ``text[:char_end]`` reveals the change,
    ``text[:char_end - 1]`` does not. Events at the same offset apply in list order.
    """

    doc_id: int
    text: str
    events: tuple[tuple[int, Fact, bool], ...]

    @property
    def reveals(self) -> tuple[tuple[int, Fact], ...]:
        """``(char_end, fact)`` for the first time each fact becomes true."""
        seen: set[Fact] = set()
        out = []
        for end, fact, present in self.events:
            if present and fact not in seen:
                seen.add(fact)
                out.append((end, fact))
        return tuple(out)

    @property
    def facts(self) -> frozenset[Fact]:
        """Every fact that is true at some point of the document."""
        return frozenset(f for _, f, present in self.events if present)


def facts_at(doc: Document, char_end: int) -> frozenset[Fact]:
    """Facts true after reading ``doc.text[:char_end]`` (causal: nothing after ``char_end``)."""
    ends = [e for e, _, _ in doc.events]
    n = bisect.bisect_right(ends, char_end)
    state: set[Fact] = set()
    for _, fact, present in doc.events[:n]:
        if present:
            state.add(fact)
        else:
            state.discard(fact)
    return frozenset(state)


def token_facts(doc: Document, offsets: list[tuple[int, int]]) -> list[frozenset[Fact]]:
    """Facts true at each token, given the tokenizer's offset mapping.

    Token i covers ``text[s:e]``; its facts are ``facts_at(doc, e)``, so a token in the
    middle of a word does not yet see that word's change.
    """
    ends = [e for _, e in offsets]
    if ends != sorted(ends):
        return [facts_at(doc, e) for e in ends]
    # One pass over the events (token ends are non-decreasing): same result as facts_at per token.
    out: list[frozenset[Fact]] = []
    state: set[Fact] = set()
    i, current = 0, frozenset()
    for e in ends:
        changed = False
        while i < len(doc.events) and doc.events[i][0] <= e:
            _, fact, present = doc.events[i]
            (state.add if present else state.discard)(fact)
            i += 1
            changed = True
        if changed:
            current = frozenset(state)
        out.append(current)
    return out


def current_word(doc: Document, char_end: int) -> str:
    """The last (possibly unfinished) word in ``doc.text[:char_end]``; "" if there is none."""
    if not 0 <= char_end <= len(doc.text):
        raise ValueError(f"current_word: char_end must be in [0, {len(doc.text)}], found {char_end}")
    words = _WORD_RE.findall(doc.text[:char_end])
    return words[-1] if words else ""


# A unit of the text's end: a word, or one mark (a full stop, a comma, a question mark ...).
_UNIT_RE = re.compile(r"[A-Za-z]+|[^\sA-Za-z]")
TEXT_END_UNITS = 3  # the token read and the two units before it (dev/LOG.md, "The text's end")


def text_end(doc: Document, char_end: int, n_units: int = TEXT_END_UNITS) -> str:
    """The last ``n_units`` words or marks of ``doc.text[:char_end]`` as written (runs of white space
    made one space, double quotes dropped): ``"the park."`` after a full stop, ``"to the park"`` at
    "park", ``"Le"`` inside the story's first word. It ends exactly where the token read ends, so it
    says the token itself (a mark, or part of a word) and the words before it; "" at the start."""
    if not 0 <= char_end <= len(doc.text):
        raise ValueError(f"text_end: char_end must be in [0, {len(doc.text)}], found {char_end}")
    if n_units < 1:
        raise ValueError(f"text_end: n_units must be >= 1, found {n_units}")
    return end_of_text(doc.text[:char_end], n_units)


def end_of_text(text: str, n_units: int = TEXT_END_UNITS, unit_re: re.Pattern[str] | None = None) -> str:
    """``text_end`` of a plain string: its last ``n_units`` words or marks as written (runs of white
    space made one space, double quotes dropped); "" when it has none. What a quotation of the end of
    ``text`` (the text read up to and including the token) should say, on any text. ``unit_re``: what
    a unit is (default the world's: a run of ASCII letters, or one mark)."""
    if n_units < 1:
        raise ValueError(f"end_of_text: n_units must be >= 1, found {n_units}")
    head = text.replace('"', "")
    units = list((unit_re or _UNIT_RE).finditer(head))
    if not units:
        return ""
    return " ".join(head[units[-min(n_units, len(units))].start():].split())


def text_units(text: str, unit_re: re.Pattern[str] | None = None) -> list[str]:
    """The words and marks of ``text`` in order, as ``text_end`` counts them (double quotes dropped):
    ``text_units("night. He") == ["night", ".", "He"]``. Position p from the end (0 = the token read)
    is ``text_units(t)[-1 - p]``."""
    return (unit_re or _UNIT_RE).findall(text.replace('"', ""))


def unit_ends(text: str) -> list[int]:
    """Where each word or mark of ``text`` ends: the places a token read can end at a whole unit."""
    return [m.end() for m in _UNIT_RE.finditer(text)]


def words_with_spans(text: str) -> list[tuple[str, int, int]]:
    """``(lowercase word, start, end)`` for every alphabetic word in ``text``."""
    return [(m.group().lower(), m.start(), m.end()) for m in _WORD_RE.finditer(text)]
