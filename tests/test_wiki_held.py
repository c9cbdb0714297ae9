"""Claims said firmly only where the vector holds them (``datagen.wiki_explainer.*_min_prob``): the
hedged sentences, how the grader counts them, the probe's verdict per row, the data explainer and
the oracle. Values derived by hand."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from nla.datagen.config import DatagenConfig, WikiExplainerConfig
from nla.datagen.wiki import (
    HELD_COLUMN,
    WikiExplainer,
    WikiGrader,
    add_claims_held,
    claim_sentence,
    explanation_of,
    grade_claims,
    hedged_claims,
    parse_claims,
    parse_hedged,
)

CLAIMS = ["quote=Paris", "topic=Geography", "next=,", "position=early"]


def test_hedged_sentences_by_hand_and_read_back():
    assert [claim_sentence(c, hedged=True) for c in CLAIMS] == [
        'The text may end with "Paris".', "The article may be about Geography.", 'The model may expect "," next.',
        "This may be early in the article."]
    for c in CLAIMS:
        assert parse_hedged(claim_sentence(c, hedged=True)) == c
        assert parse_hedged(claim_sentence(c)) is None  # a firm claim is not a hedged one
    assert parse_hedged("This may be somewhere.") is None


def test_explanation_of_says_firmly_what_is_held_and_hedges_or_omits_the_rest():
    held = ("quote", "position")
    assert explanation_of(CLAIMS, held) == ('The text ends with "Paris". The article may be about Geography. '
                                           'The model may expect "," next. This is early in the article.')
    assert explanation_of(CLAIMS, held, "omit") == 'The text ends with "Paris". This is early in the article.'
    assert explanation_of(CLAIMS, ()) == " ".join(claim_sentence(c, hedged=True) for c in CLAIMS)
    assert explanation_of(CLAIMS, (), "omit") == ""
    assert explanation_of(CLAIMS) == explanation_of(CLAIMS, ("quote", "topic", "next", "position"))
    with pytest.raises(ValueError, match="unheld: expected one of"):
        explanation_of(CLAIMS, held, "maybe")


def test_a_hedged_claim_is_not_said_and_not_outside_the_language():
    text = explanation_of(CLAIMS, ("quote", "position"))
    assert parse_claims(text) == (["quote=Paris", "position=early"], 0)
    assert hedged_claims(text) == ["topic=Geography", "next=,"]
    g = grade_claims(text, CLAIMS)
    assert (g.recall, g.precision) == (0.5, 1.0)  # two of four said, both true; the hedged two not said
    assert g.by_kind["topic"] == (0.0, 1.0) and g.by_kind["quote"] == (1.0, 1.0)
    # a hedged wrong value is no false claim either
    wrong = 'The text ends with "Paris". The article may be about History.'
    assert grade_claims(wrong, CLAIMS).precision == 1.0
    assert WikiGrader().degeneracy(text) == {"repeated": False, "broken_quote": False, "outside_language": False}
    assert WikiGrader().degeneracy("The article might concern maps.")["outside_language"]


def test_the_explainer_and_the_oracle_follow_the_held_column():
    rows = [{"doc_id": 1, "position": 9, "facts": CLAIMS, HELD_COLUMN: ["topic"]},
            {"doc_id": 2, "position": 9, "facts": CLAIMS, HELD_COLUMN: None},  # no verdict: every claim firm
            {"doc_id": 3, "position": 9, "facts": CLAIMS}]
    hedge = WikiExplainer("hedge").explain_batch(rows)
    assert hedge[0] == ('The text may end with "Paris". The article is about Geography. The model may expect "," '
                        'next. This may be early in the article.')
    assert hedge[1] == hedge[2] == explanation_of(CLAIMS)
    omit = WikiExplainer("omit")
    assert omit.explain_batch([{**rows[0], HELD_COLUMN: []}]) == [None]  # nothing held, nothing said: dropped
    assert omit.drops["wiki_no_claims"] == 1
    table = pa.table({"facts": [CLAIMS, CLAIMS], HELD_COLUMN: [["topic"], None]})
    g = WikiGrader()
    words = g.quotes(table)  # no dataset path: the data's unheld rule is not known, hedge
    assert words == [(("topic",), "hedge"), None]
    assert [g.oracle(CLAIMS, w, 0) for w in words] == [hedge[0], explanation_of(CLAIMS)]
    assert g.quotes(pa.table({"facts": [CLAIMS]})) == [None]


def _split(rng: np.random.Generator, n_docs: int, doc0: int, clear: bool) -> pa.Table:
    """Rows whose vector holds the topic (clear: +-8 on dim 0 by topic) or not (noise only)."""
    rows = []
    for d in range(n_docs):
        topic = ("Arts", "Science")[(d // 2) % 2]  # both topics in each fold (folds go by doc_id % 2)
        for _ in range(4):
            v = rng.normal(size=8).astype(np.float32)
            if clear:
                v[0] += 8.0 if topic == "Arts" else -8.0
            rows.append({"doc_id": doc0 + d, "facts": [f"topic={topic}", "position=start"],
                         "activation_vector": v.tolist()})
    return pa.Table.from_pylist(rows)


def test_add_claims_held_reads_each_row_by_a_probe_that_never_saw_its_article():
    rng = np.random.default_rng(0)
    clear = _split(rng, 20, 0, True)
    noise = _split(rng, 20, 100, False)
    tables = {"av_sft": pa.concat_tables([clear, noise]), "ar_sft": _split(rng, 20, 200, True),
              "rl": pa.concat_tables([_split(rng, 10, 300, True), _split(rng, 10, 400, False)])}
    out, summary = add_claims_held(tables, {"topic": 0.9})
    held = {n: t.column(HELD_COLUMN).to_pylist() for n, t in out.items()}
    # position is not gated: held on every row; the topic where the vector says it
    assert all("position" in h for hs in held.values() for h in hs)
    topic = {n: np.array(["topic" in h for h in hs]) for n, hs in held.items()}
    # clear rows: read (a few fall under 0.9: the ridge penalty caps the probe's confidence); noise rows: the
    # probe's top class is right on about half, and rarely at p >= 0.9 (measured 0.93-0.99 and 0.13-0.18)
    assert min(topic["av_sft"][:80].mean(), topic["ar_sft"].mean(), topic["rl"][:40].mean()) > 0.85
    assert max(topic["av_sft"][80:].mean(), topic["rl"][40:].mean()) < 0.25
    assert summary["min_prob"] == {"topic": 0.9}
    assert summary["share"]["ar_sft"]["topic"] == pytest.approx(topic["ar_sft"].mean(), abs=1e-4)
    assert summary["share"]["rl"]["topic"] == pytest.approx(topic["rl"].mean(), abs=1e-4)
    with pytest.raises(Exception, match=r"min_prob names \['mood'\]"):
        add_claims_held(tables, {"mood": 0.9})
    with pytest.raises(Exception, match="split rl has no facts column"):
        add_claims_held({**tables, "rl": tables["rl"].drop(["facts"])}, {"topic": 0.9})


def test_the_settings_are_checked_by_name():
    from nla.datagen.wiki import KINDS

    assert WikiExplainerConfig.GATED == KINDS  # every claim kind has its threshold
    assert WikiExplainerConfig(topic_min_prob=0.9, next_min_prob=0.5).min_prob() == {"topic": 0.9, "next": 0.5}
    with pytest.raises(ValueError, match=r"wiki_explainer\.topic_min_prob: expected a probability in \[0, 1\]"):
        WikiExplainerConfig(topic_min_prob=1.5)
    with pytest.raises(ValueError, match=r"wiki_explainer\.unheld: expected one of hedge, omit"):
        WikiExplainerConfig(unheld="maybe")
    with pytest.raises(ValueError, match="no \\*_min_prob unless explainer is wiki"):
        DatagenConfig.from_dict({"wiki_explainer": {"topic_min_prob": 0.9}})
    with pytest.raises(ValueError, match="unknown key"):
        DatagenConfig.from_dict({"wiki_explainer": {"topic_prob": 0.9}})


def test_faithfulness_reports_the_claims_said_unsure_per_kind():
    from nla.core.graders import faithfulness

    texts = [explanation_of(CLAIMS, ("quote",)),  # topic, next, position hedged, all true
             'The text ends with "Paris". The article may be about History.',  # topic hedged, false
             explanation_of(CLAIMS)]  # nothing hedged
    f = faithfulness(texts, [CLAIMS] * 3, WikiGrader())
    assert f.hedged == {"topic": (2 / 3, 0.5), "next": (1 / 3, 1.0), "position": (1 / 3, 1.0)}
    assert f.recall == pytest.approx((1 / 4 + 1 / 4 + 1) / 3)  # hedged claims are not said
    assert f.precision == 1.0
    assert faithfulness([explanation_of(CLAIMS)], [CLAIMS], WikiGrader()).hedged is None
    # precision over the claims made: quote said 3 times, all true; topic said once (row 3), true; the
    # by-kind table's topic precision counts rows 1-2 (topic true, not said) as precise too
    assert f.said == {"quote": (3, 1.0), "topic": (1, 1.0), "next": (1, 1.0), "position": (1, 1.0)}
    wrong = faithfulness(['The article is about History.', explanation_of(CLAIMS)], [CLAIMS] * 2, WikiGrader())
    assert wrong.said["topic"] == (2, 0.5)
    assert wrong.by_kind["topic"] == (0.5, 0.5)


def test_the_explorer_shows_unsure_claims_apart_from_claims_and_misses():
    from nla.explore.engine import grade_claims as explore_grade

    text = 'The text ends with "Paris". The article may be about History. The model may expect "," next.'
    out = explore_grade(text, CLAIMS, grader=WikiGrader())
    assert out["claims"] == [{"fact": "quote=Paris", "correct": True}]
    assert out["unsure"] == [{"fact": "topic=History", "correct": False}, {"fact": "next=,", "correct": True}]
    assert out["missed"] == ["position=early", "topic=Geography"]  # next=, was said unsure: not missed
    assert WikiGrader().hedged_facts(text) == ["topic=History", "next=,"]
