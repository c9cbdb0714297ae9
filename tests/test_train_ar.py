"""AR warm-start: step-0 value from a plain reference, overfitting, accumulation, resume, errors."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from train_helpers import dataset_sidecar, explanations, write_ar_dataset

from nla.core.reconstructor import Reconstructor, tokenize_ar_texts
from nla.core.sidecar import load_sidecar
from nla.core.vectors import fve, mse_nrm
from nla.train.ar import ARTrainError, train_ar
from nla.train.config import ARTrainConfig
from nla.train.optim import micro_batches
from nla.util.metrics import read_metrics

K = 1  # keep blocks 0..1 of the 4-block tiny llama


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


@pytest.fixture()
def ar_data(tmp_path, tiny_model_dir, tiny_tokenizer):
    base = tiny_model_dir("llama")
    side = dataset_sidecar(tiny_tokenizer, base, d_model=32, layer_index=K)
    vec = np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)
    return base, side, write_ar_dataset(tmp_path / "ar_sft.parquet", side, vec), vec


def _cfg(ds, out, **kw):
    base = dict(dataset=str(ds), out_dir=str(out), max_steps=4, batch_size=8, lr=3e-3, warmup_steps=1,
                log_every=1, eval_every=100, save_every=100, eval_fraction=0.25, tensorboard=False, progress=False)
    base.update(kw)
    return ARTrainConfig(**base)


def test_step0_fve_equals_reference_from_hidden_states(ar_data, tmp_path, tiny_tokenizer):
    base, side, ds, vec = ar_data
    from transformers import AutoModelForCausalLM

    # Plain reference: the identity head means the prediction is block K's output at the last
    # token, i.e. hidden_states[K+1] of the base model (K < last block, so no final norm), one row at a time.
    lm = AutoModelForCausalLM.from_pretrained(base).eval()
    texts = [side.ar_text(e) for e in explanations(16)]
    ref = []
    with torch.no_grad():
        for t in texts:
            ids = tiny_tokenizer(t, return_tensors="pt")["input_ids"]
            ref.append(lm(ids, output_hidden_states=True).hidden_states[K + 1][0, -1])
    ref = torch.stack(ref)
    gold = torch.from_numpy(vec)
    # All 16 rows in one batch and no eval split: the step-1 loss is computed before the update,
    # so it is the mean mse_nrm of the reference, and fve_nrm (train-set baseline) is fve(ref, gold).
    res = train_ar(_cfg(ds, tmp_path / "run", max_steps=1, batch_size=16, eval_fraction=0.0))
    rec = read_metrics(tmp_path / "run" / "ar.jsonl")[0]
    assert rec["loss"] == pytest.approx(float(mse_nrm(ref, gold, side.mse_scale_value()).mean()), rel=1e-4)
    assert rec["fve_nrm"] == pytest.approx(fve(ref, gold, side.mse_scale_value()), abs=1e-4)
    # the checkpoint is a loadable AR with an AR sidecar carrying provenance
    meta = load_sidecar(res.checkpoint_dir)
    assert meta.role == "ar" and meta.layer_index == K and meta.training["step"] == 1
    assert (res.checkpoint_dir / "train_config.yaml").is_file()
    Reconstructor.from_pretrained(res.checkpoint_dir)


def test_ar_overfits_tiny_set(ar_data, tmp_path):
    _, _, ds, _ = ar_data
    res = train_ar(_cfg(ds, tmp_path / "run", max_steps=150, warmup_steps=5, log_every=10, eval_every=75,
                        eval_fraction=0.0, batch_size=8))
    # measured: fve_nrm 0.99998 after 150 steps on 16 random vectors (starts below 0.5)
    assert res.metrics["fve_nrm"] > 0.99
    recs = read_metrics(tmp_path / "run" / "ar.jsonl")
    assert recs[0]["fve_nrm"] < 0.5
    assert (tmp_path / "run" / "ar_curves.png").is_file()


def test_accumulated_4x2_gradient_equals_batch_of_8(ar_data, tiny_tokenizer):
    base, side, _, vec = ar_data
    texts = [side.ar_text(e) for e in explanations(8)]
    texts[3] = side.ar_text("a red cat walks and sings about the river in the evening")  # uneven lengths -> padding
    gold = torch.from_numpy(vec[:8])
    scale = side.mse_scale_value()
    ar = Reconstructor.from_base(base, K)

    def loss_of(rows):
        enc = tokenize_ar_texts(tiny_tokenizer, [texts[i] for i in rows], 64)
        return mse_nrm(ar.predict(enc["input_ids"], enc["attention_mask"]), gold[rows], scale).mean()

    loss_of(list(range(8))).backward()
    full = {n: p.grad.clone() for n, p in ar.named_parameters() if p.grad is not None}
    ar.zero_grad()
    for sl, w in micro_batches(8, 2):
        (loss_of(list(range(8))[sl]) * w).backward()
    for n, p in ar.named_parameters():
        if n in full:
            torch.testing.assert_close(p.grad, full[n], rtol=1e-4, atol=1e-6)


def test_resume_equals_straight_run(ar_data, tmp_path):
    _, _, ds, _ = ar_data
    kw = dict(max_steps=6, batch_size=4, save_every=3, eval_every=3, eval_fraction=0.25, warmup_steps=2)
    straight = train_ar(_cfg(ds, tmp_path / "a", **kw))
    train_ar(_cfg(ds, tmp_path / "b", stop_after_steps=3, **kw))
    resumed = train_ar(_cfg(ds, tmp_path / "b", **kw), resume=True)
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "ar.jsonl")]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "ar.jsonl")]
    assert len(la) == 6
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-7)
    for f in ("model.safetensors", "value_head.safetensors"):
        wa, wb = load_file(straight.checkpoint_dir / f), load_file(resumed.checkpoint_dir / f)
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


def test_errors_before_training(ar_data, tmp_path, tiny_tokenizer):
    base, side, ds, vec = ar_data
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        train_ar(_cfg(tmp_path / "nope.parquet", tmp_path / "r", sidecar=str(ds) + ".nla_meta.yaml"))
    with pytest.raises(FileNotFoundError, match="--resume"):
        train_ar(_cfg(ds, tmp_path / "fresh"), resume=True)
    # sidecar claims d_model 64 while the model is 32 wide
    wide = dataset_sidecar(tiny_tokenizer, base, d_model=64, layer_index=K)
    ds64 = write_ar_dataset(tmp_path / "wide.parquet", wide, np.zeros((4, 64), np.float32) + 1)
    with pytest.raises(ARTrainError, match="d_model.*64.*32"):
        train_ar(_cfg(ds64, tmp_path / "r64"))
    # prompts without the AR suffix: the first batch check names the row and the expected ids
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(ds)
    t = t.set_column(t.column_names.index("prompt"), "prompt", pa.array(["cat walks"] * t.num_rows))
    bad = tmp_path / "nosuffix.parquet"
    pq.write_table(t, bad)
    (tmp_path / "nosuffix.parquet.nla_meta.yaml").write_text((tmp_path / "ar_sft.parquet.nla_meta.yaml").read_text())
    with pytest.raises(ARTrainError, match=r"critic_suffix_ids: training row \d+ ends in"):
        train_ar(_cfg(bad, tmp_path / "rbad"))
    with pytest.raises(ARTrainError, match="base_model"):
        train_ar(_cfg(ds, tmp_path / "nob", sidecar=None).replace(base_model=None).replace(
            sidecar=str(_strip_base(tmp_path, side))))


def _strip_base(tmp_path, side):
    from nla.core.sidecar import write_sidecar

    path = tmp_path / "nobase.nla_meta.yaml"
    write_sidecar(path, side.replace(base_model=None))
    return path


def test_eval_dataset_without_text_column_is_named(ar_data, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nla.datagen.io import vectors_to_arrow

    _, _, ds, vec = ar_data
    rl_like = tmp_path / "rl.parquet"  # vectors only, like an RL split
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vec)}), rl_like)
    with pytest.raises(ARTrainError, match="eval_dataset .*column 'prompt' missing"):
        train_ar(_cfg(ds, tmp_path / "run", eval_dataset=str(rl_like)))


def test_gradient_checkpointing_trains_the_same_ar(ar_data, tmp_path, monkeypatch):
    # `gradient_checkpointing: true` recomputes the blocks in backward (each block's forward runs
    # under torch's checkpoint, counted here): the same weights and losses after 4 steps
    import transformers.modeling_utils as mu

    _, _, ds, _ = ar_data
    kw = dict(micro_batch_size=4)
    calls = []
    real = mu.checkpoint
    monkeypatch.setattr(mu, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = train_ar(_cfg(ds, tmp_path / "a", **kw))
    assert not calls
    ckpt = train_ar(_cfg(ds, tmp_path / "b", gradient_checkpointing=True, **kw))
    # steps x micro-batches x blocks 0..K-1 (block K runs at the read token only, as it is: _predict_last_block)
    assert len(calls) == 4 * 2 * K
    for f in ("model.safetensors", "value_head.safetensors"):
        a, b = (load_file(r.checkpoint_dir / f) for r in (plain, ckpt))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    la, lb = ([r["loss"] for r in read_metrics(tmp_path / d / "ar.jsonl")] for d in ("a", "b"))
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-7)


def test_shuffle_sentences_reads_each_rows_claims_in_its_own_order(ar_data, tmp_path, tiny_tokenizer):
    """shuffle_sentences: the step-1 loss is that of a plain reference reading each row's sentences in
    the order shuffle_sentences draws from (seed, doc_id, position 0); the as-written texts give another."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from nla.core.graders import shuffle_sentences, split_sentences

    base, side, ds, vec = ar_data
    t = pq.read_table(ds)
    expl = [f"{e}. The mood is calm. It is late." for e in explanations(16)]
    t = t.set_column(t.column_names.index("explanation"), "explanation", pa.array(expl))
    t = t.set_column(t.column_names.index("prompt"), "prompt", pa.array([side.ar_text(e) for e in expl]))
    multi = tmp_path / "multi.parquet"
    pq.write_table(t, multi)
    (tmp_path / "multi.parquet.nla_meta.yaml").write_text((tmp_path / "ar_sft.parquet.nla_meta.yaml").read_text())
    shuffled = [shuffle_sentences(e, np.random.default_rng([5, d, 0])) for d, e in enumerate(expl)]
    assert sum(s != e for s, e in zip(shuffled, expl, strict=True)) >= 8  # most rows read in another order
    assert all(sorted(split_sentences(s)) == sorted(split_sentences(e)) for s, e in zip(shuffled, expl, strict=True))
    lm = AutoModelForCausalLM.from_pretrained(base).eval()

    def reference_loss(texts):
        with torch.no_grad():
            ref = torch.stack([lm(tiny_tokenizer(side.ar_text(x), return_tensors="pt")["input_ids"],
                                  output_hidden_states=True).hidden_states[K + 1][0, -1] for x in texts])
        return float(mse_nrm(ref, torch.from_numpy(vec), side.mse_scale_value()).mean())

    train_ar(_cfg(multi, tmp_path / "run", max_steps=1, batch_size=16, eval_fraction=0.0, seed=5,
                  shuffle_sentences=True))
    loss = read_metrics(tmp_path / "run" / "ar.jsonl")[0]["loss"]
    assert loss == pytest.approx(reference_loss(shuffled), rel=1e-4)
    assert loss != pytest.approx(reference_loss(expl), rel=1e-4)
    # without an explanation column there is nothing to re-order: named, before training
    pq.write_table(t.drop(["explanation"]), multi)
    with pytest.raises(ARTrainError, match="shuffle_sentences: .* no 'explanation' column"):
        train_ar(_cfg(multi, tmp_path / "run2", shuffle_sentences=True))
    with pytest.raises(ValueError, match="shuffle_sentences"):
        _cfg(ds, tmp_path / "r", shuffle_sentences="yes")
