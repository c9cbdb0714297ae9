"""Explanation language: render -> parse round trip, grading arithmetic, the text explainer."""

import random

import pytest

from nla.core.graders import split_sentences
from nla.world.explain import (
    FACT_TEMPLATES,
    GENERIC_EXPLANATIONS,
    TextExplainer,
    degeneracy,
    grade,
    in_language,
    parse_facts,
    render_facts,
)
from nla.world.facts import KINDS, SURFACE_INDEX, Fact, all_facts, facts_at
from nla.world.generator import generate_documents


def test_render_parse_round_trip_many_random_sets():
    rng = random.Random(0)
    facts = all_facts()
    for _ in range(500):
        chosen = set(rng.sample(facts, rng.randint(1, 8)))
        text = render_facts(chosen, rng)
        assert parse_facts(text) == chosen, text


def test_templates_glue_has_no_surface_words():
    for kind, templates in FACT_TEMPLATES.items():
        for t in templates:
            words = {w.strip(".,:").lower() for w in t.replace("{w}", " ").split()}
            assert not (words & set(SURFACE_INDEX)), (kind, t)
    for g in GENERIC_EXPLANATIONS:
        assert parse_facts(g) == set()


def test_parse_is_robust_to_case_punctuation_order_and_synonyms():
    text = "BEACH!! alice, at DUSK; the Mood: gloomy... (running)"
    assert parse_facts(text) == {
        Fact("place", "beach"),
        Fact("person", "alice"),
        Fact("time", "evening"),
        Fact("mood", "sad"),
        Fact("activity", "running"),
    }
    assert parse_facts("") == set()


def test_grade_hand_example_with_one_wrong_fact():
    truth = {Fact("person", "alice"), Fact("place", "beach"), Fact("mood", "happy"), Fact("time", "night")}
    text = "Alice is at the beach. She seems angry."
    # predicted {alice, beach, angry}: 2 correct of 3 predicted -> precision 2/3;
    # 2 of the 4 true facts named -> recall 2/4 = 0.5.
    g = grade(text, truth)
    assert (g.n_pred, g.n_true, g.n_correct) == (3, 4, 2)
    assert g.precision == pytest.approx(2 / 3)
    assert g.recall == pytest.approx(0.5)
    assert g.f1 == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    # by kind: person 1/1; place 1/1; mood: recall 0/1, precision 0/1 (angry wrong); time: recall 0, nothing predicted
    assert g.by_kind == {
        "person": (1.0, 1.0),
        "place": (1.0, 1.0),
        "mood": (0.0, 0.0),
        "time": (0.0, 0.0),
    }
    # the claims made per kind and how many are true (time: none made, so not there)
    assert g.said == {"person": (1, 1), "place": (1, 1), "mood": (1, 0)}
    assert grade("Nothing specific.", {Fact("place", "park")}).said is None
    # over rows: the claims of each kind named and the share true (a row naming no mood adds none)
    from nla.core.graders import faithfulness

    f = faithfulness([text, "Alice is at the park. She seems happy."], [sorted(map(str, truth))] * 2)
    assert f.said == {"person": (2, 1.0), "place": (2, 0.5), "mood": (2, 0.5)}


def test_a_false_claim_of_something_the_text_said_earlier_is_told_from_one_made_up():
    """An object put down no longer holds, but the text named it: a claim of it is false and said of the past
    (stale); a claim of an object the text never named is made up. Counted by hand."""
    import pyarrow as pa

    from nla.core.graders import faithfulness
    from nla.datagen.world_grader import WorldGrader
    from nla.world.explain import named_in_text, stale_claims

    context = "One morning, Alice went to the park with a kite. She put down the kite and felt happy."
    truth = ["person=alice", "place=park", "time=morning", "mood=happy"]  # the kite was put down
    assert named_in_text(context) == {Fact("person", "alice"), Fact("place", "park"), Fact("time", "morning"),
                                      Fact("object", "kite"), Fact("mood", "happy")}
    text = "There is a kite in the story. An object appears: a lantern. The mood is happy."
    earlier = named_in_text(context)
    # kite: false, named earlier (stale); lantern: false, never named; happy: true
    assert stale_claims(text, [Fact.parse(f) for f in truth], earlier) == {"object": 1}
    assert stale_claims("The mood is happy.", [Fact.parse(f) for f in truth], earlier) == {}
    grader = WorldGrader()
    table = pa.table({"context": [context, None, context], "facts": [truth, truth, truth]})
    rows = grader.earlier(table)
    assert rows == [earlier, None, earlier]
    texts = [text, text, "There is a kite in the story. Someone has a kite."]
    f = faithfulness(texts, [truth] * 3, grader, earlier=rows)
    # object claims: row 0 two (kite, lantern), row 1 two, row 2 one (kite twice is one claim); none true;
    # said earlier: row 0 the kite, row 1 not told (no context), row 2 the kite -> 2 of 5
    assert f.said["object"] == (5, 0.0) and f.said["mood"] == (2, 1.0)
    assert f.stale == {"object": pytest.approx(2 / 5), "mood": 0.0}
    assert faithfulness(texts, [truth] * 3, grader).stale is None  # not told without the text read
    assert grader.earlier(pa.table({"facts": [truth]})) is None
    with pytest.raises(ValueError, match=r"faithfulness: 2 rows of what the text said earlier for 3 texts"):
        faithfulness(texts, [truth] * 3, grader, earlier=rows[:2])


def test_grade_empty_conventions():
    # empty prediction, empty truth: nothing claimed, nothing missed -> 1, 1
    g = grade("This is the start of a story.", set())
    assert (g.recall, g.precision, g.n_pred) == (1.0, 1.0, 0)
    # empty prediction, non-empty truth: saying nothing is not a free win -> precision 0
    g = grade("Nothing specific.", {Fact("place", "park")})
    assert (g.recall, g.precision) == (0.0, 0.0)
    # prediction with empty truth: recall 1 (nothing to recall), precision 0
    g = grade("The park.", set())
    assert (g.recall, g.precision) == (1.0, 0.0)


def test_text_explainer_deterministic_and_mostly_faithful():
    ex = TextExplainer(seed=3, wrong_rate=0.1)
    docs = generate_documents(1, 200)
    n_wrong = 0
    for i, doc in enumerate(docs):
        facts = facts_at(doc, len(doc.text))
        text = ex.explain(facts, key=i)
        assert text == TextExplainer(seed=3, wrong_rate=0.1).explain(facts, key=i)
        assert "<" not in text  # explanation text only, no tags
        pred = parse_facts(text)
        correct = pred & facts
        assert 3 <= len(correct) <= 6 or len(correct) == len(facts)  # min_facts..max_facts (3..6) by default
        n_wrong += len(pred - facts)
        assert len(pred - facts) <= 1
    # wrong_rate 0.1 over 200 rows: expect ~20 wrong facts; binomial sd ~4.2
    assert 5 <= n_wrong <= 40
    # different keys give different phrasings
    assert len({ex.explain(docs[0].facts, k) for k in range(20)}) > 5


def test_text_explainer_no_facts_is_generic():
    ex = TextExplainer(seed=0, wrong_rate=0.0)
    for k in range(20):
        text = ex.explain(frozenset(), k)
        assert text in GENERIC_EXPLANATIONS
        assert parse_facts(text) == set()


def test_text_explainer_wrong_rate_extremes():
    facts = frozenset({Fact("place", "park"), Fact("mood", "calm"), Fact("time", "noon"), Fact("object", "map")})
    for k in range(30):
        assert parse_facts(TextExplainer(wrong_rate=0.0).explain(facts, k)) <= facts
        assert len(parse_facts(TextExplainer(wrong_rate=1.0).explain(facts, k)) - facts) == 1


def test_text_explainer_rejects_bad_config():
    with pytest.raises(ValueError, match="min_facts <= max_facts"):
        TextExplainer(min_facts=3, max_facts=2)
    with pytest.raises(ValueError, match="wrong_rate"):
        TextExplainer(wrong_rate=1.5)


def test_every_kind_has_several_phrasings():
    assert set(FACT_TEMPLATES) == set(KINDS)
    assert all(len(v) >= 3 for v in FACT_TEMPLATES.values())


def test_text_end_is_quoted_and_not_graded_as_a_fact():
    from nla.world import Fact, TextExplainer, grade, parse_facts

    facts = frozenset({Fact("person", "felix"), Fact("activity", "singing")})
    plain = TextExplainer(seed=3, wrong_rate=0.0).explain(facts, key=7)
    with_word = TextExplainer(seed=3, wrong_rate=0.0).explain(facts, key=7, quote="to the  shore")
    # the quotation is prepended (white space made single); which facts are named does not change
    assert with_word == 'The text ends with "to the shore". ' + plain
    # "shore" reveals place=beach, but a quotation is not a claim
    assert parse_facts(with_word) == parse_facts(plain)
    assert Fact("place", "beach") not in parse_facts(with_word)
    # unquoted it is a claim: 1 correct of 2 true -> recall 1/2; 1 right of 2 named -> precision 1/2
    g = grade("Felix is at the shore.", facts)
    assert (g.recall, g.precision) == (0.5, 0.5)


def test_word_rate_zero_never_names_the_word():
    from nla.world import Fact, TextExplainer

    ex = TextExplainer(seed=0, word_rate=0.0)
    facts = frozenset({Fact("mood", "calm")})
    assert all("text ends" not in ex.explain(facts, k, "so calm") for k in range(50))
    with pytest.raises(ValueError, match="word_rate"):
        TextExplainer(word_rate=1.5)


def test_degeneracy_on_hand_made_explanations():
    from nla.world.explain import degeneracy, in_language, split_sentences

    clean = 'The text ends with "the kite.". Leo is one of the characters. The tone is calm.'
    assert not degeneracy(clean).any and all(in_language(s) for s in split_sentences(clean))
    # a repeated sentence (case-insensitive)
    d = degeneracy("The mood is sad. the mood is sad.")
    assert (d.repeated_sentence, d.broken_quote, d.outside_language) == (True, False, False)
    # a quotation in another sentence than the language's own
    d = degeneracy('The current word is "umbrella in the morning.".')
    assert d.broken_quote and d.outside_language and not d.repeated_sentence
    # an unmatched quote; an empty quotation
    assert degeneracy('The text ends with "kite. The mood is sad.').broken_quote
    assert degeneracy('The text ends with "". The mood is sad.').broken_quote
    # a template with a word of another kind ("tone" is a mood template, "cooking" an activity)
    d = degeneracy("The tone is cooking.")
    assert d.outside_language and not d.broken_quote and not d.repeated_sentence
    # free text is outside the language; None / empty is not degenerate (failures are counted apart)
    assert degeneracy("Alice is in the garden").outside_language
    assert not degeneracy(None).any and not degeneracy("  ").any
    # a period inside a quotation does not end the sentence
    assert split_sentences('The text ends with "a. b". The mood is sad.') == ['The text ends with "a. b".',
                                                                               "The mood is sad."]


def test_text_explainer_fact_rate_names_each_fact_on_its_own_draw():
    facts = frozenset({Fact("person", "alice"), Fact("place", "park"), Fact("mood", "calm"), Fact("time", "noon"),
                       Fact("object", "map")})
    # rate 1: every true fact; a tiny rate: exactly one (the row is never fact-free)
    for k in range(20):
        assert parse_facts(TextExplainer(wrong_rate=0.0, fact_rate=1.0).explain(facts, k)) == facts
        assert len(parse_facts(TextExplainer(wrong_rate=0.0, fact_rate=1e-9).explain(facts, k))) == 1
    # rate 0.6 over 2,000 rows: each kind is named at the same rate, ~0.6 (binomial sd ~0.011)
    ex = TextExplainer(seed=1, wrong_rate=0.0, fact_rate=0.6)
    named = {f.kind: 0 for f in facts}
    for k in range(2000):
        for f in parse_facts(ex.explain(facts, k)):
            named[f.kind] += 1
    assert all(0.55 <= n / 2000 <= 0.65 for n in named.values()), named
    # the same key always gives the same text
    assert ex.explain(facts, 7) == TextExplainer(seed=1, wrong_rate=0.0, fact_rate=0.6).explain(facts, 7)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fact_rate"):
            TextExplainer(fact_rate=bad)


def test_a_fact_said_unsure_is_in_the_language_and_not_a_claim():
    from nla.world.explain import hedge, is_hedged, parse_hedged_facts

    assert hedge("Someone has a kite.") == "Perhaps someone has a kite."
    assert hedge("Maya is one of the characters.") == "Perhaps Maya is one of the characters."  # a name keeps its capital
    assert is_hedged("perhaps, the mood is sad.") and not is_hedged("Perhapsy the mood is sad.")
    text = 'The text ends with "He". The story is about Maya. Perhaps someone has a kite. Perhaps the mood is sad.'
    truth = {Fact("person", "maya"), Fact("object", "kite"), Fact("mood", "happy")}
    assert parse_facts(text) == {Fact("person", "maya")}
    assert parse_hedged_facts(text) == [Fact("object", "kite"), Fact("mood", "sad")]
    g = grade(text, truth)
    # by hand: one claim, true, of three true facts; the unsure ones are not claims but are recorded
    assert (g.recall, g.precision, g.n_pred, g.n_correct) == (1 / 3, 1.0, 1, 1)
    assert g.hedged == {"object": True, "mood": False}
    assert degeneracy(text).any is False
    assert not in_language("Perhaps the kite.") and in_language("Perhaps it happens in the night.")
    # the explainer: the unsure facts in the fixed order of kinds among the firm ones, none twice
    ex = TextExplainer(seed=0, fact_rate=1.0, wrong_rate=0.0)
    firm = frozenset({Fact("person", "maya"), Fact("time", "night")})
    out = ex.explain(firm, 5, hedged=frozenset({Fact("object", "kite"), Fact("time", "night")}))
    kinds = [next(iter(parse_facts(s) or parse_hedged_facts(s))).kind for s in split_sentences(out)]
    assert kinds == ["person", "object", "time"]
    assert parse_facts(out) == firm and parse_hedged_facts(out) == [Fact("object", "kite")]
    # no unsure facts: the same text as before the setting existed (the RNG stream is unchanged)
    assert ex.explain(firm, 5) == ex.explain(firm, 5, hedged=frozenset())
