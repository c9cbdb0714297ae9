"""NLAClient: verbalize statuses, reconstruct == Reconstructor.predict, score by hand, error paths.

The AV is the conftest tiny Llama, with explanation tags added to the tokenizer, trained for a
few steps to answer every injected vector with one fixed explanation, so generation really
completes; a copy with the EOS and ``<explanation>`` output rows swapped ends at once (failed).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from nla.client import NLAClient, NLAClientError, failed_mse, load_vectors
from nla.core.injection import InjectionHook
from nla.core.reconstructor import Reconstructor, tokenize_ar_texts
from nla.core.reward import FAILED_EXTRACTION_MSE
from nla.core.sidecar import NLAConfig, write_sidecar
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR
from nla.core.token_ids import canonical_av_prompt_ids

D = 32
FIXED_EXPLANATION = "Alice is in the garden in the morning"
RESPONSE = f"<explanation> {FIXED_EXPLANATION} </explanation>"


class Pair:
    """Paths and live objects of the tiny AV/AR pair."""

    def __init__(self, root: Path) -> None:
        torch.manual_seed(0)
        tok = build_tiny_tokenizer()
        tok.add_tokens(["<explanation>", "</explanation>"])
        side = NLAConfig.from_tokenizer(
            tok, kind="nla_model", role="av", d_model=D, layer_index=1, av_template=DEFAULT_AV_TEMPLATE,
            ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR, injection_scale="sqrt_d_model",
        )
        model = build_tiny_model("llama", tok)
        _train_fixed_response(model, tok, side)
        self.tok, self.side, self.av_model = tok, side, model
        self.av_dir = root / "av"
        model.save_pretrained(self.av_dir)
        tok.save_pretrained(self.av_dir)
        write_sidecar(self.av_dir / "nla_meta.yaml", side)
        self.ar_dir = root / "ar"
        ar = Reconstructor.from_base(model, 1, tokenizer=tok, sidecar=side)
        with torch.no_grad():  # a non-identity head, so the test sees that the saved head is used
            ar.value_head.weight.add_(0.1 * torch.randn(D, D))
        ar.save_pretrained(self.ar_dir)
        self.ar = ar.eval()


def _train_fixed_response(model, tok, side: NLAConfig, steps: int = 40) -> None:
    prompt = canonical_av_prompt_ids(tok, side.av_messages())
    seq = torch.tensor(prompt + tok.encode(RESPONSE, add_special_tokens=False) + [tok.eos_token_id])
    P = len(prompt)
    hook = InjectionHook.from_config(model, side)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = seq.expand(2, -1)
        with hook.vectors(torch.randn(2, D, generator=g)):
            logits = model(input_ids=x).logits[:, P - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, P:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    hook.remove()
    model.eval()


@pytest.fixture(scope="session")
def nla_pair(tmp_path_factory) -> Pair:
    return Pair(tmp_path_factory.mktemp("nla_pair"))


@pytest.fixture(scope="module")
def client(nla_pair) -> NLAClient:
    return NLAClient(nla_pair.av_dir, nla_pair.ar_dir, device="cpu")


def test_verbalize_completed_truncated_and_failed(nla_pair, client):
    v = torch.randn(3, D, generator=torch.Generator().manual_seed(0))
    out = client.verbalize(v, max_new_tokens=20, n_samples=2)
    assert [o.row for o in out] == [0, 0, 1, 1, 2, 2]
    assert {o.status for o in out} == {"completed"}
    assert all(o.explanation == FIXED_EXPLANATION for o in out)
    short = client.verbalize(v.numpy(), max_new_tokens=3)  # numpy input; 3 tokens cannot reach </explanation>
    assert [o.status for o in short] == ["truncated"] * 3 and all(o.explanation is None for o in short)
    # Swapping the output rows of EOS and <explanation> makes the first token EOS: ended, no tags.
    broken = copy.deepcopy(nla_pair.av_model)
    a, b = nla_pair.tok.convert_tokens_to_ids("<explanation>"), nla_pair.tok.eos_token_id
    with torch.no_grad():
        w = broken.lm_head.weight
        w[[a, b]] = w[[b, a]].clone()
    failed = NLAClient.from_models(broken, nla_pair.tok, nla_pair.side).verbalize(v[:2], max_new_tokens=20)
    assert [(o.status, o.text, o.explanation) for o in failed] == [("failed", "", None)] * 2


def test_verbalize_batches_match_one_batch(client):
    v = torch.randn(5, D, generator=torch.Generator().manual_seed(3))
    whole = client.verbalize(v, max_new_tokens=12, greedy=False, seed=7, batch_size=5)
    again = client.verbalize(v, max_new_tokens=12, greedy=False, seed=7, batch_size=5)
    assert [o.text for o in whole] == [o.text for o in again]  # seeded sampling is reproducible
    split = client.verbalize(v, max_new_tokens=12, batch_size=2)
    one = client.verbalize(v, max_new_tokens=12, batch_size=5)
    assert [(o.row, o.text) for o in split] == [(o.row, o.text) for o in one]


def test_reconstruct_equals_reconstructor_predict(nla_pair, client):
    texts = ["cat walks to the river", "Bob is happy", "the dog sleeps in the house at night"]
    got = client.reconstruct(texts, batch_size=2)
    enc = tokenize_ar_texts(nla_pair.tok, [nla_pair.side.ar_text(t) for t in texts], client.max_length)
    with torch.no_grad():
        ref = nla_pair.ar.predict(enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # One text at a time gives the same predictions (padding does not leak in).
    single = torch.cat([client.reconstruct([t]) for t in texts])
    torch.testing.assert_close(got, single, rtol=1e-4, atol=1e-5)


def test_score_by_hand_and_failed_rows(client):
    texts = ["cat walks", None, "Bob is happy"]
    gold = torch.randn(3, D, generator=torch.Generator().manual_seed(5)) * 7.0
    res = client.score(texts, gold)
    pred = client.reconstruct(["cat walks", "Bob is happy"])
    for k, i in enumerate((0, 2)):
        p, g = pred[k], gold[i]
        # mse_nrm by hand: both rescaled to sqrt(d), mean squared difference; cosine = p.g / |p||g|.
        ph, gh = p * (D**0.5 / p.norm()), g * (D**0.5 / g.norm())
        assert float(res.mse_nrm[i]) == pytest.approx(float(((ph - gh) ** 2).mean()), rel=1e-5)
        assert float(res.cosine[i]) == pytest.approx(float(p @ g / (p.norm() * g.norm())), rel=1e-5)
        assert float(res.mse_nrm[i]) == pytest.approx(2 * (1 - float(res.cosine[i])), rel=1e-4)
    assert res.failed.tolist() == [False, True, False]
    assert torch.isnan(res.mse_nrm[1]) and torch.isnan(res.predictions[1]).all()
    assert res.failure_rate == pytest.approx(1 / 3)
    # A failure counts as an orthogonal prediction at the AR's scale s: 2 s^2/d, = 2.0
    # (FAILED_EXTRACTION_MSE) at s = sqrt(d), whatever the gold: a zero or oddly scaled gold
    # must not make a failure cheaper.
    torch.testing.assert_close(failed_mse(gold, D**0.5), torch.full((3,), FAILED_EXTRACTION_MSE))
    odd = torch.stack([torch.zeros(D), 10 * gold[0], gold[1]])
    torch.testing.assert_close(failed_mse(odd, D**0.5), torch.full((3,), 2.0))
    torch.testing.assert_close(failed_mse(odd, 3.0), torch.full((3,), 2 * 9 / D))


def test_round_trip_scores_each_sample_against_its_vector(client):
    v = torch.randn(4, D, generator=torch.Generator().manual_seed(9))
    verbs, res = client.round_trip(v, max_new_tokens=20)
    direct = client.score([o.explanation for o in verbs], v)
    torch.testing.assert_close(res.mse_nrm, direct.mse_nrm)
    assert res.n == 4 and not res.failed.any()


def test_errors_name_the_problem(nla_pair, client, tmp_path):
    av_only = NLAClient(nla_pair.av_dir, device="cpu")
    with pytest.raises(NLAClientError, match="no reconstructor"):
        av_only.reconstruct(["x"])
    with pytest.raises(NLAClientError, match="no reconstructor"):
        av_only.score(["x"], torch.zeros(1, D))
    with pytest.raises(NLAClientError, match="no verbalizer"):
        NLAClient(None, nla_pair.ar_dir, device="cpu").verbalize(torch.zeros(1, D))
    with pytest.raises(NLAClientError, match=r"d=16 but the AV sidecar's d_model is 32"):
        client.verbalize(torch.zeros(2, 16))
    with pytest.raises(NLAClientError, match=r"d=16 but the AR sidecar's d_model is 32"):
        client.score(["a", "b"], torch.zeros(2, 16))
    with pytest.raises(NLAClientError, match="2 texts for 3 vectors"):
        client.score(["a", "b"], torch.ones(3, D))
    with pytest.raises(NLAClientError, match="text 1 is NoneType"):
        client.reconstruct(["a", None])
    with pytest.raises(NLAClientError, match="give an AV checkpoint"):
        NLAClient(None, None)
    bare = tmp_path / "bare_av"
    nla_pair.av_model.save_pretrained(bare)
    nla_pair.tok.save_pretrained(bare)
    with pytest.raises(FileNotFoundError, match="has no nla_meta.yaml"):
        NLAClient(bare, device="cpu")
    # An explicit sidecar wins over a missing (or the checkpoint's own) one.
    explicit = tmp_path / "side.yaml"
    write_sidecar(explicit, nla_pair.side)
    assert NLAClient(bare, sidecar=explicit, device="cpu").av_sidecar.injection_token_id == \
        nla_pair.side.injection_token_id
    wide = nla_pair.side.replace(d_model=16)
    with pytest.raises(NLAClientError, match="AV sidecar says 16 but the AV model has width 32"):
        NLAClient.from_models(nla_pair.av_model, nla_pair.tok, wide)
    with pytest.raises(NLAClientError, match="AV sidecar says 32 but the AR sidecar says 16"):
        NLAClient.from_models(nla_pair.av_model, nla_pair.tok, nla_pair.side, ar_sidecar=wide,
                              ar=_ar_with_width(16, nla_pair))


def _ar_with_width(d: int, nla_pair) -> Reconstructor:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=d, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(nla_pair.tok), max_position_embeddings=128)
    return Reconstructor.from_base(LlamaForCausalLM(cfg), 1, tokenizer=nla_pair.tok)


def test_load_vectors_npy_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nla.datagen.io import vectors_to_arrow

    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "v.npy", arr)
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(arr)}), tmp_path / "v.parquet")
    np.testing.assert_array_equal(load_vectors(tmp_path / "v.npy"), arr)
    np.testing.assert_array_equal(load_vectors(tmp_path / "v.parquet", rows=2), arr[:2])
    (tmp_path / "v.txt").write_text("1 2")
    with pytest.raises(NLAClientError, match="expected a .parquet or .npy"):
        load_vectors(tmp_path / "v.txt")
    np.save(tmp_path / "flat.npy", arr.reshape(-1))
    with pytest.raises(NLAClientError, match=r"shape \(12,\), expected \[N, d\]"):
        load_vectors(tmp_path / "flat.npy")


# --- the published sidecar layouts, on real (tiny) checkpoints -------------------------------------
FIXTURES = Path(__file__).parent / "fixtures"


def _documented_layout(fixture: str, values: dict) -> dict:
    """The fixture's document with its values replaced by this pair's (ids, widths), key for key."""
    import yaml

    doc = yaml.safe_load((FIXTURES / fixture).read_text())

    def fill(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                fill(value, f"{prefix}{key}.")
            else:
                node[key] = values.pop(f"{prefix}{key}", value)

    fill(doc, "")
    assert not values, f"keys not in the documented layout: {values}"
    return doc


def _copy_checkpoint(src: Path, dst: Path, doc: dict) -> Path:
    import shutil

    import yaml

    shutil.copytree(src, dst)
    (dst / "nla_meta.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True))
    return dst


def test_documented_av_layout_verbalizes_like_the_full_sidecar(nla_pair, client, tmp_path):
    s = nla_pair.side
    doc = _documented_layout("published_av.nla_meta.yaml", {
        "d_model": D, "extraction.injection_scale": s.injection_scale, "tokens.injection_token_id": s.injection_token_id,
        "tokens.injection_char": s.injection_char, "tokens.injection_left_neighbor_id": s.injection_left_neighbor_id,
        "tokens.injection_right_neighbor_id": s.injection_right_neighbor_id, "prompt_templates.av": s.av_template,
    })
    assert "layer_index" not in doc["extraction"] and "role" not in doc and "critic_suffix_ids" not in doc["tokens"]
    av = NLAClient(_copy_checkpoint(nla_pair.av_dir, tmp_path / "av", doc), device="cpu")
    assert av.av_sidecar.layer_index is None and av.av_sidecar.ar_template is None
    vectors = torch.randn(3, D, generator=torch.Generator().manual_seed(5))
    assert av.verbalize(vectors, max_new_tokens=20) == client.verbalize(vectors, max_new_tokens=20)
    # The documented tokenizer check still runs: a drifted neighbour id is named.
    doc["tokens"]["injection_left_neighbor_id"] += 1
    bad = _copy_checkpoint(nla_pair.av_dir, tmp_path / "av_bad", doc)
    with pytest.raises(ValueError, match="injection_left_neighbor_id: the sidecar records"):
        NLAClient(bad, device="cpu")


def test_documented_ar_layout_scores_like_the_full_sidecar(nla_pair, client, tmp_path):
    import json
    import math

    s = nla_pair.side
    values = {"d_model": D, "extraction.mse_scale": math.sqrt(D), "ar.num_hidden_layers": 1,
              "tokens.critic_suffix_ids": list(s.critic_suffix_ids), "prompt_templates.ar": s.ar_template}
    doc = _documented_layout("published_ar.nla_meta.yaml", dict(values))
    ar_dir = _copy_checkpoint(nla_pair.ar_dir, tmp_path / "ar", doc)
    assert json.loads((ar_dir / "config.json").read_text())["num_hidden_layers"] == 2  # K+1 blocks for K = 1
    ar = NLAClient(None, ar_dir, device="cpu")
    assert ar.ar_sidecar.layer_index == 1 and ar.ar_sidecar.injection_char is None
    texts, vectors = ["Alice is in the garden", None, "the dog runs"], torch.randn(3, D)
    got, want = ar.score(texts, vectors), client.score(texts, vectors)
    torch.testing.assert_close(got.mse_nrm, want.mse_nrm, equal_nan=True)
    # K+1 under ar.num_hidden_layers (the config's block count, not K) is an inconsistent checkpoint.
    doc = _documented_layout("published_ar.nla_meta.yaml", {**values, "ar.num_hidden_layers": 2})
    with pytest.raises(ValueError, match=r"records layer K = 2, so the AR should keep K\+1 = 3 blocks, but "
                                         r"config.json has 2"):
        NLAClient(None, _copy_checkpoint(nla_pair.ar_dir, tmp_path / "ar_bad", doc), device="cpu")


def test_roles_are_checked_not_warned_about(nla_pair, tmp_path):
    with pytest.raises(NLAClientError, match=r"av: .*/ar is an AR checkpoint \(role 'ar'\), not an AV; pass a "
                                             r"verbalizer checkpoint there"):
        NLAClient(nla_pair.ar_dir, device="cpu")
    with pytest.raises(NLAClientError, match=r"ar: .*/av is an AV checkpoint \(role 'av'\), not an AR"):
        NLAClient(None, nla_pair.av_dir, device="cpu")
    # Without a role, the value head tells an AR directory apart.
    import yaml

    doc = yaml.safe_load((nla_pair.ar_dir / "nla_meta.yaml").read_text())
    del doc["role"]
    no_role = _copy_checkpoint(nla_pair.ar_dir, tmp_path / "ar_no_role", doc)
    with pytest.raises(NLAClientError, match=r"is an AR checkpoint \(a value head\), not an AV"):
        NLAClient(no_role, device="cpu")
