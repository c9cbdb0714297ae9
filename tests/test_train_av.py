"""AV warm-start: batch layout by hand, padding invariance, the vector-use gap, errors."""

import math

import numpy as np
import pytest
import torch
from train_helpers import dataset_sidecar, write_av_dataset

from nla.core.injection import InjectionHook
from nla.core.sidecar import load_sidecar
from nla.train.av import (
    IGNORE_INDEX,
    AVExample,
    AVTrainError,
    build_examples,
    collate,
    shared_prompt_head,
    smoke_flags,
    token_losses,
    train_av,
)
from nla.train.config import AVTrainConfig
from nla.util.metrics import read_metrics

WORDS = ["cat", "dog", "bird", "fish"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


def test_collate_by_hand():
    a = AVExample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 3])
    b = AVExample(prompt_ids=[5, 6], response_ids=[8, 3])
    r = collate([a, b], pad_id=0, padding_side="right")
    assert r.input_ids.tolist() == [[5, 6, 7, 8, 9, 3], [5, 6, 8, 3, 0, 0]]
    assert r.labels.tolist() == [[-100, -100, -100, 8, 9, 3], [-100, -100, 8, 3, -100, -100]]
    assert r.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 3, 3]]
    left = collate([a, b], pad_id=0, padding_side="left")
    assert left.input_ids.tolist() == [[5, 6, 7, 8, 9, 3], [0, 0, 5, 6, 8, 3]]
    assert left.labels.tolist() == [[-100, -100, -100, 8, 9, 3], [-100, -100, -100, -100, 8, 3]]
    assert left.attention_mask.tolist() == [[1] * 6, [0, 0, 1, 1, 1, 1]]
    assert left.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]]


def test_examples_prompt_from_chat_template(tiny_tokenizer, tiny_model_dir):
    side = dataset_sidecar(tiny_tokenizer, tiny_model_dir("llama"), 32, 1, injection_scale=5.0)
    msgs = [{"role": "user", "content": "Explain the hidden state << <INJECT> >> in a few short sentences ."}]
    ex = build_examples(tiny_tokenizer, [msgs], ["<explanation>\ncat\n</explanation>"], side.injection_char, 64)[0]
    assert ex.prompt_ids.count(side.injection_token_id) == 1
    assert ex.prompt_ids[-1] == tiny_tokenizer.convert_tokens_to_ids("<|assistant|>")  # generation prompt on
    assert ex.response_ids[-1] == tiny_tokenizer.eos_token_id
    # a tight max_length cuts the response, never the prompt (the marker must survive)
    short = build_examples(tiny_tokenizer, [msgs], ["<explanation>\ncat dog bird\n</explanation>"],
                           side.injection_char, len(ex.prompt_ids) + 2)[0]
    assert short.prompt_ids == ex.prompt_ids and len(short.response_ids) == 2
    with pytest.raises(AVTrainError, match="max_length"):
        build_examples(tiny_tokenizer, [msgs], ["x"], side.injection_char, 4)


def test_cut_responses_are_named_with_the_length_that_keeps_them(tiny_tokenizer, tiny_model_dir, caplog):
    """train av cut long responses, losing their EOS and closing tag, without a word (issue 58)."""
    side = dataset_sidecar(tiny_tokenizer, tiny_model_dir("llama"), 32, 1, injection_scale=5.0)
    msgs = [{"role": "user", "content": "Explain the hidden state << <INJECT> >> in a few short sentences ."}]
    texts = ["<explanation>\ncat\n</explanation>", "<explanation>\ncat dog bird cat dog bird\n</explanation>"]
    whole = build_examples(tiny_tokenizer, [msgs] * 2, texts, side.injection_char, 512)
    need = [len(e.prompt_ids) + len(e.response_ids) for e in whole]
    assert need[1] > need[0]
    with caplog.at_level("WARNING", logger="nla.train.av"):
        build_examples(tiny_tokenizer, [msgs] * 2, texts, side.injection_char, need[0], "training split")
    assert (f"max_length: 1 of 2 rows of the training split are longer than max_length {need[0]} (prompt + response "
            f"+ EOS; row 1 needs {need[1]} tokens): their responses are cut, losing the closing tag and the EOS") \
        in caplog.text
    assert f"raise max_length to {need[1]} to keep every row whole" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="nla.train.av"):
        build_examples(tiny_tokenizer, [msgs] * 2, texts, side.injection_char, need[1])
    assert "max_length" not in caplog.text


def test_left_and_right_padding_give_same_loss(tiny_tokenizer, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = tiny_model_dir("llama")
    side = dataset_sidecar(tiny_tokenizer, base, 32, 1, injection_scale=5.0)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    msgs = [{"role": "user", "content": "Explain the hidden state << <INJECT> >> in a few short sentences ."}]
    ex = build_examples(tiny_tokenizer, [msgs] * 2, ["<explanation>\ncat\n</explanation>",
                                                     "<explanation>\nthe dog walks to the river\n</explanation>"],
                        side.injection_char, 64)
    hook = InjectionHook.from_config(model, side)
    v = torch.randn(2, 32)
    out = {}
    with torch.no_grad():
        for sidename in ("left", "right"):
            batch = collate(ex, tiny_tokenizer.pad_token_id, sidename)
            with hook.vectors(v):
                nll, m = token_losses(model, batch, torch.device("cpu"))
            out[sidename] = (nll * m).sum() / m.sum()
            assert int(m.sum()) == sum(len(e.response_ids) for e in ex)  # labels = response + EOS only
    torch.testing.assert_close(out["left"], out["right"], rtol=1e-5, atol=1e-6)


def test_the_warm_start_loss_at_a_large_vocabulary_equals_the_plain_one(tiny_tokenizer, tiny_model_dir, monkeypatch):
    # Above LOGPROB_CHUNK_ELEMENTS logits, the loss is read at the learned positions only, a row chunk
    # at a time (nla.core.logprobs): the same per-token losses and gradients as cross_entropy's.
    from transformers import AutoModelForCausalLM

    import nla.core.logprobs as L
    import nla.train.av as AV

    base = tiny_model_dir("llama")
    side = dataset_sidecar(tiny_tokenizer, base, 32, 1, injection_scale=5.0)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    msgs = [{"role": "user", "content": "Explain the hidden state << <INJECT> >> in a few short sentences ."}]
    ex = build_examples(tiny_tokenizer, [msgs] * 3, ["<explanation>\ncat\n</explanation>",
                                                     "<explanation>\nthe dog walks to the river\n</explanation>",
                                                     "<explanation>\nit is morning\n</explanation>"],
                        side.injection_char, 64)
    batch = collate(ex, tiny_tokenizer.pad_token_id, "right")
    hook = InjectionHook.from_config(model, side)
    v = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    out = {}
    for name, limit, chunk in (("plain", AV.LOGPROB_CHUNK_ELEMENTS, L.LOGPROB_CHUNK_ELEMENTS), ("chunked", 1, 7 * 200)):
        monkeypatch.setattr(AV, "LOGPROB_CHUNK_ELEMENTS", limit)
        monkeypatch.setattr(L, "LOGPROB_CHUNK_ELEMENTS", chunk)  # 7 rows of the tiny vocabulary a chunk
        model.zero_grad()
        with hook.vectors(v):
            nll, m = token_losses(model, batch, torch.device("cpu"))
        ((nll * m).sum() / m.sum()).backward()
        out[name] = (nll.detach(), m, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert model.config.vocab_size <= 200 and torch.equal(out["plain"][1], out["chunked"][1])
    torch.testing.assert_close(out["chunked"][0] * out["plain"][1], out["plain"][0] * out["plain"][1])
    for k, g in out["plain"][2].items():
        torch.testing.assert_close(out["chunked"][2][k], g, rtol=1e-4, atol=1e-6)


def test_shared_prompt_head_by_hand():
    """The common head of every prompt, stopping before the injection site's left neighbour."""
    inj, left = 9, 8
    rows = [AVExample([1, 2, 3, 4, 8, 9, 7, 5], [6]), AVExample([1, 2, 3, 4, 8, 9, 7, 5], [6, 6])]
    assert shared_prompt_head(rows, inj, left) == 4  # 1 2 3 4; the site "8 9" runs per row
    assert shared_prompt_head(rows + [AVExample([1, 2, 0, 4, 8, 9, 7, 5], [6])], inj, left) == 2
    assert shared_prompt_head(rows + [AVExample([1, 0, 3, 4, 8, 9, 7, 5], [6])], inj, left) == 0  # one token: off
    assert shared_prompt_head([AVExample([8, 9, 7], [6])], inj, left) == 0  # the site opens the prompt
    assert shared_prompt_head([], inj, left) == 0


def test_the_shared_prompt_head_gives_the_plain_loss_and_gradients(tiny_tokenizer, tiny_model_dir):
    """share_prompt_head: the head runs once, its cache repeated to the rows, the LM head on the
    response only; per-token losses and every gradient equal the per-row forward's."""
    from transformers import AutoModelForCausalLM

    base = tiny_model_dir("llama")
    side = dataset_sidecar(tiny_tokenizer, base, 32, 1, injection_scale=5.0)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    msgs = [{"role": "system", "content": "you are a cat . you are a dog ."},
            {"role": "user", "content": "Explain the hidden state << <INJECT> >> in a few short sentences ."}]
    ex = build_examples(tiny_tokenizer, [msgs] * 3, ["<explanation>\ncat\n</explanation>",
                                                     "<explanation>\nthe dog walks to the river\n</explanation>",
                                                     "<explanation>\nit is morning\n</explanation>"],
                        side.injection_char, 64)
    shared = shared_prompt_head(ex, side.injection_token_id, side.injection_left_neighbor_id)
    site = ex[0].prompt_ids.index(side.injection_token_id)
    assert shared == site - 1 and shared >= 8  # the system message and "Explain the hidden state"
    batch = collate(ex, tiny_tokenizer.pad_token_id, "right")
    hook = InjectionHook.from_config(model, side)
    v = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    out = {}
    for k in (0, shared):
        model.zero_grad()
        with hook.vectors(v):
            nll, m = token_losses(model, batch, torch.device("cpu"), k)
        assert hook.applied_forwards == 1  # the head holds no site; the rest of each row does
        ((nll * m).sum() / m.sum()).backward()
        out[k] = (nll.detach(), m, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.equal(out[0][1], out[shared][1])
    torch.testing.assert_close(out[shared][0] * out[0][1], out[0][0] * out[0][1], rtol=1e-5, atol=1e-6)
    assert out[0][2].keys() == out[shared][2].keys()
    for n, g in out[0][2].items():
        torch.testing.assert_close(out[shared][2][n], g, rtol=1e-4, atol=1e-6)


def test_share_prompt_head_trains_as_the_plain_way(tmp_path, tiny_tokenizer, tiny_model_dir, caplog):
    """The same run with and without share_prompt_head: the same losses step by step (float rounding
    apart); with left padding it is refused by name and the run trains the plain way."""
    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=5.0, n=24)
    kw = dict(max_steps=4, batch_size=4, eval_every=4, warmup_steps=1, log_every=1, smoke_num=0)
    with caplog.at_level("INFO", logger="nla.train.av"):
        train_av(_cfg(ds, tmp_path / "plain", **kw))
        train_av(_cfg(ds, tmp_path / "shared", share_prompt_head=True, **kw))
    assert "AV: the prompt's first" in caplog.text and "tokens run once per batch (share_prompt_head)" in caplog.text
    la = [r["loss"] for r in read_metrics(tmp_path / "plain" / "av.jsonl") if "loss" in r]
    lb = [r["loss"] for r in read_metrics(tmp_path / "shared" / "av.jsonl") if "loss" in r]
    assert len(la) == 4
    np.testing.assert_allclose(lb, la, rtol=1e-4)
    caplog.clear()
    with caplog.at_level("INFO", logger="nla.train.av"):
        train_av(_cfg(ds, tmp_path / "left", share_prompt_head=True, padding_side="left", **kw))
    assert "share_prompt_head is on but padding_side is left: every row runs its whole prompt" in caplog.text


def test_smoke_flags():
    assert smoke_flags("<explanation> a cat </explanation>", "㈎") == []
    assert smoke_flags("   ", "㈎") == ["empty"]
    assert smoke_flags("the ㈎ sign", "㈎") == ["marker"]
    assert smoke_flags("这是", "㈎") == ["cjk"]


def _av_data(tmp_path, tokenizer, base, injection_scale, n=48):
    side = dataset_sidecar(tokenizer, base, 32, 1, injection_scale=injection_scale)
    rng = np.random.default_rng(0)
    protos = rng.normal(size=(len(WORDS), 32))
    cls = np.arange(n) % len(WORDS)
    vec = (protos[cls] + 0.1 * rng.normal(size=(n, 32))).astype(np.float32)
    return write_av_dataset(tmp_path / "av_sft.parquet", side, vec, [f"the {WORDS[c]} is happy" for c in cls])


def _cfg(ds, out, **kw):
    base = dict(dataset=str(ds), out_dir=str(out), max_steps=120, batch_size=8, lr=3e-3, warmup_steps=5,
                log_every=10, eval_every=60, save_every=1000, eval_fraction=0.25, tensorboard=False,
                progress=False, smoke_num=2, smoke_max_new_tokens=12)
    base.update(kw)
    return AVTrainConfig(**base)


def test_vector_is_used_after_short_training(tmp_path, tiny_tokenizer, tiny_model_dir):
    # The response names one of four classes and only the injected vector tells which one,
    # so after training the held-out loss with real vectors must beat the loss with vectors
    # rolled across the eval batch.
    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=5.0)
    res = train_av(_cfg(ds, tmp_path / "run"))
    m = res.metrics
    # measured: eval_loss ~0.16 vs shuffled ~0.23 after 120 steps (per response token)
    assert m["eval_loss"] < m["eval_loss_shuffled"]
    assert m["eval_vector_gap"] > 0.02
    assert m["smoke_checked"] == 2 and m["smoke_flagged"] == 0
    meta = load_sidecar(res.checkpoint_dir)
    assert meta.role == "av" and meta.injection_scale == 5.0 and meta.training["step"] == 120
    assert (res.checkpoint_dir / "train_config.yaml").is_file()
    recs = read_metrics(tmp_path / "run" / "av.jsonl")
    assert recs[0]["loss"] > recs[-1]["loss"]


def test_injection_scale_required(tmp_path, tiny_tokenizer, tiny_model_dir):
    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=None, n=8)
    with pytest.raises(AVTrainError, match="injection_scale"):
        train_av(_cfg(ds, tmp_path / "run"))
    # the config may supply it instead
    res = train_av(_cfg(ds, tmp_path / "run2", max_steps=2, warmup_steps=1, injection_scale="sqrt_d_model", smoke_num=1))
    # written as the number it stands for (the published readers take float(injection_scale))
    written = load_sidecar(res.checkpoint_dir)
    assert written.injection_scale == math.sqrt(written.d_model)
    assert "sqrt_d_model" not in (res.checkpoint_dir / "nla_meta.yaml").read_text()


def test_missing_dataset_named(tmp_path, tiny_tokenizer, tiny_model_dir):
    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=5.0, n=8)
    with pytest.raises(FileNotFoundError, match="absent.parquet"):
        train_av(_cfg(tmp_path / "absent.parquet", tmp_path / "r", sidecar=str(ds) + ".nla_meta.yaml"))
    assert IGNORE_INDEX == -100


def test_mean_shift_augment_adds_a_multiple_of_the_mean_per_row(tmp_path, tiny_tokenizer, tiny_model_dir, monkeypatch):
    """Each training row's injected vector is v + a * mean(train vectors), |a| <= m, a new a per row."""
    from nla.train.ar import load_split

    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=5.0, n=24)
    cfg = _cfg(ds, tmp_path / "run", max_steps=3, batch_size=8, warmup_steps=0, eval_every=3,
               mean_shift_augment=0.5, smoke_num=0)
    _, train_vec, _, _ = load_split(cfg, "prompt")
    train = torch.from_numpy(train_vec).double()
    mean = train.mean(0)
    seen = []
    real = InjectionHook.vectors

    def spy(self, v):
        seen.append(v.detach().double().clone())
        return real(self, v)

    monkeypatch.setattr(InjectionHook, "vectors", spy)
    train_av(cfg)
    coeffs = []
    for v in torch.cat(seen[:3]):  # the three steps' micro-batches come before the evaluation's
        diff = v - train  # [rows, d]: v minus every training row
        a = diff @ mean / (mean @ mean)  # the multiple of the mean each row would need
        resid = (diff - a[:, None] * mean).abs().amax(1)
        row = int(resid.argmin())
        assert float(resid[row]) < 1e-4  # v is one training row plus a multiple of the mean
        assert abs(float(a[row])) <= 0.5 + 1e-6
        coeffs.append(round(float(a[row]), 6))
    assert len(coeffs) == 24 and len(set(coeffs)) == 24  # a fresh draw per row (and the draws are not all 0)
    with pytest.raises(ValueError, match="'mean_shift_augment': expected a number >= 0"):
        _cfg(ds, tmp_path / "bad", mean_shift_augment=-1)


def test_mean_shift_augment_resumes_exactly(tmp_path, tiny_tokenizer, tiny_model_dir):
    from safetensors.torch import load_file

    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=5.0, n=24)
    kw = dict(max_steps=6, batch_size=4, save_every=3, eval_every=3, warmup_steps=2, log_every=1,
              mean_shift_augment=1.0, smoke_num=0)
    straight = train_av(_cfg(ds, tmp_path / "a", **kw))
    train_av(_cfg(ds, tmp_path / "b", stop_after_steps=3, **kw))
    resumed = train_av(_cfg(ds, tmp_path / "b", **kw), resume=True)
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "av.jsonl") if "loss" in r]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "av.jsonl") if "loss" in r]
    assert len(la) == 6
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-7)
    wa = load_file(straight.checkpoint_dir / "model.safetensors")
    wb = load_file(resumed.checkpoint_dir / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


def test_mean_invariant_adapter_is_fitted_on_the_training_vectors(tmp_path, tiny_tokenizer, tiny_model_dir):
    """injection_adapter_mean_invariant: the adapter's view is fitted on the training split's raw
    vectors (direction of their mean, mean tangent, by a plain numpy reference), is saved with
    the AV and loads with it; it is never trained; without the affine adapter it is refused."""
    from nla.core.injection import ADAPTER_ATTR, load_av_model
    from nla.train.ar import load_split

    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=5.0, n=24)
    cfg = _cfg(ds, tmp_path / "run", max_steps=2, eval_every=2, warmup_steps=0, smoke_num=0,
               injection_adapter="affine", injection_adapter_mean_invariant=True)
    _, train_vec, _, _ = load_split(cfg, "prompt")
    v = train_vec.astype(np.float64) + 0.0
    m = v.mean(0) / np.linalg.norm(v.mean(0))
    along = v @ m
    tan = float(np.mean(along / np.linalg.norm(v - along[:, None] * m, axis=1)))
    res = train_av(cfg)
    side = load_sidecar(res.checkpoint_dir)
    assert side.injection_adapter["mean_invariant"] is True
    adapter = getattr(load_av_model(res.checkpoint_dir, side), ADAPTER_ATTR)
    np.testing.assert_allclose(adapter.mean_dir.numpy(), m, rtol=0, atol=1e-6)
    assert float(adapter.mean_tan) == pytest.approx(tan, rel=1e-6)
    assert [n for n, _ in adapter.named_parameters()] == ["proj.weight", "proj.bias"]
    with pytest.raises(ValueError, match="'injection_adapter_mean_invariant': expected false unless injection_adapter"):
        _cfg(ds, tmp_path / "bad", injection_adapter_mean_invariant=True)
    with pytest.raises(ValueError, match="'injection_adapter_mean_invariant': expected true or false"):
        _cfg(ds, tmp_path / "bad", injection_adapter="affine", injection_adapter_mean_invariant=1)


def test_injection_adapter_lr_scale_trains_the_adapter_in_its_own_group(tmp_path, tiny_tokenizer, tiny_model_dir):
    """injection_adapter_lr_scale=10: the adapter's AdamW group runs at 10x lr; 1 (the default) keeps
    the one group of the published recipe; a bad value names the field."""
    from nla.core.injection import ADAPTER_ATTR
    from nla.train import loop as common  # the loop builds the optimiser

    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=5.0, n=16)
    seen = []
    real = common.build_optimizer

    def spy(model, *a, **kw):
        opt = real(model, *a, **kw)
        seen.append((model, opt))
        return opt

    common.build_optimizer = spy
    try:
        kw = dict(max_steps=2, eval_every=2, warmup_steps=0, smoke_num=0, injection_adapter="affine", lr=1e-3)
        train_av(_cfg(ds, tmp_path / "scaled", injection_adapter_lr_scale=10.0, **kw))
        train_av(_cfg(ds, tmp_path / "plain", **kw))
    finally:
        common.build_optimizer = real
    (model, opt), (_, plain) = seen
    adapter_ids = {id(p) for p in getattr(model, ADAPTER_ATTR).parameters()}
    assert len(adapter_ids) == 2  # proj.weight, proj.bias
    assert len(opt.param_groups) == 2
    assert {id(p) for p in opt.param_groups[1]["params"]} == adapter_ids
    assert not adapter_ids & {id(p) for p in opt.param_groups[0]["params"]}
    # the schedule's initial lr of each group (warmup 0, cosine over 2 steps)
    assert [g["initial_lr"] for g in opt.param_groups] == [pytest.approx(1e-3), pytest.approx(1e-2)]
    assert len(plain.param_groups) == 1
    for bad in (0, -1.0, True, float("nan")):
        with pytest.raises(ValueError, match="'injection_adapter_lr_scale': expected a positive number"):
            _cfg(ds, tmp_path / "bad", injection_adapter_lr_scale=bad)
