"""The quotation of the text's end graded as claims (issue 57): each quoted word or mark against the
text read at its position from the end, with expected values derived by hand."""

from __future__ import annotations

import json

import pytest

from nla.core.graders import faithfulness, get_grader, quotation_summary
from nla.datagen.config import DatagenConfig
from nla.world.explain import TextExplainer, cut_quote, grade_quote, oracle_explanation, quotation
from nla.world.facts import end_of_text, text_units

NIGHT = "Hugo went to the station. Soon it was night. He"  # ends "night. He": units night, ".", He


def test_units_are_those_of_text_end():
    assert text_units("night. He") == ["night", ".", "He"]
    assert text_units('? "Hugo."') == ["?", "Hugo", "."]  # double quotes dropped, as text_end drops them
    assert end_of_text(NIGHT) == "night. He" and end_of_text(NIGHT, 1) == "He"
    assert end_of_text("") == "" and end_of_text("Le") == "Le"


def test_a_wrong_word_before_the_token():
    # the AV's 'station. He' for '...night. He': He (0) and the full stop (1) true, station (2) false
    g = grade_quote('The text ends with "station. He". Hugo is one of the characters.', "night. He", NIGHT)
    assert g.quoted == "station. He"
    assert g.claims == (True, True, False) and g.recalled == (True, True, False)
    assert not g.exact and not g.all_true and g.said


def test_punctuation_units():
    # '...Who was with Greta? Hugo.' ends '? Hugo.'; the AV says '? Greta.': the marks are right, the name not
    context = "Then Greta came. Who was with Greta? Hugo."
    g = grade_quote('The text ends with "? Greta.".', "? Hugo.", context)
    assert g.claims == (True, False, True) and g.recalled == (True, False, True) and not g.exact
    # the token read is a mark: quoting the word before it instead is a false claim at position 0
    g = grade_quote('The text ends with "with Greta".', "with Greta?", "Who was with Greta?")
    assert g.claims == (False, False) and g.recalled == (False, False, False)


def test_no_quotation_is_not_said():
    g = grade_quote("Hugo is one of the characters.", "night. He", NIGHT)
    assert g.quoted is None and g.claims == () and g.recalled == (False, False, False)
    assert not g.said and not g.all_true and not g.exact
    # a quotation with no closing mark is none either
    assert quotation('The text ends with "night. He') is None


def test_a_quotation_longer_than_the_truth():
    # at the story's first word there is nothing before it: every unit before the token is false
    g = grade_quote('The text ends with "the park. Leo".', "Leo", "Leo")
    assert g.claims == (True, False, False, False) and g.recalled == (True,) and not g.exact
    # with the context the units before text_end are checked against it: 'the' is the text's
    context = "She went to the park. Leo"
    g = grade_quote('The text ends with "the park. Leo".', "park. Leo", context)
    assert g.claims == (True, True, True, True) and g.recalled == (True, True, True) and not g.exact
    # without it they cannot be checked and count false
    assert grade_quote('The text ends with "the park. Leo".', "park. Leo").claims == (True, True, True, False)


def test_exact_ignores_spacing_but_not_case():
    assert grade_quote('The text ends with "night . He".', "night. He", NIGHT).exact
    g = grade_quote('The text ends with "night. he".', "night. He", NIGHT)
    assert g.claims == (False, True, True) and not g.exact


def test_a_context_that_does_not_end_with_text_end_is_refused():
    with pytest.raises(ValueError, match="not with its text_end 'night. He'"):
        grade_quote('The text ends with "He".', "night. He", "It was morning. She")
    with pytest.raises(ValueError, match="text_end: row 1: .*not with its text_end"):
        quotation_summary(["", ""], [("He", "He"), ("night. He", "morning. She")], get_grader("world"))


def test_summary_per_position_by_hand():
    rows = [('The text ends with "station. He".', ("night. He", NIGHT)),  # He, . true; station false
            ("Hugo is one of the characters.", ("night. He", NIGHT)),  # no quotation
            ('The text ends with "night. He". Hugo is one of the characters.', ("night. He", NIGHT)),  # exact
            ('The text ends with "He".', None)]  # no truth: not graded
    texts, quotes = [t for t, _ in rows], [q for _, q in rows]
    q = quotation_summary(texts, quotes, get_grader("world"))
    assert q.n == 3 and q.said == pytest.approx(2 / 3) and q.exact == pytest.approx(1 / 3)
    assert q.all_true == 0.5  # of the two that quote, one has a false unit
    # recall over the 3 rows (not said counts against it), precision over the 2 that quote
    assert q.by_position == {"quote[0]": (pytest.approx(2 / 3), 1.0), "quote[1]": (pytest.approx(2 / 3), 1.0),
                             "quote[2]": (pytest.approx(1 / 3), 0.5)}
    assert q.claims == {"quote[0]": 2, "quote[1]": 2, "quote[2]": 2}
    # the fact figures do not move: the quotation is graded beside them, never as a fact
    facts = [["person=hugo", "time=night"]] * 4
    with_quote, without = faithfulness(texts, facts, quotes=quotes), faithfulness(texts, facts)
    assert (with_quote.recall, with_quote.precision, with_quote.by_kind) == (without.recall, without.precision,
                                                                             without.by_kind)
    assert without.quote is None and with_quote.quote == q


def test_a_false_quotation_is_a_false_claim():
    g = get_grader("world")
    truth = ["person=hugo", "time=night"]
    assert g.claim_truth('The text ends with "station. He".', truth, ("night. He", NIGHT)) is False
    assert g.claim_truth('The text ends with "night. He".', truth, ("night. He", NIGHT)) is True
    assert g.claim_truth('The text ends with "night. He".', truth) is None  # no quote truth: not graded
    assert g.claim_truth("Hugo is one of the characters.", truth, ("night. He", NIGHT)) is True


def test_the_explorer_marks_each_quoted_unit():
    from nla.explore.engine import grade_claims

    out = grade_claims('The text ends with "station. He". Hugo is one of the characters.', ["person=hugo"], NIGHT)
    q = out["quotation"]
    assert q["truth"] == "night. He" and q["exact"] is False and q["correct"] is False
    assert q["units"] == [{"unit": "station", "position": 2, "correct": False},
                          {"unit": ".", "position": 1, "correct": True},
                          {"unit": "He", "position": 0, "correct": True}]
    assert out["claims"] == [{"fact": "person=hugo", "correct": True}]
    # typed text (no facts): the quotation is still graded against the text
    assert grade_claims('The text ends with "He".', None, NIGHT)["quotation"]["correct"] is True
    assert grade_claims("Hugo is here.", None, NIGHT) == {"quotation": None}
    json.dumps(out)  # what the page receives
    # a fact said unsure (fact_unheld: hedge) is shown apart, marked with its truth, and is no claim
    out = grade_claims("Hugo is one of the characters. Perhaps someone has a kite. Perhaps the mood is sad.",
                       ["person=hugo", "mood=sad", "place=forest"], NIGHT)
    assert out["claims"] == [{"fact": "person=hugo", "correct": True}]
    assert out["unsure"] == [{"fact": "object=kite", "correct": False}, {"fact": "mood=sad", "correct": True}]
    assert out["missed"] == ["place=forest"] and out["precision"] == 1.0 and out["recall"] == 1 / 3
    assert get_grader("world").claim_truth("Perhaps the mood is sad.", ["mood=sad"]) is None  # no claim: not graded


def test_quote_units_cuts_the_quotation_from_the_token_back():
    assert cut_quote("night. He", 1) == "He" and cut_quote("night. He", 2) == ". He"
    assert cut_quote("night. He", None) == "night. He" and cut_quote(None, 1) is None
    with pytest.raises(ValueError, match="quote_units"):
        cut_quote("night. He", 0)
    full, one = TextExplainer(seed=0), TextExplainer(seed=0, quote_units=1)
    facts = frozenset()
    assert full.explain(facts, 7, "night. He").startswith('The text ends with "night. He". ')
    cut = one.explain(facts, 7, "night. He")
    assert cut.startswith('The text ends with "He". ')
    assert cut.split(". ", 1)[1] == full.explain(facts, 7, "night. He").split('". ', 1)[1]  # the same facts
    assert oracle_explanation([], cut_quote("night. He", 1), 3).startswith('The text ends with "He".')


def test_quote_units_setting_is_checked_and_off_by_default():
    from nla.datagen.pipeline import stage_hash

    assert DatagenConfig().world_explainer.quote_units is None
    with pytest.raises(ValueError, match="quote_units"):
        DatagenConfig.from_dict({"world_explainer": {"quote_units": 0}})
    # the default leaves the explain stage's hash as it was before the setting existed; a value changes it
    default = DatagenConfig()
    one = DatagenConfig.from_dict({"world_explainer": {"quote_units": 1}})
    assert stage_hash(default, "explain") != stage_hash(one, "explain")
    import hashlib

    from nla.datagen.pipeline import _STAGE_FIELDS, STAGES

    before = default.to_dict()
    before["world_explainer"].pop("quote_units")  # the settings as they were
    before["world_explainer"].pop("quote_min_prob")
    before["world_explainer"].pop("quote_unheld")
    before["world_explainer"].pop("fact_min_prob")
    before["world_explainer"].pop("fact_unheld")
    before["world_explainer"].pop("fact_gate_below")
    before["world_explainer"].pop("fact_omit_below")
    before["world_explainer"].pop("fact_every_own")
    before.pop("wiki_explainer")  # a section added later, at its default
    before.pop("layers")  # a setting added later, at its default (one block)
    keys = [k for s in STAGES[: STAGES.index("explain") + 1] for k in _STAGE_FIELDS[s]]
    blob = json.dumps({k: before[k] for k in keys if k in before}, sort_keys=True, default=str)
    assert stage_hash(default, "explain") == hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert stage_hash(default, "extract") == stage_hash(one, "extract")


def test_the_suite_counts_a_false_quotation_as_a_false_claim():
    from nla.eval.suite.claims import Claim, claims_summary
    from nla.eval.suite.confabulation import confabulation

    g = get_grader("world")
    texts = ['The text ends with "station. He". Hugo is one of the characters.',
             'The text ends with "night. He". The mood is sad.']
    truths = [["person=hugo"], ["person=hugo"]]
    quotes = [("night. He", NIGHT), ("night. He", NIGHT)]
    conf = confabulation(texts, truths, g, quotes=quotes)
    assert conf["false_rate"] == 0.5  # the facts' own figure: hugo true, sad false
    assert conf["quotation"]["claims"] == 2 and conf["quotation"]["false_rate"] == 0.5
    assert conf["quotation"]["by_position"]["quote[2]"] == [0.5, 0.5]
    assert "quotation" not in confabulation(texts, truths, g)
    # claim attribution: the quotation keeps its group, split into true and false
    attr = [[Claim(texts[0].split(". H")[0] + ".", 0.2, g.claim_truth('The text ends with "station. He".',
                                                                      truths[0], quotes[0]), True),
             Claim("Hugo is one of the characters.", 0.4, True, False)],
            [Claim('The text ends with "night. He".', 0.6, True, True), Claim("The mood is sad.", 0.1, False, False)]]
    assert attr[0][0].truth is False
    out = claims_summary(attr, raw_mean=2.0)
    assert (out["n_quotation"], out["n_quotation_true"], out["n_quotation_false"]) == (2, 1, 1)
    assert out["fve_cost_quotation_false"] == pytest.approx(0.1) and out["fve_cost_quotation_true"] == pytest.approx(0.3)
    assert (out["n_true"], out["n_false"]) == (1, 1)  # the fact claims' figures as before


def test_the_report_shows_the_quotation_per_position(tmp_path):
    from nla.eval.report import quote_summary, write_report

    def ev(q0, exact):
        quote = {"n": 4, "said": 1.0, "exact": exact, "all_true": exact, "claims": {"quote[0]": 4},
                 "by_position": {"quote[0]": [q0, q0], "quote[1]": [0.5, 0.5], "quote[2]": [0.25, 0.25]}}
        faith = {"recall": 0.9, "precision": 0.9, "by_kind": {}, "n": 4, "quote": quote}
        row = {"fve": 0.5, "cosine": 0.8, "failure_rate": 0.0, "faithfulness": faith, "degenerate": {"any": 0.0}}
        return {"n_rows": 4, "d_model": 8, "baseline_raw_mean_mse": 0.8, "samples": [],
                "rows": [{"name": "AV → AR round trip", **row}]}

    warm, rl = ev(0.75, 0.25), ev(1.0, 0.5)
    head = quote_summary(warm, rl)
    assert head["quote_exact_warmstart"] == 0.25 and head["quote_exact_rl"] == 0.5
    assert head["quote_by_position_rl"]["quote[0]"] == [1.0, 1.0] and head["oracle_quote_exact_rl"] is None
    md = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                      ar_info={}, av_info={}, rl_info={}).read_text()
    assert "### The quotation of the text's end (AV → AR round trip)" in md
    assert "| quote[0] (the token read) | 0.75 | 0.75 | 1.00 | 1.00 |" in md
    assert "| exactly the text's end (share of rows) | 0.25 | | 0.50 | |" in md
    assert "exactly right on **0.250 → 0.500** of rows" in md
    saved = json.loads((tmp_path / "report.json").read_text())["headline"]
    assert saved["quote_by_position_warmstart"]["quote[2]"] == [0.25, 0.25]


def test_the_report_s_suite_section_counts_false_quotations():
    from nla.eval.report import suite_section

    conf = {"baseline": {"false_rate": 0.2, "quotation": {"claims": 4, "false_rate": 0.5}},
            "pair": {"false_rate": 0.1, "quotation": {"claims": 4, "false_rate": 0.25}}}
    md = suite_section({"n_rows": 4, "targets": [], "sections": {"confabulation": conf}})
    assert "- False quotations (one quoted word or mark not the text's): 0.500 → 0.250 of 4 quotations" in md[-2]
