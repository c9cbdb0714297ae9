"""Deterministic story generator with exact, causal ground truth.

Document ``doc_id`` depends only on ``(seed, doc_id)`` (its RNG is seeded with that
pair), so shards generated separately agree with one big run. A document picks one
value per fact kind (plus an optional second person), then renders an opener, 1-4
body sentences and a closer from templates. Slots render a surface word of the fact
(the canonical word or, sometimes, a synonym: an indirect reveal); the first mention
of each fact records the end offset of its word.
"""

from __future__ import annotations

import random
import re

from nla.world.facts import ACTIVITY_FORMS, VOCAB, Document, Fact

FEMALE_NAMES = frozenset({"alice", "clara", "elena", "greta", "iris", "kira", "maya", "olga"})

# Slots: {person} {friend} {place} {activity} (gerund) {activity_verb} (base form)
# {a_object} ("a kite" / "an umbrella") {object} {mood} {time}; pronouns {pron} {pron_l}
# {obj_pron} {poss} refer to {person}. Filler words never collide with surface words
# (tests/test_world_facts.py checks it).
OPENERS: tuple[str, ...] = (
    "One {time}, {person} went to the {place}.",
    "{person} woke up feeling {mood}.",
    "It was {time} when {person} arrived at the {place}.",
    "{person} was {activity} at the {place}.",
    "{person} had {a_object} and a plan.",
    "Every {time}, {person} liked {activity}.",
    "{person} walked into the {place} with {a_object}.",
    "At the {place}, {person} felt {mood}.",
    "{person} loved to {activity_verb} in the {time}.",
)
BODIES: tuple[str, ...] = (
    "{pron} felt {mood}.",
    "{pron} wanted to {activity_verb}.",
    "{pron} was {activity} with {friend}.",
    "{friend} brought {a_object}.",
    "The {place} was quiet that {time}.",
    "{pron} carried {a_object} everywhere.",
    "Later, {friend} joined {obj_pron} at the {place}.",
    "{pron} spent the {time} {activity}.",
    "Everyone at the {place} seemed {mood}.",
    "{pron} forgot {poss} {object} on a bench.",
    "{friend} said it was a good day for {activity}.",
    "By {time}, {pron_l} was very {mood}.",
    "{pron} smiled and looked at the {object}.",
    "It started to rain, so {pron_l} stayed near the {place}.",
    "{person} and {friend} talked for a long while.",
    "{pron} tried to {activity_verb} but it was hard.",
)
CLOSERS: tuple[str, ...] = (
    "In the end, {pron_l} went home {mood}.",
    "It was a good {time}.",
    "{pron} decided to come back to the {place} soon.",
    "{pron} put the {object} away and rested.",
    "That was how {person} spent the day.",
)

_SLOT_RE = re.compile(r"\{(\w+)\}")
SYNONYM_RATE = 0.3  # how often a mention uses a synonym instead of the canonical word


def doc_rng(seed: int, doc_id: int) -> random.Random:
    # String seeds go through SHA-512 in `random`, so this is stable across runs and platforms.
    return random.Random(f"nla-world:{seed}:{doc_id}")


def _surface(rng: random.Random, words: tuple[str, ...]) -> str:
    if len(words) == 1 or rng.random() >= SYNONYM_RATE:
        return words[0]
    return rng.choice(words[1:])


def _pick(rng: random.Random, templates: tuple[str, ...], has_friend: bool) -> str:
    pool = [t for t in templates if has_friend or "{friend}" not in t]
    return rng.choice(pool)


def generate_document(seed: int, doc_id: int) -> Document:
    """One story; depends only on ``(seed, doc_id)``."""
    rng = doc_rng(seed, doc_id)
    names = sorted(VOCAB["person"])
    person = rng.choice(names)
    friend = rng.choice([n for n in names if n != person]) if rng.random() < 0.6 else None
    chosen = {k: rng.choice(sorted(VOCAB[k])) for k in ("place", "activity", "object", "mood", "time")}
    female = person in FEMALE_NAMES
    pronouns = {
        "pron": "She" if female else "He",
        "pron_l": "she" if female else "he",
        "obj_pron": "her" if female else "him",
        "poss": "her" if female else "his",
    }

    n_sent = rng.randint(3, 6)
    templates = [_pick(rng, OPENERS, friend is not None)]
    templates += [_pick(rng, BODIES, friend is not None) for _ in range(n_sent - 2)]
    templates.append(_pick(rng, CLOSERS, friend is not None))

    text = ""
    first_end: dict[Fact, int] = {}
    for i, template in enumerate(templates):
        if i:
            text += " "
        pos = 0
        for m in _SLOT_RE.finditer(template):
            text += template[pos : m.start()]
            pos = m.end()
            slot = m.group(1)
            prefix, word, fact = "", None, None
            if slot in pronouns:
                word = pronouns[slot]
            elif slot in ("person", "friend"):
                name = person if slot == "person" else friend
                assert name is not None  # templates with {friend} are filtered when there is none
                word, fact = name.capitalize(), Fact("person", name)
            elif slot in ("activity", "activity_verb"):
                gerunds, bases = ACTIVITY_FORMS[chosen["activity"]]
                word = _surface(rng, gerunds if slot == "activity" else bases)
                fact = Fact("activity", chosen["activity"])
            elif slot in ("object", "a_object"):
                word = _surface(rng, VOCAB["object"][chosen["object"]])
                if slot == "a_object":
                    prefix = "an " if word[0] in "aeiou" else "a "
                fact = Fact("object", chosen["object"])
            else:
                word = _surface(rng, VOCAB[slot][chosen[slot]])
                fact = Fact(slot, chosen[slot])
            text += prefix + word
            if fact is not None and fact not in first_end:
                first_end[fact] = len(text)
        text += template[pos:]
    reveals = tuple(sorted(((end, f) for f, end in first_end.items()), key=lambda p: (p[0], p[1])))
    return Document(doc_id=doc_id, text=text, reveals=reveals)


def generate_documents(seed: int, n_docs: int, start_id: int = 0) -> list[Document]:
    """Documents ``start_id .. start_id + n_docs - 1``; doc i depends only on ``(seed, i)``."""
    if n_docs < 0:
        raise ValueError(f"generate_documents: n_docs must be >= 0, found {n_docs}")
    return [generate_document(seed, i) for i in range(start_id, start_id + n_docs)]
