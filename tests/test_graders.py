"""The dataset grader registry: a dataset names its grader, the core imports no world code.

Values below are derived by hand from each grader's definition.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_client import FIXED_EXPLANATION, NLAClient, nla_pair  # noqa: F401 - nla_pair is a fixture

import nla.core.graders as G
from nla.core.reward import format_flags
from nla.core.sidecar import write_sidecar
from nla.datagen.io import read_parquet, vectors_to_arrow, write_parquet_atomic
from nla.eval.evaluate import evaluate_pair


class ColourGrader(G.DatasetGrader):
    """A user's corpus whose truth is a set of colour words: a colour named is a claim."""

    name = "colours"
    kinds = ("colour",)
    degeneracy_checks = ("shouting",)
    COLOURS = {"red", "green", "blue"}

    def grade(self, explanation, truth):
        said = {w.strip(".,").lower() for w in explanation.split()} & self.COLOURS
        true = set(truth)
        recall = len(said & true) / len(true) if true else 1.0
        precision = len(said & true) / len(said) if said else (1.0 if not true else 0.0)
        return type("Grade", (), {"recall": recall, "precision": precision,
                                  "by_kind": {"colour": (recall, precision)} if said or true else {}})()

    def degeneracy(self, text):
        return {"shouting": bool(text) and text.isupper()}

    def oracle(self, truth, quote, key):
        return " ".join(sorted(truth)) or "nothing"


@pytest.fixture
def colours():
    G.register_grader("colours", ColourGrader, replace=True)
    yield G.get_grader("colours")
    G._REGISTRY.pop("colours", None)
    G._INSTANCES.pop("colours", None)


def test_the_core_imports_no_world_code():
    """Reward, RL loop, roles, evaluation, client, the explanation suite: none loads a module of nla.world."""
    code = ("import sys, nla.core.reward, nla.rl.reward, nla.rl.loop, nla.rl.roles, nla.eval.evaluate, nla.client, nla.core.graders, nla.eval.suite, "
            "nla.core.probing; "
            "print(sorted(m for m in sys.modules if m.startswith('nla.world')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_generic_checks_and_the_registry_errors(colours):
    g = G.get_grader("generic")
    assert g.degeneracy("The cat sat. the CAT sat.") == {"repeated": True, "broken_quote": False}
    assert g.degeneracy('He said "hi. Then left.') == {"repeated": False, "broken_quote": True}
    assert g.degeneracy(None) == {"repeated": False, "broken_quote": False}
    assert g.grade("anything", ["x=y"]) is None and g.oracle(["x=y"], None, 0) is None
    assert {"generic", "world", "colours"} <= set(G.available_graders())
    with pytest.raises(ValueError, match=r"grader: expected one of \[.*'generic'.*\], found 'nope'"):
        G.get_grader("nope")
    with pytest.raises(ValueError, match="'colours' is already registered; pass replace=True"):
        G.register_grader("colours", ColourGrader)
    G.register_grader("broken", lambda: object())
    try:
        with pytest.raises(TypeError, match="grader 'broken': its factory returned object, not a DatasetGrader"):
            G.get_grader("broken")
    finally:
        G._REGISTRY.pop("broken")


def test_format_flags_use_the_named_graders_checks(colours):
    texts = ["RED ALERT.", "red and blue.", None, "It rained. It rained."]
    assert format_flags(texts, "colours").tolist() == [True, False, False, False]
    assert format_flags(texts, "generic").tolist() == [False, False, False, True]
    with pytest.raises(ValueError, match=r"format_checks: expected one of \[.*\], found 'nope'"):
        format_flags(texts, "nope")


def test_a_dataset_names_its_grader(tmp_path, colours):
    vecs = np.zeros((2, 4), np.float32)
    plain = pa.table({"activation_vector": vectors_to_arrow(vecs)})
    world = plain.append_column("facts", pa.array([["person=alice"], []], pa.list_(pa.string())))
    assert G.grader_for_table(plain) is None
    assert G.grader_for_table(world).name == "world"  # a facts column, no tag: the world (older datasets)
    path = write_parquet_atomic(G.tag_grader(world, "colours"), tmp_path / "tagged.parquet")
    assert G.grader_for_table(read_parquet(path)) is colours  # the tag survives the parquet file
    with pytest.raises(ValueError, match="found 'nope'"):
        G.tag_grader(plain, "nope")


def test_faithfulness_is_one_definition_over_any_grader(colours):
    texts = ["red and green", None, "blue"]
    truth = [["red"], ["green"], []]
    f = G.faithfulness(texts, truth, colours)
    # recall: 1/1, 0/1 (claimed nothing); the third row has no truth ([]: nothing holds) and no recall
    # (issue 58); precision: 1/2, 0 (nothing said, truth), 0/1 ("blue" where nothing holds)
    assert (f.recall, f.precision, f.n) == (pytest.approx(1 / 2), pytest.approx(1 / 6), 2)
    assert f.by_kind == {"colour": (pytest.approx(1 / 2), pytest.approx(0.25))}
    assert G.faithfulness(texts, truth, G.get_grader("generic")) is None


def test_evaluate_pair_grades_with_the_datasets_own_grader(nla_pair, tmp_path, colours):  # noqa: F811
    """A user's corpus (no world facts) tagged with its grader: eval's faithfulness, degeneracy
    and oracle rows come from that grader. The AV says FIXED_EXPLANATION for every row."""
    n = 4
    vecs = np.random.default_rng(0).standard_normal((n, 32)).astype(np.float32)
    truth = [["red"], [], ["green", "blue"], ["red"]]
    table = pa.table({"activation_vector": vectors_to_arrow(vecs), "facts": pa.array(truth, pa.list_(pa.string())),
                      "current_word": pa.array(["a", "b", "c", "d"])})
    path = write_parquet_atomic(G.tag_grader(table, "colours"), tmp_path / "corpus.parquet")
    write_sidecar(path, nla_pair.side.replace(kind="nla_dataset", role=None))
    client = NLAClient(nla_pair.av_dir, nla_pair.ar_dir, device="cpu")
    report = evaluate_pair(client, path, max_new_tokens=14, n_show=0)
    rt = report.row("AV → AR round trip")
    said = {w.lower() for w in FIXED_EXPLANATION.split()} & ColourGrader.COLOURS
    assert not said  # the fixed explanation names no colour: recall 0 where truth exists; row 1 ([]: nothing
    # holds) has no recall, and no precision either as it claims nothing (issue 58)
    assert rt.faithfulness.recall == pytest.approx((0 + 0 + 0) / 3)
    assert rt.faithfulness.precision == pytest.approx((0 + 0 + 0) / 3)
    assert rt.degenerate == {"any": 0.0, "shouting": 0.0}
    oracle = report.row("oracle: every true fact → AR")
    want = client.score(["red", "nothing", "blue green", "red"], torch.from_numpy(vecs))
    assert oracle.faithfulness.recall == 1.0 and oracle.faithfulness.precision == 1.0
    assert oracle.cosine == pytest.approx(float(want.cosine.mean()), abs=1e-5)
    # the same table, graded as generic: no faithfulness, the generic checks
    generic = evaluate_pair(client, path, max_new_tokens=14, n_show=0, grader="generic")
    assert generic.row("AV → AR round trip").faithfulness is None
    assert set(generic.row("AV → AR round trip").degenerate) == {"any", "repeated", "broken_quote"}
    with pytest.raises(KeyError, match="no row 'oracle"):  # the generic grader has no oracle
        generic.row("oracle: every true fact → AR")


def test_eval_refuses_an_unknown_grader_before_any_model_loads(tmp_path, capsys):
    from nla.cli import main

    rc = main(["eval", "--ar", str(tmp_path / "no_such_ar"), "--dataset", str(tmp_path / "none.parquet"),
               "--grader", "nope", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "nla eval: error: grader: expected one of" in err and "found 'nope'" in err


def test_shuffle_sentences_by_hand():
    # three sentences, a full stop inside a quotation not ending one; the order is the RNG's permutation
    text = 'The text ends with "the park.". Leo is one of the characters.  The tone is calm.'
    sentences = ['The text ends with "the park.".', "Leo is one of the characters.", "The tone is calm."]
    for seed in range(6):
        order = np.random.default_rng(seed).permutation(3)
        assert G.shuffle_sentences(text, np.random.default_rng(seed)) == " ".join(sentences[i] for i in order)
    assert G.shuffle_sentences("One claim only", np.random.default_rng(0)) == "One claim only"
    assert G.shuffle_sentences("", np.random.default_rng(0)) == ""


def test_world_grader_quotes_the_text_end_column_else_the_current_word():
    w = G.get_grader("world")
    both = pa.table({"text_end": ["the park.", None], "current_word": ["park", "x"]})
    assert w.quotes(both) == ["the park.", None]
    assert w.quotes(pa.table({"current_word": ["park", "Le"]})) == ["park", "Le"]  # written before text_end
    assert w.quotes(pa.table({"facts": [["mood=calm"]]})) == [None]  # nothing to quote: facts alone
    assert G.get_grader("generic").quotes(both) == [None, None]
    # the oracle quotes what it is given, before every true fact
    assert w.oracle(["mood=calm"], "the park.", 0).startswith('The text ends with "the park.". ')


def test_empty_truth_lists_are_not_perfect_recall():
    """facts: [] on every row graded recall 1.0, the shuffled baseline's included (issue 58). An empty
    list says nothing holds: no recall for that row; precision only where a fact is named (then 0)."""
    from nla.core.graders import faithfulness

    texts = ["Alice is in the garden.", "Nothing specific has been said yet.", "Bruno is happy."]
    every_empty = faithfulness(texts, [[], [], []])
    # row 0 names 2 facts, none hold -> precision 0; row 1 names none -> not graded; row 2: 2 named, 0 hold -> 0
    assert (every_empty.recall, every_empty.precision, every_empty.n) == (None, 0.0, 0)
    assert every_empty.note == ("3 of 3 rows have no fact that holds (facts []): left out of recall, in precision "
                                "only where the explanation names a fact")
    nothing_claimed = faithfulness(["Nothing specific has been said yet."] * 2, [[], []])
    assert (nothing_claimed.recall, nothing_claimed.precision) == (None, None)
    # beside a row with truth: that row alone gives recall (1 of 2 -> 0.5); precision (1/2 + 0) / 2
    mixed = faithfulness(["Alice is in the garden.", "Bruno is happy."], [["person=alice", "time=night"], []])
    assert mixed.recall == pytest.approx(0.5) and mixed.precision == pytest.approx(0.25) and mixed.n == 1
    # by kind, row 0 only (the grader's convention: a kind named but not true has recall 1, precision 0)
    assert mixed.by_kind == {"person": (1.0, 1.0), "place": (1.0, 0.0), "time": (0.0, 0.0)}
