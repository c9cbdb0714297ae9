"""Explain one model with another (nla.core.injection.InjectionAdapter; the AR's head to the subject's
width): the adapter's start by hand, the hook's injection against W v + b, the sidecar round trip,
and a tiny cross-model pair (a 32-wide AV/AR reading the 64-wide tiny world subject's vectors)
trained end to end: warm-starts, RL, NLAClient, a wrong-width vector refused."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_rl_loop import WORDS, _class_vectors
from train_helpers import dataset_sidecar, write_av_dataset

from nla.core.injection import (
    ADAPTER_FILE,
    InjectionAdapter,
    InjectionHook,
    adapter_init,
    attach_adapter,
    get_adapter,
    load_adapter_file,
)
from nla.core.sidecar import load_sidecar, write_sidecar
from nla.core.sidecar_errors import SidecarError
from nla.datagen.io import vectors_to_arrow
from nla.train.ar import ARTrainError, train_ar
from nla.train.av import AVTrainError, train_av
from nla.train.config import ARTrainConfig, AVTrainConfig

D_SUBJECT, D_PAIR = 64, 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


def test_adapter_start_by_hand():
    torch.testing.assert_close(adapter_init(5, 5), torch.eye(5), rtol=0, atol=0)
    narrow = adapter_init(8, 4, seed=3)  # rows orthonormal, times sqrt(8 / 4)
    assert narrow.shape == (4, 8)
    torch.testing.assert_close(narrow @ narrow.T, 2.0 * torch.eye(4), rtol=0, atol=1e-5)
    wide = adapter_init(4, 8, seed=3)  # columns orthonormal: every vector keeps its norm exactly
    assert wide.shape == (8, 4)
    torch.testing.assert_close(wide.T @ wide, torch.eye(4), rtol=0, atol=1e-5)
    torch.testing.assert_close(adapter_init(8, 4, seed=3), narrow, rtol=0, atol=0)  # seeded
    a = InjectionAdapter(6, 6)
    v = torch.randn(3, 6)
    torch.testing.assert_close(a(v), v, rtol=0, atol=0)  # same width: starts as the fixed-scale injection
    with pytest.raises(ValueError, match="vectors of width 5, expected 6"):
        a(torch.randn(2, 5))


def test_adapter_fit_recovers_an_affine_map():
    g = torch.Generator().manual_seed(1)
    a, c = torch.randn(6, 10, generator=g), torch.randn(6, generator=g)
    src = torch.randn(300, 10, generator=g)
    adapter = InjectionAdapter(10, 6)
    r2 = adapter.fit(src, src @ a.T + c, ridge=1e-12)
    assert r2 == pytest.approx(1.0, abs=1e-9)
    torch.testing.assert_close(adapter.proj.weight, a, rtol=0, atol=1e-5)
    torch.testing.assert_close(adapter.proj.bias, c, rtol=0, atol=1e-5)
    noisy = adapter.fit(src, torch.randn(300, 6, generator=g), ridge=1e-12)
    assert noisy < 0.1  # unrelated targets: little explained


def test_mean_invariant_view_by_hand(tmp_path):
    """Training vectors (3, 1, 0) and (1, -1, 0): mean (2, 0, 0), direction m = e1, components
    along m 3 and 1 over perpendicular norms 1 and 1, so the typical tangent is 2. Then
    x = (5, 0, 4) reads as |x| u / |u| with u = (0, 0, 4) / 4 + 2 m = (2, 0, 1)."""
    a = InjectionAdapter(3, 3, mean_invariant=True)
    assert a.set_mean(torch.tensor([[3.0, 1.0, 0.0], [1.0, -1.0, 0.0]])) == pytest.approx(2.0)
    torch.testing.assert_close(a.mean_dir, torch.tensor([1.0, 0.0, 0.0]), rtol=0, atol=0)
    x = torch.tensor([[5.0, 0.0, 4.0]])
    want = math.sqrt(41.0) / math.sqrt(5.0) * torch.tensor([[2.0, 0.0, 1.0]])
    torch.testing.assert_close(a.canonical(x), want, rtol=1e-6, atol=1e-6)
    # starts at the identity on its view: W = I, b = 0
    torch.testing.assert_close(a(x), want, rtol=1e-6, atol=1e-6)
    # what the hook hands it is the vector at the injection norm: shifted along the mean (a
    # difference of means, an offset added again) or rescaled, it reads the same
    at = lambda v: 3.0 * v / v.norm(dim=-1, keepdim=True)  # noqa: E731
    mean = torch.tensor([2.0, 0.0, 0.0])
    for shifted in (x - mean, x + mean, x + 7 * mean, 0.25 * x, 4 * x):
        torch.testing.assert_close(a(at(shifted)), a(at(x)), rtol=1e-6, atol=1e-6)
    plain = InjectionAdapter(3, 3)
    assert not torch.allclose(plain(at(x - mean)), plain(at(x)))  # the plain adapter does not
    with pytest.raises(ValueError, match="built without mean_invariant"):
        plain.set_mean(x)
    with pytest.raises(ValueError, match="mean is zero"):
        InjectionAdapter(3, 3, mean_invariant=True).set_mean(torch.tensor([[1.0, 0, 0], [-1.0, 0, 0]]))


def test_conformal_adapter_by_hand():
    """conformal: W = exp(log_gain) * matrix_exp(U - U^T). With U's one entry theta at (0, 1) and
    log_gain = log 2, W = 2 [[cos theta, sin theta], [-sin theta, cos theta]] on those two
    coordinates and 2 on the third. It starts at W = I; trained towards an anisotropic map it stays
    a gain times a rotation (W^T W = g^2 I); unequal widths and the ridge fit are refused."""
    a = InjectionAdapter(3, 3, conformal=True)
    torch.testing.assert_close(a.proj.weight, torch.eye(3), rtol=0, atol=0)
    assert sorted(a.state_dict()) == ["proj.bias", "proj.parametrizations.weight.0.log_gain",
                                      "proj.parametrizations.weight.original"]
    theta = 0.3
    with torch.no_grad():
        a.proj.parametrizations.weight.original.copy_(torch.tensor([[5.0, theta, 0.0], [7.0, 1.0, 0.0],
                                                                    [-2.0, 9.0, 1.0]]))  # only U counts
        a.proj.parametrizations.weight[0].log_gain.fill_(math.log(2.0))
    c, s_ = math.cos(theta), math.sin(theta)
    want = 2.0 * torch.tensor([[c, s_, 0.0], [-s_, c, 0.0], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(a.proj.weight, want, rtol=0, atol=2e-5)  # matrix_exp in float32
    torch.testing.assert_close(a(torch.tensor([[1.0, 0.0, 3.0]])), torch.tensor([[2 * c, -2 * s_, 6.0]]),
                               rtol=0, atol=5e-5)

    b = InjectionAdapter(4, 4, conformal=True)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(32, 4, generator=g)
    target = v @ torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # amplifies one direction over another
    opt = torch.optim.AdamW(b.parameters(), lr=0.05)
    for _ in range(50):
        loss = ((b(v) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = b.proj.weight.detach()
    gain2 = float((w.T @ w)[0, 0])
    assert gain2 > 1.5  # it learned (a gain of about the target's mean scale)
    torch.testing.assert_close(w.T @ w, gain2 * torch.eye(4), rtol=0, atol=1e-4 * gain2)
    free = InjectionAdapter(4, 4)
    free.fit(v, target, ridge=1e-12)
    wf = free.proj.weight.detach()
    assert float((wf.T @ wf - (wf.T @ wf)[0, 0] * torch.eye(4)).abs().max()) > 1.0  # the free map is not

    with pytest.raises(ValueError, match="conformal needs equal widths .* d_in 4 and d_out 3"):
        InjectionAdapter(4, 3, conformal=True)
    with pytest.raises(ValueError, match="a conformal adapter is a gain times a rotation"):
        b.fit(v, target)


def test_conformal_file_round_trip(tmp_path, tiny_tokenizer, tiny_model_dir):
    """The sidecar says conformal: true, the file holds the stored matrix and the gain, and the
    loaded adapter maps like the saved one; a plain file, a bad flag and unequal widths are refused."""
    from safetensors.torch import save_file

    from nla.core.injection import save_adapter_file

    a = InjectionAdapter(10, 10, conformal=True, mean_invariant=True)
    g = torch.Generator().manual_seed(3)
    src = torch.randn(50, 10, generator=g) + 2.0
    a.set_mean(src)
    with torch.no_grad():
        a.proj.parametrizations.weight.original.copy_(torch.randn(10, 10, generator=g))
        a.proj.parametrizations.weight[0].log_gain.fill_(0.4)
        a.proj.bias.copy_(torch.randn(10, generator=g))
    side = dataset_sidecar(tiny_tokenizer, tiny_model_dir("llama"), 10, 1, injection_scale=3.0).replace(
        kind="nla_model", role="av", model_width=10, injection_adapter=a.describe())
    assert a.describe() == {"kind": "affine", "d_in": 10, "d_out": 10, "file": ADAPTER_FILE, "mean_invariant": True,
                            "conformal": True}
    write_sidecar(tmp_path, side)
    assert "  conformal: true" in (tmp_path / "nla_meta.yaml").read_text()
    save_adapter_file(a.state_dict(), tmp_path)
    back = load_adapter_file(tmp_path, load_sidecar(tmp_path))
    assert back.conformal and back.mean_invariant
    torch.testing.assert_close(back(src[:5]), a(src[:5]), rtol=0, atol=0)
    w = back.proj.weight.detach()
    torch.testing.assert_close(w.T @ w, math.exp(0.8) * torch.eye(10), rtol=0, atol=1e-5)
    plain = InjectionAdapter(10, 10, mean_invariant=True)
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(tmp_path / ADAPTER_FILE))
    with pytest.raises(ValueError, match="conformal True\\); the file does not belong to this sidecar"):
        load_adapter_file(tmp_path, load_sidecar(tmp_path))
    text = (tmp_path / "nla_meta.yaml").read_text()
    (tmp_path / "nla_meta.yaml").write_text(text.replace("conformal: true", "conformal: 1"))
    with pytest.raises(SidecarError, match="injection_adapter.conformal: expected true or false"):
        load_sidecar(tmp_path)
    (tmp_path / "nla_meta.yaml").write_text(text.replace("d_out: 10", "d_out: 8").replace("hidden_size: 10",
                                                                                          "hidden_size: 8"))
    with pytest.raises(SidecarError, match="conformal: true needs d_in == d_out"):
        load_sidecar(tmp_path)


def test_mean_invariant_fit_and_file_round_trip(tmp_path, tiny_tokenizer, tiny_model_dir):
    """The ridge start is fitted on the adapter's view of the source; the file holds the fitted
    mean with the weights and the sidecar says so; a file without them is refused."""
    from safetensors.torch import save_file

    from nla.core.injection import save_adapter_file

    g = torch.Generator().manual_seed(2)
    src = torch.randn(300, 10, generator=g) + 4.0
    a = InjectionAdapter(10, 6, mean_invariant=True)
    a.set_mean(src)
    w, c = torch.randn(6, 10, generator=g), torch.randn(6, generator=g)
    assert a.fit(src, a.canonical(src) @ w.T + c, ridge=1e-12) == pytest.approx(1.0, abs=1e-9)
    torch.testing.assert_close(a(src), a.canonical(src) @ w.T + c, rtol=0, atol=1e-4)
    side = dataset_sidecar(tiny_tokenizer, tiny_model_dir("llama"), 10, 1, injection_scale=3.0).replace(
        kind="nla_model", role="av", model_width=6, injection_adapter=a.describe())
    assert a.describe()["mean_invariant"] is True
    write_sidecar(tmp_path, side)
    assert "  mean_invariant: true" in (tmp_path / "nla_meta.yaml").read_text()
    save_adapter_file(a.state_dict(), tmp_path)
    back = load_adapter_file(tmp_path, load_sidecar(tmp_path))
    assert back.mean_invariant
    for k, v in a.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)
    torch.testing.assert_close(back(src[:5]), a(src[:5]), rtol=0, atol=0)
    save_file({k: v.contiguous() for k, v in a.proj.state_dict().items()}, str(tmp_path / ADAPTER_FILE))
    with pytest.raises(ValueError, match="mean_invariant True.*does not belong to this sidecar"):
        load_adapter_file(tmp_path, load_sidecar(tmp_path))
    text = (tmp_path / "nla_meta.yaml").read_text()
    (tmp_path / "nla_meta.yaml").write_text(text.replace("mean_invariant: true", "mean_invariant: 'yes'"))
    with pytest.raises(SidecarError, match="injection_adapter.mean_invariant: expected true or false"):
        load_sidecar(tmp_path)


def test_fit_head_recovers_a_linear_map(tiny_model_dir):
    """Golds that are an exact linear map of the features (norms already at the scale, so
    normalising changes nothing): the ridge fit with a vanishing penalty is that map, mse ~ 0."""
    from nla.core.reconstructor import Reconstructor

    ar = Reconstructor.from_base(tiny_model_dir("llama"), 1, out_dim=48)  # width 32 -> 48
    assert tuple(ar.value_head.weight.shape) == (48, 32)
    g = torch.Generator().manual_seed(0)
    a = adapter_init(32, 48, seed=4)  # [48, 32], orthonormal columns: |A f| = |f|
    f = torch.randn(200, 32, generator=g)
    f = f * (5.0 / f.norm(dim=1, keepdim=True))
    mse = ar.fit_head(f, f @ a.T, scale=5.0, ridge=1e-12)
    assert mse < 1e-8
    torch.testing.assert_close(ar.value_head.weight, a, rtol=0, atol=1e-5)


def test_hook_injects_the_adapted_vector(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from nla.core.token_ids import canonical_av_prompt_ids

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()  # width 32
    side = dataset_sidecar(tiny_tokenizer, tiny_model_dir("llama"), 48, 1, injection_scale=3.0)
    adapter = InjectionAdapter(48, 32, seed=1)
    with torch.no_grad():
        adapter.proj.bias.copy_(torch.arange(32.0) / 10)
    attach_adapter(model, adapter)
    assert get_adapter(model) is adapter and any(n.startswith("nla_injection_adapter.") for n, _ in
                                                  model.named_parameters())
    hook = InjectionHook.from_config(model, side)
    ids = torch.tensor([canonical_av_prompt_ids(tiny_tokenizer, side.av_messages())])
    site = int((ids[0] == side.injection_token_id).nonzero()[0, 0])
    v = torch.randn(1, 48)
    want = adapter.proj.weight @ (v[0] * 3.0 / v[0].norm()) + adapter.proj.bias  # W (scale v / |v|) + b
    with torch.no_grad(), hook.vectors(v):
        out_a = model(input_ids=ids).logits
    with torch.no_grad():  # the same forward with the embedding written by hand
        e = model.get_input_embeddings()(ids).clone()
        e[0, site] = want
        out_b = model(inputs_embeds=e).logits
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="vectors of width 32, but this AV reads 48-d vectors"):
        with hook.vectors(torch.randn(1, 32)):
            pass
    with pytest.raises(ValueError, match="already carries an injection adapter"):
        attach_adapter(model, InjectionAdapter(48, 32))
    with pytest.raises(ValueError, match="maps to width 16"):
        attach_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")), InjectionAdapter(48, 16))


def test_sidecar_records_both_models_and_the_adapter(tiny_tokenizer, tiny_model_dir, tmp_path):
    side = dataset_sidecar(tiny_tokenizer, tiny_model_dir("llama"), 48, 1, injection_scale=3.0)
    adapter = InjectionAdapter(48, 32).describe()
    av = side.replace(kind="nla_model", role="av", model_base="/models/small", model_width=32,
                      injection_adapter=adapter)
    write_sidecar(tmp_path, av)
    text = (tmp_path / "nla_meta.yaml").read_text()
    assert "model:\n  base_model: /models/small\n  hidden_size: 32\n" in text
    assert "injection_adapter:\n  kind: affine\n  d_in: 48\n  d_out: 32\n  file: nla_injection_adapter.safetensors" in text
    back = load_sidecar(tmp_path)
    assert (back.model_base, back.model_width, back.injection_adapter, back.own_width, back.d_model) == (
        "/models/small", 32, adapter, 32, 48)
    # a same-model sidecar writes neither block (the published layout, key for key)
    write_sidecar(tmp_path / "plain", side.replace(kind="nla_model", role="av"))
    plain = (tmp_path / "plain" / "nla_meta.yaml").read_text()
    assert "injection_adapter" not in plain and "\nmodel:" not in plain
    (tmp_path / "nla_meta.yaml").write_text(text.replace("d_in: 48", "d_in: 40"))
    with pytest.raises(SidecarError, match=r"injection_adapter.d_in: expected 48 .*found 40"):
        load_sidecar(tmp_path)
    (tmp_path / "nla_meta.yaml").write_text(text.replace("kind: affine", "kind: mlp"))
    with pytest.raises(SidecarError, match="injection_adapter.kind: expected 'affine', found 'mlp'"):
        load_sidecar(tmp_path)


@pytest.fixture(scope="module")
def cross_pair(tmp_path_factory):
    """The tiny world subject (width 64) explained by a 32-wide Llama with the subject's tokenizer
    (random weights: the pair learns everything in its warm-starts)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nla.core.arch import load_tokenizer
    from nla.world import build_world

    root = tmp_path_factory.mktemp("cross")
    subject = build_world("tiny", progress=False).subject_dir
    tok = load_tokenizer(subject)
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tok), hidden_size=D_PAIR, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    small_dir = root / "small"
    small.save_pretrained(small_dir)
    tok.save_pretrained(small_dir)
    side = dataset_sidecar(tok, subject, D_SUBJECT, 1, injection_scale=8.0)
    vec, cls = _class_vectors(64, seed=1)
    texts = [f"the {WORDS[c]} is happy" for c in cls]
    av_ds = write_av_dataset(root / "av_sft.parquet", side, vec, texts)
    # the text each vector was read at (what datagen writes as `context`): the adapter's start is
    # fitted as the translation from the subject's vectors to the small model's own on these
    table = pq.read_table(av_ds)
    pq.write_table(table.append_column("context", pa.array([f"the {WORDS[c]}" for c in cls])), av_ds)
    ar_ds = root / "ar_sft.parquet"
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vec), "doc_id": pa.array(range(64), pa.int64()),
                             "prompt": pa.array([side.ar_text(t) for t in texts]), "explanation": pa.array(texts)}),
                   ar_ds)
    write_sidecar(ar_ds, side)
    common = dict(warmup_steps=5, log_every=50, save_every=1000, eval_fraction=0.25, tensorboard=False,
                  progress=False)
    av = train_av(AVTrainConfig(dataset=str(av_ds), out_dir=str(root / "av"), base_model=str(small_dir),
                                injection_adapter="affine", max_steps=200, batch_size=8, lr=1e-2, eval_every=200,
                                smoke_num=1, smoke_max_new_tokens=8, **common))
    ar = train_ar(ARTrainConfig(dataset=str(ar_ds), out_dir=str(root / "ar"), base_model=str(small_dir),
                                max_steps=150, batch_size=16, lr=3e-3, eval_every=150, **common))
    rl_vec, _ = _class_vectors(32, seed=2)
    rl_ds = root / "rl.parquet"
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(rl_vec),
                             "doc_id": pa.array(range(32), pa.int64())}), rl_ds)
    write_sidecar(rl_ds, side)
    return {"av": av, "ar": ar, "small": small_dir, "subject": subject, "dataset": str(rl_ds), "root": root,
            "av_ds": av_ds, "ar_ds": ar_ds}


def test_cross_model_warm_starts_record_both_models(cross_pair):
    av_dir, ar_dir = cross_pair["av"].checkpoint_dir, cross_pair["ar"].checkpoint_dir
    av, ar = load_sidecar(av_dir), load_sidecar(ar_dir)
    small = str(cross_pair["small"].resolve())
    assert (av.d_model, av.model_width, av.model_base, av.base_model) == (D_SUBJECT, D_PAIR, small,
                                                                          str(cross_pair["subject"]))
    assert av.injection_adapter == {"kind": "affine", "d_in": D_SUBJECT, "d_out": D_PAIR, "file": ADAPTER_FILE}
    assert (ar.d_model, ar.model_width, ar.model_base, ar.injection_adapter) == (D_SUBJECT, D_PAIR, small, None)
    # the adapter trained with the AV (it started as the seeded norm-keeping map), and sits beside the HF files
    trained = load_adapter_file(av_dir, av)
    assert not torch.allclose(trained.proj.weight, adapter_init(D_SUBJECT, D_PAIR, seed=0), atol=1e-3)
    from safetensors import safe_open

    with safe_open(str(av_dir / "model.safetensors"), "pt") as fh:
        assert not any("injection_adapter" in k for k in fh.keys())  # a plain causal LM
    # the AR's head maps its own width to the subject's: [64, 32]
    from safetensors.torch import load_file

    assert tuple(load_file(str(ar_dir / "value_head.safetensors"))["weight"].shape) == (D_SUBJECT, D_PAIR)
    # the AV reads its vector: the held-out loss with the vectors rolled by one row is higher
    m = cross_pair["av"].metrics
    assert m["eval_vector_gap"] > 0.05, m


def test_translation_start_fits_the_small_models_own_vectors(cross_pair):
    """The cross-model adapter's start: the ridge map from the subject's vectors to the small
    model's own layer-1 vectors at the end of each row's context (targets at the injection norm
    times sqrt(32 / 64)); it explains part of them, unlike the seeded random start."""
    from transformers import AutoModelForCausalLM

    from nla.core.activations import block_outputs, pad_right, tokenize_text
    from nla.core.arch import load_tokenizer
    from nla.core.vectors import normalize_activation
    from nla.train.av import _fit_translation

    small = AutoModelForCausalLM.from_pretrained(cross_pair["small"])
    tok = load_tokenizer(cross_pair["small"])
    table = pq.read_table(cross_pair["av_ds"])
    contexts = table.column("context").to_pylist()
    vec = np.stack(table.column("activation_vector").to_numpy(zero_copy_only=False)).astype(np.float32)
    side = load_sidecar(cross_pair["av_ds"])
    adapter = InjectionAdapter(D_SUBJECT, D_PAIR)
    cfg = AVTrainConfig(dataset="x", batch_size=16)
    _fit_translation(adapter, small, tok, contexts, vec, side, cfg)
    ids, mask = pad_right([tokenize_text(tok, c, 512)[0] for c in contexts], tok.pad_token_id)
    h = block_outputs(small, ids, mask, 1).float()
    own = normalize_activation(h[torch.arange(len(contexts)), mask.sum(1) - 1], 8.0 * (32 / 64) ** 0.5)
    with torch.no_grad():
        pred = adapter(normalize_activation(torch.from_numpy(vec), 8.0))
        start = InjectionAdapter(D_SUBJECT, D_PAIR)(normalize_activation(torch.from_numpy(vec), 8.0))
    resid = ((pred - own) ** 2).sum() / ((own - own.mean(0)) ** 2).sum()
    assert float(resid) < 0.5  # four classes, one context each: the map explains most of it
    assert float(((start - own) ** 2).sum() / ((own - own.mean(0)) ** 2).sum()) > 1.0


def test_cross_model_pair_loads_in_the_client_and_refuses_wrong_widths(cross_pair):
    from nla.client import NLAClient

    client = NLAClient(cross_pair["av"].checkpoint_dir, cross_pair["ar"].checkpoint_dir)
    assert client.d_model == D_SUBJECT
    vec, cls = _class_vectors(8, seed=3)
    out = client.verbalize(torch.from_numpy(vec), greedy=True, max_new_tokens=16)
    assert len(out) == 8
    named = sum(WORDS[c] in o.text for o, c in zip(out, cls, strict=True))
    assert named >= 6, [o.text for o in out]  # the small AV names each vector's class word
    pred = client.reconstruct(["the cat is happy"])
    assert tuple(pred.shape) == (1, D_SUBJECT)
    with pytest.raises(ValueError, match="vectors: have d=32 but the AV sidecar's d_model is 64"):
        client.verbalize(torch.randn(2, D_PAIR), greedy=True, max_new_tokens=4)
    with pytest.raises(ValueError, match="64"):
        client.score(["the cat is happy"], torch.randn(1, D_PAIR))


def test_a_wider_base_without_the_adapter_is_refused(cross_pair, tmp_path):
    with pytest.raises(AVTrainError, match="injection_adapter: the base model .* has width 32 but the dataset's "
                                           "vectors have d_model 64.*set injection_adapter: affine"):
        train_av(AVTrainConfig(dataset=str(cross_pair["av_ds"]), out_dir=str(tmp_path / "av"),
                               base_model=str(cross_pair["small"]), max_steps=1, warmup_steps=0, tensorboard=False,
                               progress=False))
    with pytest.raises(ValueError, match="injection_adapter.*'none' or 'affine'"):
        AVTrainConfig(dataset="x", injection_adapter="linear")
    # a same-model AR keeps the width check
    with pytest.raises(ARTrainError, match="d_model: the sidecar says 48"):
        side = load_sidecar(cross_pair["ar_ds"]).replace(d_model=48, base_model=str(cross_pair["small"]))
        ds = tmp_path / "ar48.parquet"
        pq.write_table(pa.table({"activation_vector": vectors_to_arrow(np.ones((4, 48), np.float32)),
                                 "prompt": pa.array([side.ar_text("the cat is happy")] * 4)}), ds)
        write_sidecar(ds, side)
        train_ar(ARTrainConfig(dataset=str(ds), out_dir=str(tmp_path / "ar"), max_steps=1, warmup_steps=0, eval_fraction=0.0,
                               tensorboard=False, progress=False))


def test_cross_model_rl_trains_the_adapter_and_keeps_the_reference(cross_pair, tmp_path):
    from nla.rl.backend import build_groups
    from nla.rl.config import RLConfig
    from nla.rl.loop import run_rl
    from nla.util.metrics import read_metrics

    cfg = RLConfig.from_dict(dict(
        av=str(cross_pair["av"].checkpoint_dir), ar=str(cross_pair["ar"].checkpoint_dir),
        dataset=cross_pair["dataset"], out_dir=str(tmp_path / "rl"), steps=3, eval_every=1000, tensorboard=False,
        progress=False, seed=0, rollout=dict(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=24),
        optimiser=dict(micro_batch_size=16, lr=1e-3), reconstructor=dict(lr=1e-3), checkpointing=dict(save_every=3)))
    groups = build_groups(cfg)
    start = get_adapter(groups.policy.model).proj.weight.detach().clone()
    res = run_rl(cfg, groups=groups)
    rows = [r for r in read_metrics(tmp_path / "rl" / "rl.jsonl") if "reward_mean" in r]
    assert len(rows) == 3 and all(math.isfinite(r["reward_mean"]) for r in rows)
    moved = get_adapter(groups.policy.model).proj.weight.detach()
    assert not torch.equal(moved, start)  # the adapter is a policy parameter
    torch.testing.assert_close(get_adapter(groups.reference.model).proj.weight, start, rtol=0, atol=0)
    av = res.checkpoint_dir / "av"
    assert (av / ADAPTER_FILE).is_file() and load_sidecar(av).injection_adapter is not None
    torch.testing.assert_close(load_adapter_file(av, load_sidecar(av)).proj.weight, moved, rtol=0, atol=0)
    groups.close()


def test_a_mean_invariant_cross_model_av_keeps_its_fitted_mean_through_rl(cross_pair, tmp_path):
    """The mean-invariant view is fitted once in the warm-start (on the subject's vectors, before the
    translation start) and RL trains the adapter's weights around it: the saved RL checkpoint holds
    the warm-start's mean_dir / mean_tan exactly and reads shifted vectors like the training ones."""
    from nla.rl.backend import build_groups
    from nla.rl.config import RLConfig
    from nla.rl.loop import run_rl

    av = train_av(AVTrainConfig(dataset=str(cross_pair["av_ds"]), out_dir=str(tmp_path / "av"),
                                base_model=str(cross_pair["small"]), injection_adapter="affine",
                                injection_adapter_mean_invariant=True, max_steps=20, batch_size=8, lr=1e-2,
                                eval_every=20, warmup_steps=2, save_every=1000, eval_fraction=0.25, smoke_num=0,
                                tensorboard=False, progress=False))
    warm = load_adapter_file(av.checkpoint_dir, load_sidecar(av.checkpoint_dir))
    assert warm.mean_invariant and float(warm.mean_dir.norm()) == pytest.approx(1.0, abs=1e-6)
    cfg = RLConfig.from_dict(dict(
        av=str(av.checkpoint_dir), ar=str(cross_pair["ar"].checkpoint_dir), dataset=cross_pair["dataset"],
        out_dir=str(tmp_path / "rl"), steps=2, eval_every=1000, tensorboard=False, progress=False, seed=0,
        rollout=dict(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=16),
        optimiser=dict(micro_batch_size=16, lr=1e-3), reconstructor=dict(lr=1e-3), checkpointing=dict(save_every=2)))
    groups = build_groups(cfg)
    res = run_rl(cfg, groups=groups)
    groups.close()
    after = load_adapter_file(res.checkpoint_dir / "av", load_sidecar(res.checkpoint_dir / "av"))
    assert after.mean_invariant
    torch.testing.assert_close(after.mean_dir, warm.mean_dir, rtol=0, atol=0)
    torch.testing.assert_close(after.mean_tan, warm.mean_tan, rtol=0, atol=0)
    assert not torch.equal(after.proj.weight, warm.proj.weight)  # trained around the fixed view
    v = torch.from_numpy(np.stack(pq.read_table(cross_pair["dataset"]).column("activation_vector")
                                  .to_numpy(zero_copy_only=False)).astype(np.float32))
    shift = 3.0 * warm.mean_dir  # any multiple of the training mean's direction
    at = lambda x: 8.0 * x / x.norm(dim=-1, keepdim=True)  # noqa: E731  the hook's injection norm
    with torch.no_grad():
        torch.testing.assert_close(after(at(v + shift)), after(at(v)), rtol=1e-5, atol=1e-5)


def _conformal(adapter):
    """W of a conformal adapter, after checking W^T W = exp(2 log_gain) I."""
    w = adapter.proj.weight.detach().double()
    g2 = math.exp(2 * float(adapter.proj.parametrizations.weight[0].log_gain.detach()))
    torch.testing.assert_close(w.T @ w, g2 * torch.eye(w.shape[0], dtype=torch.float64), rtol=0, atol=1e-4 * g2)
    return w


@pytest.fixture(scope="module")
def conformal_av(cross_pair):
    """A same-width AV (the tiny subject as its base) with the conformal adapter, 60 warm-start steps at
    lr 3e-3: enough that RL's first rollout holds explanations (at 10 steps and lr 1e-3 every sample of
    the tiny world's step 1 failed, and the update that followed was Adam acting on a 1e-9 gradient:
    float noise, not a comparison)."""
    return train_av(AVTrainConfig(dataset=str(cross_pair["av_ds"]), out_dir=str(cross_pair["root"] / "conformal_av"),
                                  base_model=str(cross_pair["subject"]), injection_adapter="affine",
                                  injection_adapter_conformal=True, injection_adapter_lr_scale=10.0, max_steps=60,
                                  batch_size=8, lr=3e-3, eval_every=10, warmup_steps=0, save_every=1000,
                                  eval_fraction=0.25, smoke_num=0, tensorboard=False, progress=False))


def test_a_conformal_av_stays_a_gain_times_a_rotation_through_rl(cross_pair, conformal_av, tmp_path):
    """injection_adapter_conformal on a same-width AV (the subject as its base): the warm-start and
    RL both train the adapter and its W stays exp(2 log_gain) I under W^T W; on a base of another
    width it is refused before training, naming the widths."""
    from nla.rl.backend import build_groups
    from nla.rl.config import RLConfig
    from nla.rl.loop import run_rl

    conformal, av = _conformal, conformal_av
    side = load_sidecar(av.checkpoint_dir)
    assert side.injection_adapter["conformal"] is True
    warm = load_adapter_file(av.checkpoint_dir, side)
    w_warm = conformal(warm)
    assert not torch.allclose(w_warm, torch.eye(D_SUBJECT, dtype=torch.float64), atol=1e-4)  # it trained
    cfg = RLConfig.from_dict(dict(
        av=str(av.checkpoint_dir), ar=str(cross_pair["ar"].checkpoint_dir), dataset=cross_pair["dataset"],
        out_dir=str(tmp_path / "rl"), steps=2, eval_every=1000, tensorboard=False, progress=False, seed=0,
        rollout=dict(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=16),
        optimiser=dict(micro_batch_size=16, lr=1e-3), reconstructor=dict(lr=1e-3), checkpointing=dict(save_every=2)))
    groups = build_groups(cfg)
    res = run_rl(cfg, groups=groups)
    groups.close()
    after = load_adapter_file(res.checkpoint_dir / "av", load_sidecar(res.checkpoint_dir / "av"))
    assert after.conformal
    assert not torch.equal(conformal(after), w_warm)  # RL trained it, inside the constraint
    with pytest.raises(AVTrainError, match="injection_adapter_conformal: the base model .* has width 32, the subject "
                                           "d_model 64"):
        train_av(AVTrainConfig(dataset=str(cross_pair["av_ds"]), out_dir=str(tmp_path / "small"),
                               base_model=str(cross_pair["small"]), injection_adapter="affine",
                               injection_adapter_conformal=True, max_steps=1, warmup_steps=0, tensorboard=False,
                               progress=False))
    with pytest.raises(ValueError, match="'injection_adapter_conformal': expected false unless injection_adapter"):
        AVTrainConfig(dataset="x", injection_adapter_conformal=True)
    with pytest.raises(ValueError, match="'injection_adapter_conformal': expected true or false"):
        AVTrainConfig(dataset="x", injection_adapter="affine", injection_adapter_conformal="yes")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("which", ["cross-model", "conformal"])
def test_cross_model_pair_on_ray_matches_local(cross_pair, which, request, tmp_path):
    """The adapter is one more policy weight: sharded with the root module on 2 policy ranks, synced
    into each rank's rollout copy, saved beside the HF files; same seed -> the local run's rewards,
    losses and trained adapter, to float summation order (as tests/test_rl_ray.py). A same-width AV
    whose adapter is conformal (a parametrized weight, its gain a [1] parameter because FSDP2 shards
    no scalar) gives the local run's rewards and losses on Ray, and stays conformal."""
    import ray

    from nla.rl.backend import build_groups
    from nla.rl.config import RLConfig
    from nla.rl.loop import run_rl
    from nla.util.metrics import read_metrics

    av = cross_pair["av"] if which == "cross-model" else request.getfixturevalue("conformal_av")

    def cfg(out, **kw):
        return RLConfig.from_dict(dict(
            av=str(av.checkpoint_dir), ar=str(cross_pair["ar"].checkpoint_dir),
            dataset=cross_pair["dataset"], out_dir=str(out), steps=2, eval_every=1000, tensorboard=False,
            progress=False, seed=0, rollout=dict(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=24),
            optimiser=dict(micro_batch_size=16, lr=1e-3), reconstructor=dict(lr=1e-3),
            checkpointing=dict(save_every=2), **kw))

    local = cfg(tmp_path / "local")
    run_rl(local, groups=build_groups(local))
    res = run_rl(cfg(tmp_path / "ray", backend=dict(name="ray", num_policy_workers=2, num_reconstructor_workers=1)))
    assert not ray.is_initialized()
    a = [r for r in read_metrics(tmp_path / "local" / "rl.jsonl") if "reward_mean" in r]
    b = [r for r in read_metrics(tmp_path / "ray" / "rl.jsonl") if "reward_mean" in r]
    assert len(a) == len(b) == 2
    assert a[0]["reward_mean"] > -2.0  # not every sample failed: the first update has a gradient to compare
    for ra, rb in zip(a, b, strict=True):
        for key in ("reward_mean", "policy_loss", "kl", "ar_loss"):
            assert ra[key] == pytest.approx(rb[key], abs=1e-4), (ra["step"], key)
    side = load_sidecar(res.checkpoint_dir / "av")
    wa = load_adapter_file(tmp_path / "local" / "checkpoints" / res.checkpoint_dir.name / "av", side)
    wb = load_adapter_file(res.checkpoint_dir / "av", side)
    start = load_adapter_file(av.checkpoint_dir, side)
    if which == "cross-model":
        torch.testing.assert_close(wa.proj.weight, wb.proj.weight, atol=1e-4, rtol=1e-3)
    # The same-width AV's adapter gradients are tiny (it starts at W = I on the subject's own
    # embeddings): Adam's first steps move each entry by about lr * sign(g), so summation order
    # shows in its weights at the size of lr (a plain same-width adapter too: 5e-4 at lr 1e-3,
    # measured). Its rewards and losses match above; here it trained and stayed conformal.
    assert not torch.allclose(wb.proj.weight, start.proj.weight, atol=1e-6)
    if which == "conformal":
        assert wb.conformal
        _conformal(wb)


def test_cross_model_ppo_value_model_reads_the_vector_through_its_adapter_copy(cross_pair, tmp_path):
    from nla.rl.backend import build_groups
    from nla.rl.config import RLConfig
    from nla.rl.loop import run_rl
    from nla.util.metrics import read_metrics

    cfg = RLConfig.from_dict(dict(
        av=str(cross_pair["av"].checkpoint_dir), ar=str(cross_pair["ar"].checkpoint_dir),
        dataset=cross_pair["dataset"], out_dir=str(tmp_path / "ppo"), steps=2, eval_every=1000, tensorboard=False,
        progress=False, seed=0, rollout=dict(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=16),
        optimiser=dict(micro_batch_size=16, lr=1e-3), loss=dict(advantage="gae", gamma=1.0, lam=0.95),
        checkpointing=dict(save_every=1000)))
    groups = build_groups(cfg)
    value = groups.value.model
    assert value.adapter is not None and value.adapter is not get_adapter(groups.policy.model)
    assert groups.value.hook.adapter is value.adapter
    start = value.adapter.proj.weight.detach().clone()
    run_rl(cfg, groups=groups)
    row = next(r for r in read_metrics(tmp_path / "ppo" / "rl.jsonl") if "value_loss" in r)
    assert math.isfinite(row["value_loss"]) and row["value_loss"] > 0
    # trained with the values (from step 2: the zero-initialised head passes no gradient back at step 1)
    assert not torch.equal(value.adapter.proj.weight.detach(), start)
    groups.close()
