"""Shape presets (config.json numbers of real models) and the RL step's memory plan (nla.rl.plan)."""

from __future__ import annotations

import pytest
import torch

from nla.core.shapes import SHAPES, ModelShape, get_shape
from nla.rl.plan import PlanSettings, plan_rl_step

TINY = ModelShape("t", "qwen2", vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


@pytest.mark.parametrize("name, params", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304),
                                          ("qwen2.5-7b", 7_615_616_512)])
def test_presets_build_the_model_they_count(name, params):
    # counts of the published checkpoints (0.49B, 1.54B, 7.62B), built on the meta device
    shape = get_shape(name)
    model = shape.build(dtype=torch.bfloat16, device="meta")
    assert sum(p.numel() for p in model.parameters()) == shape.params() == params
    assert ModelShape.from_hf_config(model.config, name=name) == shape


def test_lora_count_is_peft_s():
    from peft import LoraConfig, get_peft_model

    shape = SHAPES["qwen2.5-0.5b"]
    model = get_peft_model(shape.build(device="meta"), LoraConfig(r=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == shape.lora_params(16) == 8_798_208


def test_a_test_width_build_keeps_the_real_vocabulary():
    model = SHAPES["qwen2.5-7b"].build(device="meta", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
    assert model.get_input_embeddings().weight.shape == (152064, 64)
    with pytest.raises(ValueError, match=r"shape: expected one of \['qwen2.5-0.5b', 'qwen2.5-1.5b', 'qwen2.5-7b'\]"):
        get_shape("llama-7b")


def test_plan_by_hand():
    # TINY: head_dim 2, kv_dim 2; a block holds q 4*4+4, k and v 2*(4*2+2), o 4*4, MLP 3*4*8, norms 2*4 = 160
    # values; the AV 10*4 + 2*160 + 4 (tied head) = 364; the AR (blocks 0..0, no LM head) 40 + 160 + 4 + 4*4 = 220.
    assert TINY.block_params() == 160 and TINY.params() == 364
    s = PlanSettings(layer=0, dtype="float32", prompts=2, samples=2, prompt_len=3, max_response_len=5, micro_batch=2,
                     ar_len=6)
    plan = plan_rl_step(TINY, s)
    assert plan.terms["policy (AV)"] == {"weights": 1456, "gradients": 1456, "AdamW state": 2912}
    assert plan.terms["reference"] == {"weights": 1456}
    assert plan.terms["reconstructor (AR)"] == {"weights": 880, "gradients": 880, "AdamW state": 1760}
    assert plan.persistent == 10800
    # KV: 2 x 2 layers x kv_dim 2 x 4 B x 4 rows x (3 + 5) tokens = 1024; decode logits 2 x 4 x 10 x 4 = 320
    assert plan.phases["generation (KV cache, decode logits)"] == 1344
    # logits and their gradient 2 x (2*5 tokens x 10 x 4 B) = 800; chunk 3 x 100 x 4 = 1200;
    # activations 2*(3+5) tokens x 4 B x 2 blocks x (10*4 + 4*8) = 9216
    assert plan.phases["policy update (per micro-batch)"] == 11216
    assert plan.phases["AR update (per micro-batch)"] == 2 * 6 * 4 * 1 * 72
    assert plan.peak == 10800 + 11216
    gc = plan_rl_step(TINY, PlanSettings(**{**s.__dict__, "gradient_checkpointing": True}))
    assert gc.phases["policy update (per micro-batch)"] == 800 + 1200 + 16 * 4 * (2 * 4 + 72)
    # LoRA r=1: per block r x ((4+4) + 2 (4+2) + (4+4) + 2 (4+8) + (8+4)) = 64, two blocks: 128 fp32 adapters
    lora = plan_rl_step(TINY, PlanSettings(**{**s.__dict__, "lora_r": 1}))
    assert lora.terms["policy (AV)"] == {"weights": 1456, "adapters": 512, "gradients": 512, "AdamW state": 1024}
    assert lora.terms["reference"] == {"weights": 0}
    assert plan.fits(plan.peak) and not plan.fits(plan.peak - 1)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"micro_batch: expected an integer >= 1, found 0"):
        PlanSettings(layer=0, micro_batch=0)
    with pytest.raises(ValueError, match=r"dtype: expected one of"):
        PlanSettings(layer=0, dtype="int8")
    with pytest.raises(ValueError, match=r"layer: expected a block index below 2 \(t\), found 2"):
        plan_rl_step(TINY, PlanSettings(layer=2))


def test_cli_plan_says_what_fits(capsys):
    from nla.cli import main

    assert main(["plan", "--shape", "qwen2.5-7b", "--layer", "20", "--lora-r", "16"]) == 0
    out = capsys.readouterr().out
    assert "| policy (AV): weights | 14.19 |" in out  # 7,615,616,512 x 2 B
    assert "- RTX 4090 (24 GB): does not fit" in out and "- H200 (141 GB): fits" in out
    assert main(["plan", "--shape", "qwen2.5-7b", "--layer", "20", "--device-memory", "24"]) == 3
    assert "does NOT fit on a device of 24.0 GiB" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["plan", "--shape", "qwen2.5-7b", "--layer", "20", "--micro-batch", "0"])
    assert e.value.code == 2


def test_the_scale_bench_runs_a_step_at_test_width(tmp_path):
    # bench/bench_gpu_scale.py (bench/gpu_scale.sh's step): Qwen2.5-0.5B's shape shrunk to d 64 keeps the
    # real vocabulary and tokenizer; one step on the CPU times every phase and reports the plan.
    import argparse
    import json

    from bench.bench_gpu_scale import run

    args = argparse.Namespace(shape="qwen2.5-0.5b", layer=1, lora_r=4, dtype="float32", device="cpu", prompts=2,
                              samples=2, max_response_len=6, micro_batch=2, steps=1, gradient_checkpointing=False,
                              ar_gradient_checkpointing=False, width=64, layers=2, json=None)
    out = run(args)
    assert [list(s) for s in out["steps"]] == [["generate", "reference log-probs", "reward (live AR)",
                                                 "policy update", "AR update", "step"]]
    step = out["steps"][0]
    assert step["step"] == pytest.approx(sum(v for k, v in step.items() if k != "step"))
    assert out["samples_per_s"] == pytest.approx(4 / step["step"]) and out["plan_peak_gib"] > 0
    json.dumps(out)


def test_the_decode_bench_runs_both_decodes_at_test_width(tmp_path):
    # bench/bench_decode.py (bench/gpu_scale.sh's last step) on the CPU: both decodes write the same
    # greedy tokens; the figures come back as JSON
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "decode.json"
    subprocess.run([sys.executable, "-m", "bench.bench_decode", "--shape", "qwen2.5-0.5b", "--width", "64",
                    "--layers", "2", "--rows", "8", "--samples", "4", "--len", "6", "--dtype", "float32", "--device",
                    "cpu", "--repeat", "1", "--json", str(out)], check=True, capture_output=True,
                   cwd=Path(__file__).resolve().parents[1])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["tokens"], r["same_tokens"]) for r in rows] == [(8, 48, True)]
    assert rows[0]["ratio"] > 0
