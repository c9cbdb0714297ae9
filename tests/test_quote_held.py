"""Quote only what the vector holds (issue 57): the unit probe, the datagen setting
``world_explainer.quote_min_prob``, and the data explainer and oracle that follow it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from nla.core.probing import held_units, read_units
from nla.datagen.config import DatagenConfig
from nla.datagen.explain import WorldExplainer, add_quote_held
from nla.world.explain import QUOTE_HELD, quotation


def _vectors(units, seed=0, noise=0.05):
    """One direction per unit, except "d" and "e", which share one: a vector of a "d" row cannot tell it
    from an "e" row, so no probe reads either with probability much above one half."""
    dirs = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 3, "f": 4}
    rng = np.random.default_rng(seed)
    x = rng.normal(0, noise, (len(units), 6)).astype(np.float32)
    for i, u in enumerate(units):
        x[i, dirs[u]] += 1.0
    return x


def test_the_probe_reads_separable_units_and_not_confusable_ones():
    units = ["a", "b", "c", "d", "e"] * 40
    x = _vectors(units)
    top, p = read_units(x, units, _vectors(["a", "b", "c", "d"], seed=1))
    assert top[:3] == ["a", "b", "c"] and (p[:3] > 0.9).all()
    assert top[3] in ("d", "e") and 0.3 < p[3] < 0.7  # d and e are the same vector: about one half each
    # no unit seen twice: nothing is read; one unit seen twice: it is all there is to read
    top, p = read_units(x[:2], ["a", "b"], x[:3])
    assert top == [None, None, None] and (p == 0).all()
    top, p = read_units(x[:3], ["a", "a", "b"], x[:2])
    assert top == ["a", "a"] and (p == 1).all()
    with pytest.raises(ValueError, match="2 fit vectors for 3 units"):
        read_units(x[:2], ["a", "b", "c"], x)


def test_held_units_cross_fits_by_group_and_reads_held_out_rows():
    units = ["a", "b", "c", "d", "e"] * 40
    groups = [i // 5 for i in range(len(units))]  # one story per five rows, each story in one fold
    held, other = held_units(_vectors(units), units, groups, 0.8,
                             x_other=_vectors(["a", "d", "f", "b"], seed=2), units_other=["a", "d", "f", "b"])
    by_unit = {u: held[[i for i, v in enumerate(units) if v == u]] for u in "abcde"}
    assert all(by_unit[u].all() for u in "abc")  # separable: held everywhere
    assert not by_unit["d"].any() and not by_unit["e"].any()  # confusable: never held at p >= 0.8
    # "f" was never seen in the fit rows: not a class, so not held
    assert other.tolist() == [True, False, False, True]
    # at min_prob 0 the verdict is the probe's top-1 only, and a group's rows are never read by a probe
    # that saw them: the same rows in one fold and in a fold of their own give the same answer
    h0, _ = held_units(_vectors(units), units, groups, 0.0)
    assert h0[[i for i, v in enumerate(units) if v in "abc"]].all()
    with pytest.raises(ValueError, match="min_prob must be in"):
        held_units(_vectors(units), units, groups, 1.5)
    with pytest.raises(ValueError, match="folds must be >= 2"):
        held_units(_vectors(units), units, groups, 0.5, folds=1)


def test_the_setting_is_checked_and_leaves_the_default_hash():
    from nla.datagen.pipeline import stage_hash

    assert DatagenConfig().world_explainer.quote_min_prob is None
    with pytest.raises(ValueError, match=r"world_explainer\.quote_min_prob: expected null unless quote_units is 1"):
        DatagenConfig.from_dict({"world_explainer": {"quote_min_prob": 0.5}})
    with pytest.raises(ValueError, match=r"quote_min_prob: expected a probability in \[0, 1\].*found 2"):
        DatagenConfig.from_dict({"world_explainer": {"quote_units": 1, "quote_min_prob": 2}})
    one = DatagenConfig.from_dict({"world_explainer": {"quote_units": 1}})
    gated = DatagenConfig.from_dict({"world_explainer": {"quote_units": 1, "quote_min_prob": 0.5}})
    assert stage_hash(one, "explain") != stage_hash(gated, "explain")
    assert stage_hash(one, "split") == stage_hash(gated, "split")
    # null (the default) leaves the hash of data written before the setting existed
    assert stage_hash(one, "explain") == stage_hash(
        DatagenConfig.from_dict({"world_explainer": {"quote_units": 1, "quote_min_prob": None}}), "explain")


def _split(units, docs, seed):
    x = _vectors(units, seed=seed, noise=0.0)  # no noise to fit: a "d" row is exactly an "e" row
    return pa.table({"doc_id": docs, "position": list(range(len(units))),
                     "activation_vector": [r.tolist() for r in x], "text_end": [f"so {u}" for u in units],
                     "facts": [["person=hugo"]] * len(units)})


def test_the_data_explainer_and_the_oracle_quote_only_held_rows():
    from nla.core.graders import get_grader

    units = ["a", "b", "c", "d", "e"] * 20
    tables = {"av_sft": _split(units, [i // 5 for i in range(100)], 0),
              "ar_sft": _split(units, [100 + i // 5 for i in range(100)], 1),
              "rl": _split(["a", "d", "c", "e"], [500, 500, 501, 501], 2)}
    out, summary = add_quote_held(tables, 0.8)
    assert summary["min_prob"] == 0.8
    assert out["rl"].column(QUOTE_HELD).to_pylist() == [True, False, True, False]
    for name in ("av_sft", "ar_sft"):
        held = out[name].column(QUOTE_HELD).to_pylist()
        assert held == [u in "abc" for u in units]
        assert summary["share"][name] == 0.6
    ex = WorldExplainer(seed=0, min_facts=1, max_facts=1, wrong_rate=0.0, quote_units=1)
    rows = out["rl"].drop_columns(["activation_vector"]).to_pylist()
    texts = ex.explain_batch(rows)
    assert [quotation(t) for t in texts] == ["a", None, "c", None]
    # the same facts as an ungated row: only the quotation sentence is left out
    assert texts[1] == ex.explain_batch([{**rows[1], QUOTE_HELD: True}])[0].split('". ', 1)[1]
    # the oracle follows the same rule: what it quotes is None where the row is not held
    assert get_grader("world").quotes(out["rl"]) == ["so a", None, "so c", None]
    # a split without the probe's inputs is refused by name
    with pytest.raises(Exception, match="split rl has no text_end column"):
        add_quote_held({**tables, "rl": tables["rl"].drop_columns(["text_end"])}, 0.8)


@pytest.mark.slow
def test_datagen_writes_the_flag_through_to_the_rl_split(tmp_path):
    from nla.datagen.build import load_dataset
    from nla.datagen.pipeline import run

    cfg = DatagenConfig.from_yaml("configs/datagen/world_tiny.yaml", {
        "out_dir": str(tmp_path / "out"), "n_docs": 120,
        "world_explainer": {"min_facts": 3, "max_facts": 6, "wrong_rate": 0.1, "quote_units": 1,
                            "quote_min_prob": 0.5}})
    summary = run(cfg)
    share = summary["explain"]["quote_held"]["share"]
    assert set(share) == {"av_sft", "ar_sft", "rl"} and all(0.0 < v <= 1.0 for v in share.values())
    for name in ("av_sft", "ar_sft"):
        t, _ = load_dataset(tmp_path / "out" / f"{name}.parquet")
        held, texts = t.column(QUOTE_HELD).to_pylist(), t.column("explanation").to_pylist()
        assert [quotation(x) is not None for x in texts] == held  # quoted exactly where the probe reads the token
    rl, _ = load_dataset(tmp_path / "out" / "rl.parquet")
    assert rl.column(QUOTE_HELD).to_pylist().count(True) / rl.num_rows == pytest.approx(share["rl"], abs=5e-5)


def test_a_hedged_quotation_is_said_unsure_and_graded_as_not_said():
    from nla.core.graders import get_grader, quotation_summary
    from nla.world.explain import (
        Hedged,
        cut_quote,
        degeneracy,
        grade_quote,
        in_language,
        render_text_end,
        unheld_quote,
    )

    context = "Hugo went to the station. Soon it was night. He"
    sure, unsure = 'The text ends with "He". Hugo is one of the characters.', 'The text may end with "She".'
    assert render_text_end(Hedged("He")) == 'The text may end with "He".'
    assert isinstance(cut_quote(Hedged("night. He"), 1), Hedged) and cut_quote(Hedged("night. He"), 1) == "He"
    q = quotation(unsure)
    assert q == "She" and isinstance(q, Hedged) and not isinstance(quotation(sure), Hedged)
    assert in_language('The text may end with "She".') and not degeneracy(unsure).any
    g = grade_quote(unsure, "He", context)
    assert (g.said, g.claims, g.recalled, g.exact, g.hedged) == (False, (), (False,), False, (False,))
    right = grade_quote('The text may end with "He".', "He", context)
    assert right.hedged == (True,) and not right.said
    # three rows: said and right, hedged and wrong, hedged and right: precision counts the first only
    grader = get_grader("world")
    texts = [sure, unsure, 'The text may end with "He".']
    summary = quotation_summary(texts, [("He", context)] * 3, grader)
    assert summary.by_position["quote[0]"] == (1 / 3, 1.0) and summary.said == 1 / 3
    assert summary.hedged == 2 / 3 and summary.hedged_true == 0.5
    # the suite: a hedged quotation is no claim, true or false
    assert grader.claim_truth('The text may end with "She".', ["person=hugo"], ("He", context)) is None
    assert grader.claim_truth('The text ends with "She".', ["person=hugo"], ("He", context)) is False
    assert unheld_quote("He", True, "hedge") == "He" and unheld_quote("He", False, "omit") is None
    assert isinstance(unheld_quote("He", False, "hedge"), Hedged) and unheld_quote(None, False, "hedge") is None
    with pytest.raises(ValueError, match="quote_unheld: expected omit or hedge"):
        unheld_quote("He", False, "maybe")


def test_the_data_explainer_hedges_unheld_rows_when_asked():
    units = ["a", "b", "c", "d", "e"] * 20
    tables = {"av_sft": _split(units, [i // 5 for i in range(100)], 0),
              "ar_sft": _split(units, [100 + i // 5 for i in range(100)], 1),
              "rl": _split(["a", "d"], [500, 500], 2)}
    out, _ = add_quote_held(tables, 0.8)
    rows = out["rl"].drop_columns(["activation_vector"]).to_pylist()
    ex = WorldExplainer(seed=0, min_facts=1, max_facts=1, wrong_rate=0.0, quote_units=1, quote_unheld="hedge")
    texts = ex.explain_batch(rows)
    assert texts[0].startswith('The text ends with "a". ') and texts[1].startswith('The text may end with "d". ')
    with pytest.raises(ValueError, match=r"quote_unheld: expected one of omit, hedge, found 'maybe'"):
        DatagenConfig.from_dict({"world_explainer": {"quote_units": 1, "quote_min_prob": 0.5, "quote_unheld": "maybe"}})
    with pytest.raises(ValueError, match=r"quote_unheld: expected omit unless quote_min_prob is set"):
        DatagenConfig.from_dict({"world_explainer": {"quote_units": 1, "quote_unheld": "hedge"}})


def test_the_explorer_marks_a_hedged_quotation_as_unsure():
    from nla.explore.engine import quote_grade

    read = "Hugo went to the station. Soon it was night. He"
    q = quote_grade('The text may end with "He".', read)
    assert q["hedged"] is True and q["correct"] is False and [u["correct"] for u in q["units"]] == [True]
    assert quote_grade('The text ends with "He".', read)["hedged"] is False
