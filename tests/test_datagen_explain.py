"""Explainers: world (ground-truth facts), context (offline), explain_table drop accounting, world extraction."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest

from nla.datagen.config import DatagenConfig
from nla.datagen.corpus import world_corpus
from nla.datagen.explain import ContextExplainer, Explainer, explain_table, make_explainer, row_key
from nla.datagen.extract import extract_activations
from nla.datagen.io import DatagenError, read_parquet
from nla.world import Fact, TextExplainer, current_word, grade, token_facts


def test_row_key_stable_and_distinct():
    assert row_key(3, 7) == row_key(3, 7)
    assert row_key(3, 7) != row_key(7, 3)
    assert 0 <= row_key(10**9, 10**6) < 2**63


def test_world_explainer_matches_text_explainer():
    cfg = DatagenConfig()
    ex = make_explainer("world", cfg)
    rows = [
        {"doc_id": 1, "position": 4, "context": "x", "facts": ["person=alice", "place=market"]},
        {"doc_id": 2, "position": 9, "context": "y", "facts": []},
    ]
    got = ex.explain_batch(rows)
    ref = TextExplainer(seed=0, min_facts=3, max_facts=6, wrong_rate=0.1)  # DatagenConfig's defaults
    for r, text in zip(rows, got, strict=True):
        facts = frozenset(Fact.parse(s) for s in r["facts"])
        assert text == ref.explain(facts, row_key(r["doc_id"], r["position"])).strip()
    assert ex.drops == Counter()
    with pytest.raises(DatagenError, match=r"doc_id=5 position=1 has no 'facts' column"):
        ex.explain_batch([{"doc_id": 5, "position": 1, "context": "z"}])


def test_context_explainer_hand_worked():
    ex = ContextExplainer(n_recent=3, n_topics=2)
    # words: Alice walks to the market and Alice buys; current token " buys"
    # recent (3 words before the last) = "market and Alice"; topics (len>2, no stop words):
    # alice x2 first, then walks (seen before market, buys) x1
    text = ex.explain_one("Alice walks to the market and Alice buys", " buys")
    assert (
        text
        == 'The current token is "buys", right after "market and Alice". The text so far is mostly about alice and walks.'
    )
    assert ex.explain_one("Hi", "Hi") == 'The current token is "Hi", at the start of the text.'
    assert ex.explain_batch([{"context": "...", "token": "."}]) == [None]
    assert ex.drops == Counter({"empty_context": 1})


class Flaky(Explainer):
    """Drops odd positions; records a reason for only half of them (the rest must count as unspecified)."""

    name = "flaky"

    def explain_batch(self, rows):
        out = []
        for r in rows:
            if r["position"] % 2:
                if r["position"] % 4 == 1:
                    self.drops["no_tag"] += 1
                out.append(None)
            else:
                out.append(f"e{r['position']}")
        return out


def test_explain_table_drops_counted():
    t = pa.table({"doc_id": [0] * 8, "position": list(range(8)), "context": ["c"] * 8,
                  "activation_vector": pa.array([[1.0]] * 8, pa.list_(pa.float32()))})  # fmt: skip
    out, dropped = explain_table(t, Flaky(), batch_size=3)
    # odd positions 1,3,5,7 dropped; 1 and 5 with reason no_tag, 3 and 7 without a reason
    assert out.column("position").to_pylist() == [0, 2, 4, 6]
    assert out.column("explanation").to_pylist() == ["e0", "e2", "e4", "e6"]
    assert dropped == Counter({"no_tag": 2, "unspecified": 2})


def test_world_columns_from_extraction(tiny_model_dir, tmp_path, tiny_tokenizer):
    docs = world_corpus(seed=0, n_docs=6)
    res = extract_activations(tiny_model_dir("llama"), docs, 1, 4, 2, 0, 3, tmp_path, 64)
    t = read_parquet(res.path)
    assert {"facts", "current_word"} <= set(t.column_names)
    by_id = {d.doc_id: d for d in docs}
    for r in t.drop_columns(["activation_vector"]).to_pylist():
        doc = by_id[r["doc_id"]].world_doc
        enc = tiny_tokenizer(doc.text, truncation=True, max_length=64, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        assert r["facts"] == sorted(str(f) for f in token_facts(doc, offsets)[r["position"]])
        assert r["current_word"] == current_word(doc, offsets[r["position"]][1])
    # the world explainer mentions at least one true fact for rows with 2+ facts revealed (wrong_rate 0)
    ex = make_explainer("world", DatagenConfig.from_dict({"world_explainer": {"wrong_rate": 0.0}}))
    rows = [r for r in t.drop_columns(["activation_vector"]).to_pylist() if len(r["facts"]) >= 2]
    assert rows, "world docs reveal facts early; expected some rows with 2+ facts"
    for r, text in zip(rows, ex.explain_batch(rows), strict=True):
        assert grade(text, [Fact.parse(s) for s in r["facts"]]).n_correct >= 1
