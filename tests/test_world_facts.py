"""Generator determinism and exact, causal ground truth."""

import re

import pytest

from nla.world.facts import SURFACE_INDEX, VOCAB, Document, Fact, current_word, facts_at, token_facts
from nla.world.generator import BODIES, CLOSERS, OPENERS, generate_documents


def test_same_seed_same_corpus_and_truth():
    a = generate_documents(7, 50)
    b = generate_documents(7, 50)
    assert [d.text for d in a] == [d.text for d in b]
    assert [d.reveals for d in a] == [d.reveals for d in b]


def test_different_seed_different_corpus():
    a = generate_documents(7, 50)
    b = generate_documents(8, 50)
    assert sum(x.text != y.text for x, y in zip(a, b, strict=True)) > 40


def test_shards_match_one_run():
    whole = generate_documents(3, 30)
    shards = generate_documents(3, 10) + generate_documents(3, 20, start_id=10)
    assert whole == shards
    assert [d.doc_id for d in whole] == list(range(30))


def test_sentence_count_and_variety():
    docs = generate_documents(0, 300)
    n_sent = [d.text.count(".") for d in docs]
    assert min(n_sent) == 3 and max(n_sent) == 6
    assert len({d.text for d in docs}) == 300
    # every kind is revealed somewhere, and documents carry several facts
    kinds = {f.kind for d in docs for f in d.facts}
    assert kinds == set(VOCAB)
    assert sum(len(d.facts) for d in docs) / len(docs) >= 4


def test_filler_words_never_reveal_facts():
    # Template glue must not contain surface words, or the ground truth would miss reveals.
    for t in OPENERS + BODIES + CLOSERS:
        glue = re.sub(r"\{\w+\}", " ", t).lower()
        clash = set(re.findall(r"[a-z]+", glue)) & set(SURFACE_INDEX)
        assert not clash, f"template {t!r} uses surface words {clash}"


def _reference_reveals(text: str) -> dict[Fact, int]:
    """Plain reference: scan words left to right; the first surface word of a fact reveals it."""
    first: dict[Fact, int] = {}
    for m in re.finditer(r"[A-Za-z]+", text):
        f = SURFACE_INDEX.get(m.group().lower())
        if f is not None and f not in first:
            first[f] = m.end()
    return first


def test_ground_truth_matches_text_scan_on_many_docs():
    for doc in generate_documents(11, 500):
        ref = _reference_reveals(doc.text)
        assert {f: e for e, f in doc.reveals} == ref, doc.text
        ends = [e for e, _ in doc.reveals]
        assert ends == sorted(ends)


def test_facts_at_is_causal_and_supported():
    for doc in generate_documents(5, 100):
        for end, fact in doc.reveals:
            # the revealing word ends exactly at `end`: revealed there, not one char earlier
            assert fact in facts_at(doc, end)
            assert fact not in facts_at(doc, end - 1)
            assert current_word(doc, end).lower() in fact.surfaces
            # every fact known at a position has a surface word inside text[:position]
        for pos in range(0, len(doc.text) + 1, 7):
            words = set(re.findall(r"[a-z]+", doc.text[:pos].lower()))
            for f in facts_at(doc, pos):
                assert words & set(f.surfaces), (doc.text[:pos], f)
        assert facts_at(doc, len(doc.text)) == doc.facts
        assert facts_at(doc, 0) == frozenset()


def test_token_facts_hand_example():
    # "Leo went to the park." reveals person=leo at 3 and place=park at 20.
    doc = Document(0, "Leo went to the park.", ((3, Fact("person", "leo")), (20, Fact("place", "park"))))
    offsets = [(0, 2), (2, 3), (3, 8), (8, 11), (11, 15), (15, 18), (18, 20), (20, 21)]
    got = token_facts(doc, offsets)
    leo, park = Fact("person", "leo"), Fact("place", "park")
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
