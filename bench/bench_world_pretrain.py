"""Pretraining throughput of the world's default subject model vs this machine's fp32 matmul rate.

Measures, in one run:
1. the fp32 matmul FLOP rate (square matmuls, best of several repeats);
2. tokens/s of the pretraining step (forward + backward + AdamW) for the default preset's
   model shape, on random token blocks (data does not change the cost);
3. model FLOP/s ~= 6 * params * tokens/s, and its fraction of the matmul rate.

Usage: .venv/bin/python -m bench.bench_world_pretrain [--preset default] [--steps 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from nla.world.build import WORLD_PRESETS
from nla.world.subject import ModelShape, build_model, count_params


def matmul_flops(n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def pretrain_tokens_per_s(preset: str, steps: int, warmup: int = 3) -> tuple[float, int, int]:
    cfg = WORLD_PRESETS[preset]
    shape = ModelShape(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.seq_len)
    model = build_model(shape, pad_id=0, bos_id=1, eos_id=2)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    for i in range(warmup + steps):
        if i == warmup:
            t = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - t
    return steps * x.numel() / seconds, count_params(model), x.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default", choices=sorted(WORLD_PRESETS))
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    peak = matmul_flops()
    tok_s, params, tokens_per_step = pretrain_tokens_per_s(args.preset, args.steps)
    model_flops = 6 * params * tok_s
    cfg = WORLD_PRESETS[args.preset]
    rows = [
        ("preset", args.preset),
        ("torch threads", str(torch.get_num_threads())),
        ("params", f"{params / 1e6:.2f}M"),
        ("shape", f"d={cfg.d_model} L={cfg.n_layers} ff={cfg.d_ff} V={cfg.vocab_size} T={cfg.seq_len} B={cfg.batch_size}"),
        ("tokens / step", str(tokens_per_step)),
        ("pretrain tokens/s", f"{tok_s:,.0f}"),
        ("model GFLOP/s (6*N*tok/s)", f"{model_flops / 1e9:.2f}"),
        ("fp32 matmul GFLOP/s (1024^3)", f"{peak / 1e9:.2f}"),
        ("fraction of matmul rate", f"{model_flops / peak:.1%}"),
        ("est. time for preset steps", f"{cfg.train_steps * tokens_per_step / tok_s:.0f} s ({cfg.train_steps} steps)"),
    ]
    w = max(len(k) for k, _ in rows)
    print(f"{'metric':<{w}} | value")
    print(f"{'-' * w}-|------")
    for k, v in rows:
        print(f"{k:<{w}} | {v}")


if __name__ == "__main__":
    main()
