"""Facts said only where the vector holds them (``world_explainer.fact_min_prob``, issue 59): a probe of
each kind, fitted on other documents, must score the row's own fact highest; the data explainer and the
oracle then name only such facts, so a block that holds little gets a short, true explanation."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from nla.core.probing import held_labels, read_labels
from nla.datagen.config import DatagenConfig, WorldExplainerConfig
from nla.datagen.explain import FACTS_HELD, WorldExplainer, add_facts_held
from nla.datagen.io import vectors_to_arrow
from nla.world.explain import parse_facts

D = 8
PERSONS = ("alice", "bruno")
PLACES = ("park", "school")


def _vec(rng, person: str | None, place_signal: float) -> np.ndarray:
    """Dimension 0 says the person (+1 alice, -1 bruno) strongly; the place is noise unless place_signal."""
    v = rng.normal(0, 0.05, D).astype(np.float32)
    v[2] = 1.0  # a shared direction, so every vector has a norm
    if person is not None:
        v[0] += 1.0 if person == "alice" else -1.0
    return v


def _table(rng, n_docs: int, rows_per_doc: int, start: int = 0) -> pa.Table:
    vecs, facts, docs, pos = [], [], [], []
    for d in range(start, start + n_docs):
        for p in range(rows_per_doc):
            person = PERSONS[(d + p) % 2]
            place = PLACES[rng.integers(2)]
            vecs.append(_vec(rng, person, 0.0))
            facts.append([f"person={person}", f"place={place}"])
            docs.append(d)
            pos.append(p)
    return pa.table({"activation_vector": vectors_to_arrow(np.stack(vecs)), "doc_id": pa.array(docs, pa.int64()),
                     "position": pa.array(pos, pa.int32()), "facts": pa.array(facts, pa.list_(pa.string()))})


def test_read_labels_and_held_labels_by_hand():
    rng = np.random.default_rng(0)
    x = np.stack([_vec(rng, PERSONS[i % 2], 0.0) for i in range(40)])
    labels = [[f"person={PERSONS[i % 2]}"] for i in range(40)]
    top, p = read_labels(x, labels, x[:4])
    assert top == ["person=alice", "person=bruno", "person=alice", "person=bruno"] and (p > 0.9).all()
    # a row whose own label is not what its vector says holds nothing; a row without labels holds nothing
    own = [list(lab) for lab in labels]
    own[3] = ["person=alice"]  # its vector says bruno
    own[5] = []
    held, _ = held_labels(x, own, groups=[i // 4 for i in range(40)], min_prob=0.5)
    assert held[0] == "person=alice" and held[1] == "person=bruno"
    assert held[3] is None and held[5] is None
    # two labels at once: the top one counts when it is among them
    both = [["person=alice", "person=bruno"] if i == 7 else lab for i, lab in enumerate(labels)]
    held, _ = held_labels(x, both, groups=[i // 4 for i in range(40)], min_prob=0.5)
    assert held[7] == "person=bruno"
    # the other rows are read by the probe fitted on every fit row
    _, other = held_labels(x, labels, [i // 4 for i in range(40)], 0.5, x_other=x[:2], labels_other=[["person=bruno"], []])
    assert other == [None, None]  # row 0's vector says alice
    # nothing reaches probability 1.01; a probability outside [0, 1] is refused
    with pytest.raises(ValueError, match=r"held_labels: min_prob must be in \[0, 1\], found 1.01"):
        held_labels(x, labels, [i // 4 for i in range(40)], 1.01)


def test_the_explainer_names_only_the_facts_the_vector_holds():
    rng = np.random.default_rng(1)
    tables = {"av_sft": _table(rng, 20, 4), "ar_sft": _table(rng, 20, 4, start=20), "rl": _table(rng, 10, 4, start=40)}
    out, summary = add_facts_held(tables, 0.9)
    # the person is in every vector, the place in none (a coin flip per row): the probe holds the person
    for name, t in out.items():
        held = t.column(FACTS_HELD).to_pylist()
        facts = t.column("facts").to_pylist()
        assert all(set(h) <= set(f) for h, f in zip(held, facts, strict=True))
        assert summary["share"][name]["person"] >= 0.95
        assert summary["share"][name]["place"] <= 0.05
        assert summary["share"][name]["time"] is None  # no row has a time
    explainer = WorldExplainer(0, 3, 6, wrong_rate=0.0, fact_rate=1.0)
    rows = out["rl"].select(["doc_id", "position", "facts", FACTS_HELD]).to_pylist()
    texts = explainer.explain_batch(rows)
    for row, text in zip(rows, texts, strict=True):
        said = {f"{f.kind}={f.value}" for f in parse_facts(text)}
        assert said == set(row[FACTS_HELD]), (text, row)
    # without the column the same explainer names the place too
    texts = explainer.explain_batch([{k: v for k, v in r.items() if k != FACTS_HELD} for r in rows])
    assert all(any(f.kind == "place" for f in parse_facts(t)) for t in texts)


def test_the_setting_is_checked_and_leaves_older_runs_hashes_alone():
    with pytest.raises(ValueError, match=r"world_explainer.fact_min_prob: expected a probability in \[0, 1\] or null"):
        WorldExplainerConfig(fact_min_prob=2)
    from nla.datagen.pipeline import stage_hash

    base = DatagenConfig.from_dict({"out_dir": "x", "source": "world"})
    gated = DatagenConfig.from_dict({"out_dir": "x", "source": "world", "world_explainer": {"fact_min_prob": 0.9}})
    assert stage_hash(base, "extract") == stage_hash(gated, "extract")
    assert stage_hash(base, "explain") != stage_hash(gated, "explain")
    assert stage_hash(base, "explain") == stage_hash(DatagenConfig.from_dict(
        {"out_dir": "x", "source": "world", "world_explainer": {"fact_min_prob": None}}), "explain")
