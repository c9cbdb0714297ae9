"""LoRA in the warm-starts (``nla train av`` / ``nla train ar`` with ``lora.r > 0``; nla.core.lora):
what trains, what a checkpoint holds, exact resume, NLAClient on both the merged dir and the
adapter dir, the optimiser state it saves, and the config's errors. A real tiny Llama, real
parquets, peft."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_train_av import WORDS, _av_data
from test_train_av import _cfg as _av_cfg
from train_helpers import dataset_sidecar, write_ar_dataset

from nla.client import NLAClient
from nla.core.lora import DEFAULT_TARGETS, LORA_SUBDIR, LoRASettings, apply_lora, load_adapter
from nla.core.reconstructor import Reconstructor, tokenize_ar_texts
from nla.train.ar import train_ar
from nla.train.av import train_av
from nla.train.config import ARTrainConfig, AVTrainConfig, LoRAConfig, load_config
from nla.util.metrics import read_metrics

pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


def _lora(r=4):
    return LoRAConfig(r=r, alpha=2.0 * r, target_modules=TARGETS)


def test_lora_config_block_and_errors():
    cfg = load_config(AVTrainConfig, None, ["dataset=x.parquet", "lora.r=8", "lora.target_modules=[q_proj]"])
    assert cfg.lora == LoRAConfig(r=8, alpha=16.0, dropout=0.0, target_modules=["q_proj"])
    assert cfg.to_dict()["lora"] == {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj"]}
    # a mapping in YAML, then one key of it overridden
    cfg = load_config(ARTrainConfig, None, {"dataset": "x.parquet", "lora": {"r": 2, "alpha": 4}, "lora.r": 6})
    assert (cfg.lora.r, cfg.lora.alpha) == (6, 4.0)
    assert load_config(AVTrainConfig, None, ["dataset=x.parquet"]).lora.r == 0  # off by default
    with pytest.raises(ValueError, match=r"lora.r: expected an integer >= 0 \(0 = off\), found -1; .*--set lora.r="):
        load_config(AVTrainConfig, None, ["dataset=x.parquet", "lora.r=-1"])
    with pytest.raises(ValueError, match=r"'lora': unknown key\(s\) \['rank'\]; valid keys: \['alpha', 'dropout', 'r'"):
        AVTrainConfig(dataset="x.parquet", lora={"rank": 4})
    with pytest.raises(ValueError, match="lora.target_modules: expected a non-empty list"):
        load_config(ARTrainConfig, None, ["dataset=x.parquet", "lora.target_modules=[]"])


def _lora_param_count(model_dir, r, targets):
    """r * (in + out) per adapted linear layer, read off the plain model (by hand: A is [r, in], B [out, r])."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir)
    return sum(r * (mod.in_features + mod.out_features) for name, mod in m.named_modules()
               if name.rsplit(".", 1)[-1] in targets)


def test_av_lora_trains_adapters_and_saves_merged_and_adapter(tmp_path, tiny_tokenizer, tiny_model_dir):
    base = tiny_model_dir("llama")
    ds = _av_data(tmp_path, tiny_tokenizer, base, injection_scale=5.0)
    res = train_av(_av_cfg(ds, tmp_path / "run", lr=2e-2, max_steps=40, log_every=5, eval_every=40,
                           lora=LoRAConfig(r=8, alpha=16.0)))  # every projection
    ck = res.checkpoint_dir
    # The tiny base is random: its frozen LM head keeps logits small, so the loss cannot fall far
    # (log 108 = 4.68 is uniform), but it falls with only the adapters trained (measured: 4.47 at
    # step 5 -> 4.16 at step 40).
    recs = [r for r in read_metrics(tmp_path / "run" / "av.jsonl") if "loss" in r]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.15, [r["loss"] for r in recs]
    plain = load_file(f"{base}/model.safetensors")
    merged = load_file(ck / "model.safetensors")
    assert set(merged) == set(plain)  # a plain HF checkpoint: no lora_ / base_layer keys
    for k, v in plain.items():
        if any(f".{t}." in k for t in DEFAULT_TARGETS):
            assert (merged[k] - v).abs().max() > 1e-4, k  # base + B A * alpha / r
        else:
            torch.testing.assert_close(merged[k], v, rtol=0, atol=0)  # frozen: bit for bit the base
    # the adapter beside, in peft's format, pointing at the run's base and at this checkpoint
    meta = json.loads((ck / LORA_SUBDIR / "nla_lora.json").read_text())
    assert meta["r"] == 8 and meta["nla_dir"] == ".." and meta["base_model"] == str(Path(base).resolve())
    state = load_file(ck / LORA_SUBDIR / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.") and ".lora_" in k for k in state)
    assert sum(v.numel() for v in state.values()) == _lora_param_count(base, 8, DEFAULT_TARGETS)
    # NLAClient reads both and explains alike
    vec = np.random.default_rng(3).normal(size=(3, 32)).astype(np.float32)
    a = [v.explanation for v in NLAClient(av=ck).verbalize(vec, max_new_tokens=12)]
    b = [v.explanation for v in NLAClient(av=ck / LORA_SUBDIR).verbalize(vec, max_new_tokens=12)]
    assert a == b


def test_av_lora_holds_a_fraction_of_the_optimiser_state(tmp_path, tiny_tokenizer, tiny_model_dir):
    """AdamW keeps two moments per trainable value: with LoRA only the adapters' (derived count), not the model's."""
    from nla.train import loop as common  # the loop builds the optimiser

    base = tiny_model_dir("llama")
    ds = _av_data(tmp_path, tiny_tokenizer, base, injection_scale=5.0, n=16)
    seen = {}
    real = common.build_optimizer

    def spy(model, *a, **kw):
        opt = real(model, *a, **kw)
        seen[len(seen)] = opt
        return opt

    common.build_optimizer = spy
    try:
        train_av(_av_cfg(ds, tmp_path / "full", max_steps=2, eval_every=2, warmup_steps=0))
        train_av(_av_cfg(ds, tmp_path / "lora", max_steps=2, eval_every=2, warmup_steps=0, lora=_lora()))
    finally:
        common.build_optimizer = real

    def moments(opt):
        return sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1)

    from transformers import AutoModelForCausalLM

    n_full = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base).parameters())
    n_lora = _lora_param_count(base, 4, TARGETS)
    assert moments(seen[0]) == 2 * n_full
    assert moments(seen[1]) == 2 * n_lora
    assert n_full / n_lora >= 5


def test_av_lora_resume_equals_straight_run(tmp_path, tiny_tokenizer, tiny_model_dir):
    ds = _av_data(tmp_path, tiny_tokenizer, tiny_model_dir("llama"), injection_scale=5.0, n=24)
    kw = dict(max_steps=6, batch_size=4, save_every=3, eval_every=3, warmup_steps=2, lr=1e-2, lora=_lora(), log_every=1,
              injection_adapter="affine")
    straight = train_av(_av_cfg(ds, tmp_path / "a", **kw))
    train_av(_av_cfg(ds, tmp_path / "b", stop_after_steps=3, **kw))
    resumed = train_av(_av_cfg(ds, tmp_path / "b", **kw), resume=True)
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "av.jsonl") if "loss" in r]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "av.jsonl") if "loss" in r]
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-7)
    for f in ("model.safetensors", "nla_injection_adapter.safetensors", f"{LORA_SUBDIR}/adapter_model.safetensors"):
        wa, wb = load_file(straight.checkpoint_dir / f), load_file(resumed.checkpoint_dir / f)
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)
    # the learned injection adapter trained in full beside the LoRA layers (it starts as the identity)
    w = load_file(straight.checkpoint_dir / "nla_injection_adapter.safetensors")
    assert (next(v for k, v in w.items() if k.endswith("weight")) - torch.eye(32)).abs().max() > 1e-4


@pytest.fixture()
def ar_lora_data(tmp_path, tiny_model_dir, tiny_tokenizer):
    base = tiny_model_dir("llama")
    side = dataset_sidecar(tiny_tokenizer, base, d_model=32, layer_index=1)
    vec = np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)
    return base, write_ar_dataset(tmp_path / "ar_sft.parquet", side, vec)


def _ar_cfg(ds, out, **kw):
    base = dict(dataset=str(ds), out_dir=str(out), max_steps=6, batch_size=4, lr=1e-2, warmup_steps=2,
                save_every=3, eval_every=3, log_every=1, eval_fraction=0.25, tensorboard=False, progress=False,
                lora=_lora())
    base.update(kw)
    return ARTrainConfig(**base)


def test_ar_lora_trains_adapters_and_head_and_resumes_exactly(ar_lora_data, tmp_path):
    base, ds = ar_lora_data
    straight = train_ar(_ar_cfg(ds, tmp_path / "a"))
    train_ar(_ar_cfg(ds, tmp_path / "b", stop_after_steps=3))
    resumed = train_ar(_ar_cfg(ds, tmp_path / "b"), resume=True)
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "ar.jsonl") if "loss" in r]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "ar.jsonl") if "loss" in r]
    assert len(la) == 6 and la[-1] < la[0]
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-7)
    ck = straight.checkpoint_dir
    for f in ("model.safetensors", "value_head.safetensors"):
        wa, wb = load_file(ck / f), load_file(resumed.checkpoint_dir / f)
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)
    # the head trained in full (it starts as the identity); the untargeted body is the base's
    head = load_file(ck / "value_head.safetensors")["weight"]
    assert (head - torch.eye(32)).abs().max() > 1e-4
    plain = Reconstructor.from_base(base, 1)
    body = load_file(ck / "model.safetensors")
    untouched = {k.removeprefix("base."): v for k, v in plain.state_dict().items()
                 if k.startswith("base.") and not any(f".{t}." in k for t in TARGETS)}
    for k, v in body.items():
        if k in untouched:
            torch.testing.assert_close(v, untouched[k], rtol=0, atol=0)
    # the merged checkpoint predicts as base + the saved adapter + the saved head (LoRA unmerged)
    merged = Reconstructor.from_pretrained(ck).eval()
    apply_lora(plain, LoRASettings(4, 8.0, 0.0, tuple(TARGETS)))
    load_adapter(plain, ck / LORA_SUBDIR)
    plain.value_head.weight.data.copy_(head)
    enc = tokenize_ar_texts(merged.tokenizer, [f"the {w} sat" for w in WORDS], 64)
    with torch.no_grad():
        torch.testing.assert_close(merged.predict(enc["input_ids"], enc["attention_mask"]),
                                   plain.eval().predict(enc["input_ids"], enc["attention_mask"]), rtol=1e-5, atol=1e-5)
