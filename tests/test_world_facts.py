"""Generator determinism and exact, causal ground truth of a changing story state."""

import re

import pytest

from nla.world.facts import SURFACE_INDEX, VOCAB, Document, Fact, current_word, facts_at, token_facts
from nla.world.generator import EVENTS, OPENERS, QUESTIONS, RECALLS, generate_documents


def test_same_seed_same_corpus_and_truth():
    a = generate_documents(7, 50)
    b = generate_documents(7, 50)
    assert [d.text for d in a] == [d.text for d in b]
    assert [d.events for d in a] == [d.events for d in b]


def test_different_seed_different_corpus():
    a = generate_documents(7, 50)
    b = generate_documents(8, 50)
    assert sum(x.text != y.text for x, y in zip(a, b, strict=True)) > 40


def test_shards_match_one_run():
    whole = generate_documents(3, 30)
    shards = generate_documents(3, 10) + generate_documents(3, 20, start_id=10)
    assert whole == shards
    assert [d.doc_id for d in whole] == list(range(30))


def test_variety_and_state_changes():
    docs = generate_documents(0, 300)
    assert len({d.text for d in docs}) == 300
    kinds = {f.kind for d in docs for f in d.facts}
    assert kinds == set(VOCAB)
    # the state changes: most stories stop some fact from being true (a move, a drop, a farewell)
    assert sum(any(not present for _, _, present in d.events) for d in docs) / len(docs) > 0.8
    # and at the end of a story several facts are true at once
    assert sum(len(facts_at(d, len(d.text))) for d in docs) / len(docs) >= 4


def test_filler_words_never_name_facts():
    # Template glue must not contain surface words, or the ground truth would miss a mention.
    for e in OPENERS + EVENTS + RECALLS + QUESTIONS:
        glue = re.sub(r"\{\w+\}", " ", e.template).lower()
        clash = set(re.findall(r"[a-z]+", glue)) & set(SURFACE_INDEX)
        assert not clash, f"template {e.template!r} uses surface words {clash}"


_CLEARS = {  # plain reference: sentence patterns that end a fact, and which mention names it
    r"put down the (\w+)\.": "object", r"gave away the (\w+)\.": "object", r"stopped (\w+)\.": "activity",
    r"(\w+) said goodbye and left\.": "person",
}


def _reference_state(text: str, upto: int) -> set[Fact]:
    """Replay the text word by word (independent of the generator's bookkeeping).

    A surface word makes its fact true at its end and replaces the previous value of its kind
    (people accumulate: protagonist and friend); a clearing sentence ends its fact at the
    sentence's last word.
    """
    state: dict[str, set[Fact]] = {}
    events: list[tuple[int, int, Fact | None, str]] = []  # (end, order, fact, op)
    for m in re.finditer(r"[A-Za-z]+", text):
        f = SURFACE_INDEX.get(m.group().lower())
        if f is not None:
            events.append((m.end(), 0, f, "set"))
    for pattern, kind in _CLEARS.items():
        for m in re.finditer(pattern, text):
            fact = SURFACE_INDEX[m.group(1).lower()]
            assert fact.kind == kind
            events.append((m.end() - 1, 1, fact, "clear"))
    for end, _, fact, op in sorted(events, key=lambda e: (e[0], e[1])):
        if end > upto:
            break
        if op == "set":
            if fact.kind == "person":
                state.setdefault("person", set()).add(fact)
            else:
                state[fact.kind] = {fact}
        else:
            state.get(fact.kind, set()).discard(fact)
    return {f for fs in state.values() for f in fs}


def test_ground_truth_matches_reference_replay_on_many_docs():
    for doc in generate_documents(11, 300):
        ends = [e for e, _, _ in doc.events]
        assert ends == sorted(ends)
        for pos in sorted({0, len(doc.text), *range(0, len(doc.text), 5), *ends, *[e - 1 for e in ends]}):
            assert facts_at(doc, pos) == _reference_state(doc.text, pos), (doc.text[:pos], doc.events)


def test_facts_at_is_causal_and_supported():
    for doc in generate_documents(5, 100):
        for end, fact, present in doc.events:
            # the change is known exactly at `end`, not one character earlier
            assert (fact in facts_at(doc, end)) == present
            if present and fact not in facts_at(doc, end - 1):
                assert current_word(doc, end).lower() in fact.surfaces
        for pos in range(0, len(doc.text) + 1, 7):
            words = set(re.findall(r"[a-z]+", doc.text[:pos].lower()))
            for f in facts_at(doc, pos):
                assert words & set(f.surfaces), (doc.text[:pos], f)
        assert facts_at(doc, 0) == frozenset()


def test_hand_built_state_changes():
    # "Leo went to the park. He picked up a kite. He put down the kite. He walked to the beach."
    text = "Leo went to the park. He picked up a kite. He put down the kite. He walked to the beach."
    leo, park, kite, beach = Fact("person", "leo"), Fact("place", "park"), Fact("object", "kite"), Fact("place", "beach")
    events = ((3, leo, True), (20, park, True), (41, kite, True), (63, kite, False), (87, park, False),
              (87, beach, True))
    doc = Document(0, text, events)
    assert text[:3] == "Leo" and text[16:20] == "park" and text[37:41] == "kite" and text[59:63] == "kite"
    assert text[82:87] == "beach"
    assert facts_at(doc, 2) == frozenset()
    assert facts_at(doc, 41) == {leo, park, kite}
    assert facts_at(doc, 62) == {leo, park, kite}  # "...put down the kit": not put down yet
    assert facts_at(doc, 63) == {leo, park}  # the kite is no longer held
    assert facts_at(doc, 86) == {leo, park}
    assert facts_at(doc, 87) == {leo, beach}  # the move replaces the place
    assert doc.facts == {leo, park, kite, beach}
    assert doc.reveals == ((3, leo), (20, park), (41, kite), (87, beach))
    assert _reference_state(text, 63) == {leo, park} and _reference_state(text, 87) == {leo, beach}


def test_token_facts_hand_example():
    # "Leo went to the park." reveals person=leo at 3 and place=park at 20.
    leo, park = Fact("person", "leo"), Fact("place", "park")
    doc = Document(0, "Leo went to the park.", ((3, leo, True), (20, park, True)))
    offsets = [(0, 2), (2, 3), (3, 8), (8, 11), (11, 15), (15, 18), (18, 20), (20, 21)]
    got = token_facts(doc, offsets)
    assert got[0] == frozenset()  # "Le": the name is not finished yet
    assert got[1] == {leo}
    assert got[5] == {leo}  # " pa"
    assert got[6] == {leo, park}
    assert got[7] == {leo, park}


def test_current_word():
    doc = Document(0, "Leo went to the park.", ())
    assert current_word(doc, 0) == ""
    assert current_word(doc, 2) == "Le"
    assert current_word(doc, 4) == "Leo"
    assert current_word(doc, 21) == "park"
    with pytest.raises(ValueError, match="char_end must be in"):
        current_word(doc, 99)


def test_text_end_quotes_the_token_and_the_two_units_before_it():
    from nla.world.facts import text_end, unit_ends

    doc = Document(0, 'One morning,  Leo "went" to the park. He', ())
    assert text_end(doc, 0) == ""
    assert text_end(doc, 2) == "On"  # inside the first word: the token's part of it
    assert text_end(doc, 11) == "One morning"
    assert text_end(doc, 12) == "One morning,"  # the mark is a unit of its own
    assert text_end(doc, 17) == "morning, Leo"  # two spaces made one
    assert text_end(doc, 23) == ", Leo went"  # the quote mark is dropped, not counted
    assert text_end(doc, 24) == ", Leo went"
    assert text_end(doc, 37) == "the park."
    assert text_end(doc, 40) == "park. He"
    assert text_end(doc, 40, n_units=1) == "He"
    assert unit_ends("Leo went, home.") == [3, 8, 9, 14, 15]
    with pytest.raises(ValueError, match="char_end must be in"):
        text_end(doc, 99)
    with pytest.raises(ValueError, match="n_units"):
        text_end(doc, 5, n_units=0)


def test_fact_validation_and_str():
    f = Fact("place", "beach")
    assert str(f) == "place=beach"
    assert Fact.parse("place=beach") == f
    assert len({Fact("mood", "sad"), Fact("mood", "sad")}) == 1
    with pytest.raises(ValueError, match="Fact.kind"):
        Fact("color", "red")
    with pytest.raises(ValueError, match="Fact.value for kind 'place'"):
        Fact("place", "moon")
    with pytest.raises(ValueError, match="kind=value"):
        Fact.parse("beach")
