"""Deterministic story generator with exact, causal ground truth of a changing state.

Document ``doc_id`` depends only on ``(seed, doc_id)`` (its RNG is seeded with that
pair), so shards generated separately agree with one big run.

A story follows one protagonist through a short sequence of events that change the
state (docs/design.md §5): they move between places, pick up and put down objects, start and
stop activities, change mood, a friend arrives and leaves, time passes. Between events,
*recall* sentences re-mention the current state ("He was still at the beach."), and the
story ends with questions about it ("Where was Leo now? At the beach."). The text is
built so that predicting it needs the state: a re-mention slot can only be filled by
remembering the latest value of its kind, and pronouns agree with the protagonist. A
subject model trained on these stories therefore carries the state in its residual
stream, which is what makes the facts decodable from the vectors
(``nla.world.probe``).

Ground truth (``Document.events``): a fact becomes true at the end of the word that
names it (the new value replaces the old one of its kind); a fact stops being true at
the end of the word that completes the sentence saying so (``put down the lantern`` ->
after "lantern"; ``Hugo said goodbye and left`` -> after "left"). A value is named by
a synonym only where it is first introduced; re-mentions use the canonical word.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from nla.world.facts import ACTIVITY_FORMS, VOCAB, Document, Fact

FEMALE_NAMES = frozenset({"alice", "clara", "elena", "greta", "iris", "kira", "maya", "olga"})

# Slots: {person} {friend} {place} {activity} (gerund) {activity_verb} (base form)
# {a_object} ("a kite" / "an umbrella") {object} {mood} {time}; pronouns {pron} {pron_l}
# {obj_pron} {poss} refer to the protagonist. A slot names the *new* value where the
# event sets its kind, and the *current* value otherwise. Filler words never collide with
# surface words (tests/test_world_facts.py checks it).


@dataclass(frozen=True)
class Event:
    """A sentence template and what it does to the state.

    ``sets``: the kind whose new value the sentence introduces (its slot of that kind
    names the new value). ``clears``: the kind that stops being true at the sentence's
    last word. ``needs``/``needs_not``: kinds that must / must not have a value for the
    event to be possible.
    """

    template: str
    sets: str | None = None
    clears: str | None = None
    needs: tuple[str, ...] = ()
    needs_not: tuple[str, ...] = ()


OPENERS: tuple[Event, ...] = (
    Event("One {time}, {person} went to the {place}."),
    Event("It was {time} when {person} arrived at the {place}."),
    Event("{person} spent the {time} at the {place}."),
    Event("That {time}, {person} walked into the {place}."),
)
EVENTS: tuple[Event, ...] = (
    Event("{pron} walked to the {place}.", sets="place"),
    Event("Then {pron_l} went over to the {place}.", sets="place"),
    Event("{pron} left for the {place}.", sets="place"),
    Event("{pron} picked up {a_object}.", sets="object", needs_not=("object",)),
    Event("{pron} found {a_object} and kept it.", sets="object", needs_not=("object",)),
    Event("{pron} put down the {object}.", clears="object", needs=("object",)),
    Event("{pron} gave away the {object}.", clears="object", needs=("object",)),
    Event("{pron} started {activity}.", sets="activity", needs_not=("activity",)),
    Event("{pron} decided to {activity_verb}.", sets="activity", needs_not=("activity",)),
    Event("{pron} stopped {activity}.", clears="activity", needs=("activity",)),
    Event("{pron} felt {mood}.", sets="mood"),
    Event("Soon {pron_l} was {mood}.", sets="mood"),
    Event("{friend} came to the {place} too.", sets="friend", needs_not=("friend",)),
    Event("{friend} joined {obj_pron}.", sets="friend", needs_not=("friend",)),
    Event("{friend} said goodbye and left.", clears="friend", needs=("friend",)),
    Event("Soon it was {time}.", sets="time"),
)
RECALLS: tuple[Event, ...] = (
    Event("{pron} was still at the {place}."),
    Event("The {place} was quiet."),
    Event("{pron} held the {object} tightly.", needs=("object",)),
    Event("{pron} looked at {poss} {object}.", needs=("object",)),
    Event("{pron} was still {activity}.", needs=("activity",)),
    Event("{pron} still felt {mood}.", needs=("mood",)),
    Event("{friend} was still with {obj_pron}.", needs=("friend",)),
    Event("It was still {time}.", needs=("time",)),
)
QUESTIONS: tuple[Event, ...] = (
    Event("Where was {person} now? At the {place}."),
    Event("What did {person} hold? The {object}.", needs=("object",)),
    Event("How did {person} feel? {mood}.", needs=("mood",)),
    Event("What was {person} doing? {activity}.", needs=("activity",)),
    Event("Who was with {person}? {friend}.", needs=("friend",)),
)

_SLOT_RE = re.compile(r"\{(\w+)\}")
SYNONYM_RATE = 0.3  # how often an introduced value uses a synonym instead of the canonical word
RECALL_RATE = 0.5  # chance of a recall sentence after each event
N_EVENTS = (4, 7)  # events per story (inclusive)
N_QUESTIONS = (1, 2)
# The kind of each slot; {friend} holds a person fact of its own.
SLOT_KIND = {"person": "person", "friend": "friend", "place": "place", "activity": "activity",
             "activity_verb": "activity", "a_object": "object", "object": "object", "mood": "mood",
             "time": "time"}
STATE_KINDS = ("person", "friend", "place", "object", "activity", "mood", "time")


def doc_rng(seed: int, doc_id: int) -> random.Random:
    # String seeds go through SHA-512 in `random`, so this is stable across runs and platforms.
    return random.Random(f"nla-world:{seed}:{doc_id}")


def _fact(kind: str, value: str) -> Fact:
    return Fact("person" if kind == "friend" else kind, value)


def _possible(event: Event, state: dict[str, str | None]) -> bool:
    return all(state[k] is not None for k in event.needs) and all(state[k] is None for k in event.needs_not)


class _Writer:
    """Renders templates against the state and records the ground-truth events."""

    def __init__(self, rng: random.Random, person: str):
        self.rng = rng
        female = person in FEMALE_NAMES
        self.pronouns = {
            "pron": "She" if female else "He", "pron_l": "she" if female else "he",
            "obj_pron": "her" if female else "him", "poss": "her" if female else "his",
        }
        self.protagonist = person  # named in the opener; known (a fact) from then on
        self.state: dict[str, str | None] = dict.fromkeys(STATE_KINDS)
        self.text = ""
        self.events: list[tuple[int, Fact, bool]] = []

    def _new_value(self, kind: str) -> str:
        pool = sorted(VOCAB["person"] if kind == "friend" else VOCAB[kind])
        if kind == "person":
            return self.protagonist
        taken = {self.state[kind], self.protagonist if kind == "friend" else None}
        return self.rng.choice([v for v in pool if v not in taken])

    def _surface(self, slot: str, value: str, introduced: bool) -> str:
        kind = SLOT_KIND[slot]
        if kind in ("person", "friend"):
            return value.capitalize()
        if kind == "activity":
            gerunds, bases = ACTIVITY_FORMS[value]
            words = bases if slot == "activity_verb" else gerunds
        else:
            words = VOCAB[kind][value]
        if introduced and len(words) > 1 and self.rng.random() < SYNONYM_RATE:
            return self.rng.choice(words[1:])
        return words[0]

    def _set(self, kind: str, value: str, end: int) -> None:
        old = self.state[kind]
        if old == value:
            return
        if old is not None:
            self.events.append((end, _fact(kind, old), False))
        self.state[kind] = value
        self.events.append((end, _fact(kind, value), True))

    def write(self, event: Event) -> None:
        if self.text:
            self.text += " "
        pos = 0
        last_end = len(self.text)
        for m in _SLOT_RE.finditer(event.template):
            self.text += event.template[pos : m.start()]
            pos = m.end()
            slot = m.group(1)
            if slot in self.pronouns:
                self.text += self.pronouns[slot]
                continue
            kind = SLOT_KIND[slot]
            introduced = kind == event.sets or self.state[kind] is None
            value = self._new_value(kind) if introduced else self.state[kind]
            assert value is not None
            word = self._surface(slot, value, introduced)
            if slot == "a_object":
                word = ("an " if word[0] in "aeiou" else "a ") + word
            # A bare answer ("How did Leo feel? Happy.") starts a sentence: capitalise it.
            if event.template[m.start() - 2 : m.start()] == "? ":
                word = word[0].upper() + word[1:]
            self.text += word
            self._set(kind, value, len(self.text))
        self.text += event.template[pos:]
        words = list(re.finditer(r"[A-Za-z]+", self.text[last_end:]))
        if event.clears is not None:
            # The change is known once the sentence's last word is read.
            old = self.state[event.clears]
            assert old is not None
            self.events.append((last_end + words[-1].end(), _fact(event.clears, old), False))
            self.state[event.clears] = None


def generate_document(seed: int, doc_id: int) -> Document:
    """One story; depends only on ``(seed, doc_id)``."""
    rng = doc_rng(seed, doc_id)
    w = _Writer(rng, rng.choice(sorted(VOCAB["person"])))
    w.write(rng.choice(OPENERS))
    for _ in range(rng.randint(*N_EVENTS)):
        w.write(rng.choice([e for e in EVENTS if _possible(e, w.state)]))
        if rng.random() < RECALL_RATE:
            w.write(rng.choice([e for e in RECALLS if _possible(e, w.state)]))
    questions = [e for e in QUESTIONS if _possible(e, w.state)]
    for q in rng.sample(questions, min(len(questions), rng.randint(*N_QUESTIONS))):
        w.write(q)
    return Document(doc_id=doc_id, text=w.text, events=tuple(w.events))


def generate_documents(seed: int, n_docs: int, start_id: int = 0) -> list[Document]:
    """Documents ``start_id .. start_id + n_docs - 1``; doc i depends only on ``(seed, i)``."""
    if n_docs < 0:
        raise ValueError(f"generate_documents: n_docs must be >= 0, found {n_docs}")
    return [generate_document(seed, i) for i in range(start_id, start_id + n_docs)]
