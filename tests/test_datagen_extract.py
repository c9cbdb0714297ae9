"""Extract: vectors equal a direct forward pass, reruns/shards are identical, bad input fails cleanly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nla.core.activations import sample_positions
from nla.datagen.corpus import CorpusDoc, read_text_corpus
from nla.datagen.extract import (
    ACTIVATIONS_FILE,
    check_vectors,
    consolidate_shards,
    extract_activations,
)
from nla.datagen.io import DatagenError, read_parquet, read_vectors

SENTENCES = [
    "Alice walks to the market in the morning and she is happy .",
    "Bob reads a story about a cat .",
    "the dog runs to the river and the bird sings in the tree , it was a calm evening in the village .",
    "Carol cooks in the kitchen .",
    "Eve plays in the garden with a red fish and a blue bird at noon .",
    "Dave sleeps .",  # 3 tokens: only position 2 is past skip_first
    "they talk about the city and the forest and the school .",
]


def corpus(n: int = len(SENTENCES)) -> list[CorpusDoc]:
    # ids are not 0..n-1 on purpose: the RNG is keyed on doc_id, not on list order
    return [CorpusDoc(10 + 3 * i, SENTENCES[i % len(SENTENCES)]) for i in range(n)]


def run(model_dir, out, **kw):
    args = dict(layer_index=1, positions_per_doc=3, skip_first=2, seed=7, batch_size=3, max_len=64)
    args.update(kw)
    return extract_activations(model_dir, corpus(), out_dir=out, **args)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_vectors_equal_direct_forward(tiny_model_dir, tmp_path, arch):
    model_dir = tiny_model_dir(arch)
    res = run(model_dir, tmp_path, batches_per_shard=1)
    table = read_parquet(res.path)
    vecs = read_vectors(table)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    docs = {d.doc_id: d for d in corpus()}
    rows = table.select(["doc_id", "position", "n_raw_tokens", "context", "activation_layer"]).to_pylist()
    assert {r["activation_layer"] for r in rows} == {1}
    checked = 0
    for i, r in enumerate(rows):
        ids = tok(docs[r["doc_id"]].text)["input_ids"]
        assert r["n_raw_tokens"] == len(ids)
        with torch.no_grad():
            # one document alone, no padding: the reference the padded batch must match
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0]
        np.testing.assert_allclose(vecs[i], hs[r["position"]].numpy(), rtol=1e-5, atol=1e-5)
        assert 2 <= r["position"] < len(ids)
        assert r["context"].split()[-1] == tok.decode([ids[r["position"]]])
        checked += 1
    # 6 docs long enough x 3 positions; "Dave sleeps ." has 3 tokens -> only position 2 is available
    assert checked == 6 * 3 + 1 == res.n_rows
    assert res.dropped == {}


def test_last_layer_is_block_output_not_final_norm(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    res = run(model_dir, tmp_path, layer_index=3)
    table = read_parquet(res.path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    r = table.slice(0, 1).to_pylist()[0]
    ids = tok(corpus()[0].text)["input_ids"]
    captured = []
    h = model.model.layers[3].register_forward_hook(
        lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        model(torch.tensor([ids]))
    h.remove()
    np.testing.assert_allclose(
        read_vectors(table)[0], captured[0][0, r["position"]].numpy(), rtol=1e-5, atol=1e-5
    )


def test_rerun_and_sharded_run_identical(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    a = read_parquet(run(model_dir, tmp_path / "a", batches_per_shard=1).path)
    b = read_parquet(run(model_dir, tmp_path / "b", batches_per_shard=1).path)
    assert a.equals(b)
    for shard in (1, 0):  # out of order on purpose
        res = run(model_dir, tmp_path / "c", batches_per_shard=1, shard_index=shard, num_shards=2)
        assert res.path is None
    c = read_parquet(consolidate_shards(tmp_path / "c").path)
    assert a.equals(c)


def test_resume_skips_written_chunks(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    first = read_parquet(run(model_dir, tmp_path, batches_per_shard=1).path)
    part = tmp_path / "shards" / "part-000001.parquet"
    mtime = part.stat().st_mtime_ns
    (tmp_path / "shards" / "part-000002.parquet").unlink()
    (tmp_path / ACTIVATIONS_FILE).unlink()
    again = read_parquet(run(model_dir, tmp_path, batches_per_shard=1).path)
    assert part.stat().st_mtime_ns == mtime  # not recomputed
    assert first.equals(again)


def test_consolidate_refuses_missing_shard(tiny_model_dir, tmp_path):
    run(tiny_model_dir("llama"), tmp_path, batches_per_shard=1, shard_index=0, num_shards=2)
    with pytest.raises(DatagenError, match=r"chunks missing.*run the remaining extract shards"):
        consolidate_shards(tmp_path)
    assert not (tmp_path / ACTIVATIONS_FILE).exists()


def test_changed_settings_with_old_shards_refused(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    run(model_dir, tmp_path)
    with pytest.raises(DatagenError, match=r"different settings.*seed"):
        run(model_dir, tmp_path, seed=8)


def test_sample_positions_keyed_on_seed_and_doc():
    a = sample_positions(seed=1, doc_id=5, n_tokens=50, positions_per_doc=4, skip_first=3)
    assert np.array_equal(a, sample_positions(1, 5, 50, 4, 3))
    assert list(a) == sorted(a) and len(set(a)) == 4 and a.min() >= 3 and a.max() < 50
    assert not np.array_equal(a, sample_positions(1, 6, 50, 4, 3))
    # fewer candidates than requested: all of them
    assert list(sample_positions(1, 5, 6, 10, 3)) == [3, 4, 5]
    assert len(sample_positions(1, 5, 3, 10, 3)) == 0


def test_layer_out_of_range_names_valid_range(tiny_model_dir, tmp_path):
    with pytest.raises(
        DatagenError, match=r"layer_index 4 is out of range.*4 decoder blocks, valid range 0\.\.3"
    ):
        run(tiny_model_dir("gpt2"), tmp_path, layer_index=4)
    assert not (tmp_path / ACTIVATIONS_FILE).exists()


def test_empty_corpus(tiny_model_dir, tmp_path):
    with pytest.raises(DatagenError, match="corpus is empty"):
        extract_activations(tiny_model_dir("llama"), [], 1, 3, 2, 0, 2, tmp_path, 32)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(DatagenError, match="no non-empty documents"):
        read_text_corpus(empty)


def test_nan_model_errors_with_row_and_leaves_nothing(tiny_model_dir, tmp_path):
    # Finite weights whose products overflow: the activations go inf/NaN (NaN weights themselves
    # are refused at load, before any extraction: tests/test_validation.py).
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.fill_(1e30)
        model.model.layers[0].mlp.down_proj.weight.fill_(1e30)
    bad_dir = tmp_path / "nan_model"
    model.save_pretrained(bad_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir("llama")).save_pretrained(bad_dir)
    with pytest.raises(DatagenError, match=r"doc_id 10 position \d+ has NaN/inf.*bad_vectors: drop"):
        run(bad_dir, tmp_path / "out")
    assert not (tmp_path / "out" / ACTIVATIONS_FILE).exists()
    assert not list((tmp_path / "out" / "shards").glob("part-*.parquet"))
    # drop policy: every row is bad -> counted, and an empty result is itself an error
    with pytest.raises(DatagenError, match=r"no rows.*non_finite_vector"):
        run(bad_dir, tmp_path / "out2", bad_vectors="drop")


def test_check_vectors_drop_counts():
    v = np.array([[1, 0], [np.nan, 1], [0, 0], [np.inf, 0], [0, 2]], dtype=np.float32)
    keep, counts = check_vectors(v, np.arange(5), np.arange(5) * 10, "drop")
    assert keep.tolist() == [True, False, False, False, True]
    assert counts == {"non_finite_vector": 2, "zero_norm_vector": 1}
    with pytest.raises(DatagenError, match=r"doc_id 2 position 20 has zero norm"):
        check_vectors(v[[0, 2]], np.array([1, 2]), np.array([10, 20]), "error")


def test_text_corpus_formats(tmp_path):
    (tmp_path / "p.txt").write_text("a b\nc d\n\n\ne f\n")
    assert [d.text for d in read_text_corpus(tmp_path / "p.txt")] == ["a b c d", "e f"]
    (tmp_path / "l.txt").write_text("one\ntwo\n")
    assert [(d.doc_id, d.text) for d in read_text_corpus(tmp_path / "l.txt")] == [(0, "one"), (1, "two")]
    (tmp_path / "c.jsonl").write_text('{"body": "x y"}\n\n{"body": "z"}\n')
    assert [d.text for d in read_text_corpus(tmp_path / "c.jsonl", text_column="body")] == ["x y", "z"]
    with pytest.raises(DatagenError, match=r"c.jsonl:1: expected an object with a string field 'text'"):
        read_text_corpus(tmp_path / "c.jsonl")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"t": ["u", "v"]}), tmp_path / "c.parquet")
    assert [d.text for d in read_text_corpus(tmp_path / "c.parquet", text_column="t")] == ["u", "v"]
    with pytest.raises(DatagenError, match=r"no column 'text'.*found \['t'\]"):
        read_text_corpus(tmp_path / "c.parquet")
