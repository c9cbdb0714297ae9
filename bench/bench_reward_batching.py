"""Reward batching: per-sample AR forwards vs RewardBatcher, on a tiny real transformer.

The AR stand-in is a randomly initialised ``LlamaModel`` (d=128, 4 layers,
vocab 1000, built from a config: no download) plus a ``Linear(d, d)`` head,
read at each row's last real token like the real reconstructor. Both paths
score the same samples (random lengths 20-60 tokens); the baseline is
measured in the same run, and the script checks that both give the same
rewards before printing the speed-up.

    .venv/bin/python -m bench.bench_reward_batching [--n 512] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import LlamaConfig, LlamaModel

from nla.core.reconstructor import last_token_index
from nla.core.reward import mse_to_reward
from nla.rl.reward import RewardBatcher, score_all


def build_ar(d: int, layers: int, vocab: int, seed: int) -> tuple[LlamaModel, torch.nn.Linear]:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=4 * d,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    body = LlamaModel(cfg).eval()
    head = torch.nn.Linear(d, d, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(d))
    return body, head


def make_score_batch(body: LlamaModel, head: torch.nn.Linear, scale: float):
    """Closure over the live model: pad right, forward once, read the last real token."""

    @torch.inference_mode()
    def score_batch(items: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        lengths = [ids.numel() for ids, _ in items]
        T = max(lengths)
        input_ids = torch.zeros(len(items), T, dtype=torch.long)
        attention_mask = torch.zeros(len(items), T, dtype=torch.long)
        for i, (ids, _) in enumerate(items):
            input_ids[i, : ids.numel()] = ids
            attention_mask[i, : ids.numel()] = 1
        hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, d]
        last = last_token_index(attention_mask)
        pred = head(hidden[torch.arange(len(items)), last])  # [B, d]
        gold = torch.stack([g for _, g in items])
        return mse_to_reward(pred, gold, scale)

    return score_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--flush-seconds", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    d, layers, vocab = 128, 4, 1000
    body, head = build_ar(d, layers, vocab, args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    items = []
    for _ in range(args.n):
        n_tok = int(torch.randint(20, 61, (1,), generator=g))
        items.append((torch.randint(0, vocab, (n_tok,), generator=g), torch.randn(d, generator=g)))
    score_batch = make_score_batch(body, head, math.sqrt(d))

    # warm up both shapes of call so one-time costs are not timed
    score_batch(items[:1])
    score_batch(items[: args.batch_size])

    t0 = time.perf_counter()
    serial = [float(score_batch([it])[0]) for it in items]
    t_serial = time.perf_counter() - t0

    batcher = RewardBatcher(score_batch, args.batch_size, args.flush_seconds)
    t0 = time.perf_counter()
    batched = score_all(batcher, items)
    t_batched = time.perf_counter() - t0

    max_diff = max(abs(a - b) for a, b in zip(serial, batched, strict=True))
    stats = batcher.stats
    print(f"AR stand-in: LlamaModel d={d} layers={layers} vocab={vocab} + Linear head; threads={args.threads}")
    print(f"samples: {args.n}, token lengths 20-60")
    print(f"per-sample forwards:  {args.n} calls      {t_serial:7.2f} s  ({1e3 * t_serial / args.n:.1f} ms/sample)")
    print(
        f"RewardBatcher(bs={args.batch_size}): {stats.n_batches} forwards "
        f"(mean batch {stats.mean_batch_size:.1f})  {t_batched:7.2f} s  ({1e3 * t_batched / args.n:.1f} ms/sample)"
    )
    print(f"speed-up (per-sample / batched): {t_serial / t_batched:.2f}x")
    print(f"max |reward difference| batched vs per-sample: {max_diff:.2e}")
    if max_diff > 1e-3:
        raise SystemExit(f"batched rewards differ from per-sample rewards by {max_diff:.2e} (> 1e-3)")


if __name__ == "__main__":
    main()
