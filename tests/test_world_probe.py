"""nla.world.probe: planted linear features are recovered, noise scores chance, layers are swept."""

from __future__ import annotations

import numpy as np
import pytest

from nla.world.facts import VOCAB, Fact
from nla.world.probe import (
    KindProbe,
    LayerProbe,
    best_layer,
    probe_kinds,
    probe_quotes,
    probe_table_markdown,
    recall_at_precision,
)

KINDS = ("place", "mood")


def _planted(rng: np.random.Generator, n: int, dirs: dict[str, np.ndarray], noise: float):
    """Rows with one true fact per kind; the vector is the sum of the facts' directions plus noise."""
    x, facts = [], []
    for _ in range(n):
        fs = [str(Fact(k, rng.choice(sorted(VOCAB[k])))) for k in KINDS]
        x.append(sum(dirs[f] for f in fs) + noise * rng.standard_normal(len(next(iter(dirs.values())))))
        facts.append(fs)
    return np.asarray(x, dtype=np.float32), facts


def test_planted_feature_is_recovered_and_noise_is_chance():
    rng = np.random.default_rng(0)
    d = 48
    dirs = {str(Fact(k, v)): rng.standard_normal(d) for k in KINDS for v in VOCAB[k]}
    x_tr, f_tr = _planted(rng, 1500, dirs, noise=0.5)
    x_te, f_te = _planted(rng, 600, dirs, noise=0.5)
    got = {p.kind: p for p in probe_kinds(x_tr, f_tr, x_te, f_te, kinds=KINDS)}
    # one true fact per row: chance is 1 / n_facts exactly (12 places, 8 moods)
    assert got["place"].chance == pytest.approx(1 / 12) and got["mood"].chance == pytest.approx(1 / 8)
    assert got["place"].n_rows == 600 and got["place"].n_facts == 12
    assert got["place"].top1 > 0.97 and got["mood"].top1 > 0.97
    # Pure noise carries nothing: top-1 within sampling error of chance (600 rows: sd ~ 0.011 / 0.014).
    noise = {p.kind: p for p in probe_kinds(rng.standard_normal((1500, d)), f_tr, rng.standard_normal((600, d)), f_te,
                                            kinds=KINDS)}
    assert abs(noise["place"].top1 - 1 / 12) < 0.05 and abs(noise["mood"].top1 - 1 / 8) < 0.05
    # one fact a kind: the top-1 is its own fact recall; a planted kind keeps nearly all of it at 0.90 true, noise
    # keeps at most the few surest rows that happen to be right (each 1 / 600 of recall)
    assert got["place"].recall_top1 == pytest.approx(got["place"].top1) and got["place"].recall_p90 > 0.95
    assert noise["place"].recall_top1 == pytest.approx(noise["place"].top1) and noise["mood"].recall_p90 < 0.02


def test_recall_at_precision_by_hand():
    import torch

    # rows in order of the probe's top score: 3, 2, 1, 0.8, 0.5
    scores = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 0.0], [0.5, 0.0], [0.0, 0.8]])
    y = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    # named: right, right (one of two true: 1/2 of recall), wrong, right (row 4), wrong (row 3 holds no fact)
    # true shares 1, 1, 2/3, 3/4, 3/5; recall over the 4 rows with a fact: 1/4, 1.5/4, 1.5/4, 2.5/4, 2.5/4
    assert recall_at_precision(scores, y, 0.9) == pytest.approx(0.375)
    assert recall_at_precision(scores, y, 0.7) == pytest.approx(0.625)
    assert recall_at_precision(scores, y, 0.5) == pytest.approx(0.625)
    assert recall_at_precision(-scores, y, 0.9) == 0.0  # its surest row is wrong: no prefix is 0.90 true
    assert recall_at_precision(scores, torch.zeros_like(y)) == 0.0
    with pytest.raises(ValueError, match=r"scores \(5, 2\) and truth \(5, 1\)"):
        recall_at_precision(scores, y[:, :1])
    # probe_kinds' recall_top1 on two persons: naming one of two is half the row's recall
    got = probe_kinds(np.tile(np.eye(2, dtype=np.float32), (50, 1)), [["person=alice"], ["person=bruno"]] * 50,
                      np.eye(2, dtype=np.float32), [["person=alice", "person=bruno"], ["person=bruno"]], kinds=("person",))
    assert got[0].top1 == pytest.approx(1.0) and got[0].recall_top1 == pytest.approx(0.75)


def test_only_present_rows_count_and_absent_kinds_are_skipped():
    rng = np.random.default_rng(1)
    d = 16
    beach = rng.standard_normal(d)
    # place=beach planted on half the rows; the other half has no place at all.
    x = rng.standard_normal((400, d)).astype(np.float32) * 0.1
    facts = [["place=beach"] if i % 2 == 0 else [] for i in range(400)]
    x[::2] += beach
    got = probe_kinds(x[:300], facts[:300], x[300:], facts[300:], kinds=("place", "time"))
    assert [p.kind for p in got] == ["place"]  # no time fact anywhere: left out
    assert got[0].n_rows == 50 and got[0].top1 == pytest.approx(1.0)
    assert got[0].chance == pytest.approx(1 / 12)


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="must match one to one"):
        probe_kinds(np.zeros((3, 4)), [[]] * 2, np.zeros((2, 4)), [[]] * 2)


def test_best_layer_and_table():
    r = [LayerProbe(0, (KindProbe("place", 12, 10, 0.2, 0.1),)), LayerProbe(1, (KindProbe("place", 12, 10, 0.9, 0.1),)),
         LayerProbe(2, (KindProbe("place", 12, 10, 0.9, 0.1),))]
    assert best_layer(r) == 1  # ties go to the earlier layer
    md = probe_table_markdown(r, chosen=1)
    assert "| 1 (chosen) | 0.90 | **0.900** | 0.100 |" in md
    with pytest.raises(ValueError, match="no probe results"):
        best_layer([])


def test_quotation_probe_reads_each_position_from_the_end():
    """The token read's word is planted in the vector, the word before it is not: quote[0] is read
    exactly, quote[1] at the commonest word's rate at most; chance is that commonest word's share."""
    rng = np.random.default_rng(3)
    words = ["sun", "moon", "sea", "hill"]
    dirs = {w: rng.standard_normal(12) for w in words}

    def rows(n):
        reads, x = [], []
        for i in range(n):
            before, last = words[i % 4], words[(i * 7 + i // 4) % 4]
            reads.append(f"The {before} {last}")
            x.append(dirs[last] + 0.05 * rng.standard_normal(12))
        return np.asarray(x, dtype=np.float32), reads

    x_tr, r_tr = rows(400)
    x_te, r_te = rows(200)
    got = {k.kind: k for k in probe_quotes(x_tr, r_tr, x_te, r_te)}
    assert set(got) == {"quote[0]", "quote[1]", "quote[2]"}
    assert got["quote[0]"].top1 == pytest.approx(1.0) and got["quote[0]"].n_facts == 4 and got["quote[0]"].n_rows == 200
    assert got["quote[2]"].top1 == pytest.approx(1.0) and got["quote[2]"].chance == pytest.approx(1.0)  # always "The"
    assert got["quote[1]"].chance == pytest.approx(0.25) and got["quote[1]"].top1 < 0.5
    # a text shorter than the position has no row there
    short = {k.kind: k for k in probe_quotes(x_tr, r_tr, x_te[:2], ["sun", "The moon"])}
    assert short["quote[1]"].n_rows == 1 and "quote[2]" not in short
    with pytest.raises(ValueError, match="must match one to one"):
        probe_quotes(x_tr, r_tr[:3], x_te, r_te)
    # quotation probes are shown beside the kinds, not in their mean
    layer = LayerProbe(2, (KindProbe("place", 12, 10, 0.9, 0.1),), tuple(got.values()))
    assert layer.mean_top1 == pytest.approx(0.9) and layer.to_dict()["quotes"][0]["kind"] == "quote[0]"
    md = probe_table_markdown([LayerProbe(1, (KindProbe("place", 12, 10, 0.5, 0.1),)), layer], chosen=2)
    assert "| layer | place | mean top-1 | chance | quote[0] | quote[1] | quote[2] |" in md
    assert "| 2 (chosen) | 0.90 | **0.900** | 0.100 | 1.00 |" in md
    assert "| 1 | 0.50 | **0.500** | 0.100 | – | – | – |" in md  # a layer not probed for the quotation


def test_vectors_are_the_block_outputs_datagen_reads_the_last_block_included(tiny_model_dir, tiny_tokenizer):
    """Blocks 0..L-2: HF's hidden_states[K+1], bit for bit; the last block: its raw output (what datagen
    extracts and the AR predicts), not hidden_states[-1], which has the final norm applied (issue 59: the
    layered pair's deepest block had no probe row)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nla.core.activations import sample_positions
    from nla.world.generator import generate_documents
    from nla.world.probe import collect_layer_vectors, probe_world_layers

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")))
    docs = generate_documents(0, 3)
    got, facts = collect_layer_vectors(model, tiny_tokenizer, docs, [0, 1, 2, 3], positions_per_doc=2, skip_first=1,
                                       max_len=32)
    assert {k: v.shape for k, v in got.items()} == {k: (6, 32) for k in range(4)} and len(facts) == 6
    enc = tiny_tokenizer([d.text for d in docs], truncation=True, max_length=32, padding=True, return_tensors="pt")
    with torch.no_grad():
        hs = model(**enc, output_hidden_states=True).hidden_states
    rows = [(j, int(enc["attention_mask"][j].nonzero()[p])) for j, d in enumerate(docs)
            for p in sample_positions(0, d.doc_id, int(enc["attention_mask"][j].sum()), 2, 1)]
    for k in range(3):
        want = np.stack([hs[k + 1][j, t].numpy() for j, t in rows])
        np.testing.assert_array_equal(got[k], want)  # the same values as the old hidden_states read
    normed = np.stack([hs[4][j, t].numpy() for j, t in rows])
    assert np.abs(got[3] - normed).max() > 0.1  # not the final norm's output
    final_norm = model.model.norm(torch.from_numpy(got[3])).detach().numpy()
    np.testing.assert_allclose(final_norm, normed, rtol=1e-5, atol=1e-5)  # but what the norm is applied to

    with pytest.raises(ValueError, match=r"expected blocks 0\.\.3 of this 4-block subject, found \[4\]"):
        probe_world_layers(tiny_model_dir("llama"), docs, docs, layers=[4])
