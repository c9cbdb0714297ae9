"""LoRA for the AV (nla.core.lora): the helpers on a real tiny Llama, then RL on the pair fixture of
test_rl_loop (the world tiny subject as AV and AR base) against full fine-tuning."""

import json

import pytest
import torch
from test_rl_loop import _cfg, _one_thread, pair  # noqa: F401  (fixtures used by name)
from transformers import AutoModelForCausalLM

from nla.core.lora import (
    LoRASettings,
    adapter_dir_for,
    adapter_state,
    adapters_off,
    apply_lora,
    held_state_bytes,
    load_adapter,
    merged_items,
    merged_state_dict,
    save_adapter,
)
from nla.rl.backend import build_groups
from nla.rl.loop import run_rl
from nla.util.metrics import read_metrics

pytest.importorskip("peft")


@pytest.fixture
def lora_llama(tiny_model_dir):
    """A tiny Llama with r=4 adapters whose B is non-zero (peft starts B at 0: base == adapted)."""
    base = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoRASettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return base, model, plain


def test_adapters_only_train_and_the_reference_is_the_base(lora_llama):
    base, model, plain = lora_llama
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # 2 layers x 3 targets x (A, B)
    assert len(trainable) == model.config.num_hidden_layers * 3 * 2
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    plain_model = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        ref = plain_model(input_ids=ids).logits
        on = model(input_ids=ids).logits
        with adapters_off(model):
            off = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    torch.testing.assert_close(off, ref, rtol=0, atol=1e-6)  # adapters off: the base, bit for bit up to fp
    assert (on - ref).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(again, on, rtol=0, atol=0)  # and come back after the block
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_merged_state_dict_is_a_plain_checkpoint_of_the_adapted_model(lora_llama, tmp_path):
    base, model, plain = lora_llama
    merged = merged_state_dict(model)
    assert set(merged) == set(plain)
    # W' = W + (alpha / r) B A for an adapted layer (by hand), untouched elsewhere
    q = "model.layers.0.self_attn.q_proj"
    layer = model.get_submodule(q)
    by_hand = plain[f"{q}.weight"] + (8.0 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged[f"{q}.weight"], by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged["model.layers.0.self_attn.k_proj.weight"],
                               plain["model.layers.0.self_attn.k_proj.weight"], rtol=0, atol=0)
    # the base weights themselves are not rounded by merging (out of place)
    torch.testing.assert_close(layer.base_layer.weight, plain[f"{q}.weight"], rtol=0, atol=0)
    model.save_pretrained(tmp_path / "merged", state_dict=merged, safe_serialization=True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_merge_streams_tensor_by_tensor_as_peft_merges(lora_llama):
    """``merged_items`` (what a sharded policy's gathered tensors go through) against peft's own
    ``merge_and_unload`` on the same adapters, in any tensor order; the adapter keys as peft's
    ``get_peft_model_state_dict`` names them; bad parts refused by name."""
    from peft import PeftModel, get_peft_model_state_dict

    base, model, plain = lora_llama
    state = model.state_dict()
    by_peft = PeftModel(AutoModelForCausalLM.from_pretrained(base).eval(),
                        LoRASettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")).peft_config())
    by_peft.base_model.model.load_state_dict(state)
    want = by_peft.merge_and_unload().state_dict()
    reverse = dict(merged_items(reversed(list(state.items())), 8.0 / 4))  # lora_B before its base weight
    assert set(reverse) == set(plain)
    for k, v in want.items():
        torch.testing.assert_close(reverse[k], v, rtol=0, atol=1e-6)
    # one layer held at a time: a layer's merged weight leaves as soon as its three parts passed
    q = "model.layers.0.self_attn.q_proj"
    out = merged_items(((k, state[k]) for k in [f"{q}.base_layer.weight", f"{q}.lora_A.default.weight",
                                                  f"{q}.lora_B.default.weight"]), 2.0)
    assert next(out)[0] == f"{q}.weight"
    assert adapter_state(state).keys() == {"base_model.model." + k for k in get_peft_model_state_dict(model)}
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    torch.testing.assert_close(dict(merged_items(bf16.items(), 2.0))[f"{q}.weight"],
                               want[f"{q}.weight"].to(torch.bfloat16), rtol=0, atol=1e-2)
    with pytest.raises(ValueError, match=r"layers \['model.layers.0.self_attn.q_proj'\] lack their base weight"):
        dict(merged_items([(f"{q}.lora_A.default.weight", state[f"{q}.lora_A.default.weight"])], 2.0))
    with pytest.raises(ValueError, match=r"'embed.lora_embedding_A.default' is not a Linear layer"):
        dict(merged_items([("embed.lora_embedding_A.default", torch.zeros(2))], 2.0))


def test_adapter_dir_round_trips_and_peft_reads_it(lora_llama, tmp_path):
    from peft import PeftModel

    base, model, _ = lora_llama
    out = save_adapter(model, tmp_path / "av_adapter", base)
    assert out == adapter_dir_for(tmp_path / "av")
    assert json.loads((out / "nla_lora.json").read_text())["r"] == 4
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    fresh = apply_lora(AutoModelForCausalLM.from_pretrained(base).eval(),
                       LoRASettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")))
    load_adapter(fresh, out)
    by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base).eval(), str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(by_peft(input_ids=ids).logits, want, rtol=0, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="no LoRA adapter here"):
        load_adapter(fresh, tmp_path)
    with pytest.raises(ValueError, match=r"lora.target_modules: \['c_attn'\] are not modules of LlamaForCausalLM"):
        apply_lora(AutoModelForCausalLM.from_pretrained(base), LoRASettings(r=2, target_modules=("c_attn",)))


def test_config_refuses_bad_lora_fields(pair, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match=r"lora.r: expected an integer >= 0"):
        _cfg(pair, tmp_path, lora=dict(r=-1))
    with pytest.raises(ValueError, match=r"lora.dropout"):
        _cfg(pair, tmp_path, lora=dict(r=4, dropout=1.0))
    with pytest.raises(ValueError, match=r"reconstructor.lora_r: expected an integer >= 0"):
        _cfg(pair, tmp_path, reconstructor=dict(lora_r=-2))
    with pytest.raises(ValueError, match="lora.r > 0 with loss.advantage: gae"):
        build_groups(_cfg(pair, tmp_path, lora=dict(r=4), loss=dict(advantage="gae")))


def test_rl_with_lora_holds_one_av_trains_adapters_and_resumes(pair, tmp_path):  # noqa: F811
    """Same seed, same first rollout as full fine-tuning (B starts at 0: the adapted AV is the
    warm start); the KL to the reference (the same module, adapters off) is 0 at step 1 and not
    after; only the adapters move; the checkpoint is a plain merged HF dir + av_adapter/, and a
    resumed run continues from the adapter. The AR too (``reconstructor.lora_r``)."""
    full = tmp_path / "full"
    full_cfg = _cfg(pair, full, steps=2)
    full_groups = build_groups(full_cfg)
    run_rl(full_cfg, groups=full_groups)
    lora_cfg = _cfg(pair, tmp_path / "lora", steps=2, lora=dict(r=4, alpha=8.0), optimiser=dict(lr=3e-3),
                    reconstructor=dict(lora_r=4))
    groups = build_groups(lora_cfg)
    assert groups.reference.model is groups.policy.model is groups.rollout.model  # one AV in memory
    res = run_rl(lora_cfg, groups=groups)
    _held_state_falls(full_groups, groups)
    a = [r for r in read_metrics(full / "rl.jsonl") if "reward_mean" in r]
    b = [r for r in read_metrics(tmp_path / "lora" / "rl.jsonl") if "reward_mean" in r]
    assert b[0]["reward_mean"] == pytest.approx(a[0]["reward_mean"], rel=1e-6)  # same tokens at step 1
    assert b[0]["ar_loss"] == pytest.approx(a[0]["ar_loss"], rel=1e-6)  # the LoRA AR starts as the warm start
    _lora_ar_checks(pair, full_groups, groups, res.checkpoint_dir)
    assert b[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert b[1]["kl"] > 1e-6  # step 2: the adapters moved the policy away from the reference
    base = AutoModelForCausalLM.from_pretrained(pair["av"]).state_dict()
    for name, p in groups.policy.model.named_parameters():
        if "lora_" not in name:
            key = name.replace(".base_layer.", ".")
            torch.testing.assert_close(p.detach(), base[key], rtol=0, atol=0)
    ckpt = res.checkpoint_dir
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "av")
    assert (adapter_dir_for(ckpt / "av") / "adapter_model.safetensors").is_file()
    moved = [k for k, v in merged.state_dict().items() if not torch.equal(v, base[k])]
    assert moved and all(any(t in k for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj")) for k in moved)
    # NLAClient loads the adapter dir (its base + the adapter) as it loads the merged dir
    from nla.client import NLAClient, NLAClientError

    vec = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    by_merged = NLAClient(ckpt / "av").verbalize(vec, greedy=True, max_new_tokens=12)
    by_adapter = NLAClient(adapter_dir_for(ckpt / "av")).verbalize(vec, greedy=True, max_new_tokens=12)
    assert [v.text for v in by_adapter] == [v.text for v in by_merged]
    meta = adapter_dir_for(ckpt / "av") / "nla_lora.json"
    meta.write_text(meta.read_text().replace(json.loads(meta.read_text())["base_model"], "/nonexistent/av"))
    with pytest.raises(NLAClientError, match="the adapter's base AV '/nonexistent/av'.*merged AV dir"):
        NLAClient(adapter_dir_for(ckpt / "av"))
    # resume: 3 steps in total from the step-2 checkpoint, with the adapter (not a fresh one)
    resumed = build_groups(lora_cfg.replace(steps=3), ckpt / "av", ckpt / "ar")
    torch.testing.assert_close(merged_state_dict(resumed.policy.model), merged.state_dict(), rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_state_dict(resumed.reconstructor.ar),
                               merged_state_dict(groups.reconstructor.ar), rtol=0, atol=1e-6)
    resumed.close()


def _lora_ar_checks(pair, full_groups, groups, ckpt) -> None:  # noqa: F811  (the fixture, passed on)
    """The AR under ``reconstructor.lora_r``: only its adapters and head moved; Adam holds state for
    those alone; the checkpoint is a plain AR dir (merged) that predicts as the live adapted AR,
    with ``ar_adapter/`` beside it."""
    from nla.core.reconstructor import Reconstructor

    ar = groups.reconstructor.ar
    warm = Reconstructor.from_pretrained(pair["ar"]).state_dict()
    for name, p in ar.named_parameters():
        if "lora_" in name:
            assert p.requires_grad
        elif name == "value_head.weight":
            assert p.requires_grad and not torch.equal(p.detach(), warm[name])  # the head trains in full
        else:
            assert not p.requires_grad
            torch.testing.assert_close(p.detach(), warm[name.replace(".base_layer.", ".")], rtol=0, atol=0)
    full_held = held_state_bytes([full_groups.reconstructor.ar], [full_groups.reconstructor.opt])
    lora_held = held_state_bytes([ar], [groups.reconstructor.opt])
    assert lora_held["optimizer"] == 2 * lora_held["trainable"] < 0.2 * full_held["optimizer"]
    saved = Reconstructor.from_pretrained(ckpt / "ar")
    assert not any(".lora_" in k or "base_layer" in k for k in saved.state_dict())
    assert (adapter_dir_for(ckpt / "ar") / "adapter_model.safetensors").is_file()
    texts = ["the cat is happy", "the dog is sad"]
    enc = groups.reconstructor.encode(texts, "left")
    with torch.no_grad():
        torch.testing.assert_close(saved.predict(enc["input_ids"], enc["attention_mask"]),
                                   ar.predict(enc["input_ids"], enc["attention_mask"]), rtol=1e-5, atol=1e-5)


def _held_state_falls(full_groups, lora_groups) -> None:
    """Held parameters + gradients + optimizer state of the AV roles after the runs: full
    fine-tuning holds the policy, a reference copy, a gradient per value and Adam's two moments;
    LoRA one AV plus small adapters (the ratio is measured in bench/bench_lora_memory.py)."""
    def held(g):
        return held_state_bytes([g.policy.model, g.reference.model, g.rollout.model], [g.policy.opt])

    full, lora = held(full_groups), held(lora_groups)
    p = full["trainable"]  # one AV's parameters
    assert full["params"] == 2 * p  # policy + reference copy (the rollout shares the policy)
    assert full["optimizer"] == 2 * p  # Adam's two moments per trained value
    assert full["total"] == full["params"] + full["buffers"] + p + 2 * p  # + a gradient per value at the step
    assert lora["trainable"] < 0.1 * p
    assert lora["optimizer"] == 2 * lora["trainable"]
    assert lora["params"] == p + lora["trainable"]  # one AV + its adapters
    assert lora["total"] * 3 < full["total"]
