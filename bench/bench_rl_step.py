"""One `nla rl` step, broken down, against a stock GRPO loop and HF generate, in one run.

Three measurements on the same AV/AR pair, prompts, batch, lengths and sampling settings:

1. **nla step**: the local backend's roles driven as ``nla.rl.loop.run_rl`` drives them
   (generate -> reward with the live AR -> reference log-probs -> policy update -> AR
   update), timed per phase; samples/s over the whole step. The reward phase opens the AR's
   reward window first (``ReconstructorWorker.begin_rollout``), as the loop does, so it
   includes the AR backward of the rollout rows and the AR update only steps; the AR work is
   also timed with the window off (``fuse_reward=False``, the plain reward + update) in the
   same run. The duplicate share is the share of rows whose (prompt, response tokens)
   repeat an earlier row of their rollout.
2. **stock GRPO**: a plain HF/torch loop with no AR work: ``model.generate(input_ids)`` on
   the same prompt (no injection), a trivial reward, GRPO advantages, reference forward and
   a padded policy forward/backward per micro-batch with the same loss (clip + k3 KL), AdamW.
   The nla/stock ratio is the issue's headline (target >= 1.5x).
3. **rollout vs HF**: ``RolloutWorker.generate`` against ``model.generate(inputs_embeds=...)``
   with the vector injected into the embeddings by hand, same batch and sampling settings
   (target >= 1.5x); greedy outputs of the two are compared as a sanity check.

4. **passes**: the reference and policy passes on one rollout, fast (shared prompt prefix,
   trimmed padding, length-ordered micro-batches, length buckets, LM head at real positions
   only) against plain (every row's prompt and padded response), the same code otherwise.
5. **ar**: the AR's work on one rollout (reward, then AR update) with the reward window off
   and on (``ReconstructorWorker.fuse_reward``).

Also printed: the policy update's rate (6 x non-embedding params x (prompt + real response
tokens of every row) per second, i.e. the work a plain per-row pass does) as a share of the
fp32 matmul rate measured in this process (target >= 60%).
The first step of each loop is a warm-up and is not counted.

    python bench/bench_rl_step.py [--prompts 16 --samples 8 --max-len 64 --steps 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict

import torch

from nla.rl import algorithms as A
from nla.rl.backend import build_groups
from nla.rl.config import RLConfig
from nla.rl.loop import RLData, reward_items, shape_rewards
from nla.threads import apply_threads

QS = "/tmp/exp/qs_final"  # a complete `nla quickstart --preset default` run


def _timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def nla_step(groups, cfg: RLConfig, vectors: torch.Tensor, rows: torch.Tensor) -> tuple[dict[str, float], dict]:
    """One step with the local roles; returns phase times and facts about the rollout."""
    ro, t = cfg.rollout, {}
    r, t["generate"] = _timed(groups.rollout.generate, vectors, rows, ro.n_samples_per_prompt, ro.max_response_len,
                              ro.temperature, ro.top_p)
    t0 = time.perf_counter()
    groups.reconstructor.begin_rollout()  # as run_rl: the reward forwards are the AR update's forwards
    items = reward_items(r)
    mse = torch.full((r.n,), float("nan"))
    if items:
        mse[r.ok] = groups.reconstructor.mse_batch(items)
    r.mse = mse
    r.rewards = shape_rewards(r.status, mse, r.lengths, cfg)
    t["reward"] = time.perf_counter() - t0
    ref_logp, t["reference"] = _timed(groups.reference.logprobs, r)
    adv, _ = A.get_advantage_estimator(cfg.loss.advantage)(r.rewards, r.response_mask.float(),
                                                           group_size=ro.n_samples_per_prompt)
    _, t["policy"] = _timed(groups.policy.update, r, adv, ref_logp)
    ok = r.ok
    exps = [e for e, k in zip(r.explanations, ok.tolist(), strict=True) if k]
    _, t["ar_update"] = _timed(groups.reconstructor.update, exps, r.vectors[ok])
    groups.rollout.sync_weights(groups.policy)
    seen, dups = set(), 0
    for i in range(r.n):
        key = (int(r.prompt_rows[i]), tuple(r.response_ids[i, : int(r.lengths[i])].tolist()))
        dups += key in seen
        seen.add(key)
    return t, {"n": r.n, "real_tokens": int(r.response_mask.sum()) + r.n * r.prompt_ids.shape[0],
               "mean_len": float(r.lengths.float().mean()), "L": r.response_ids.shape[1], "dups": dups}


class StockGRPO:
    """A plain GRPO loop (no injection, no AR): what a stock trainer does per step."""

    def __init__(self, model, tokenizer, prompt_ids: torch.Tensor, cfg: RLConfig) -> None:
        self.policy, self.ref = model, copy.deepcopy(model).eval().requires_grad_(False)
        self.tok, self.prompt_ids, self.cfg = tokenizer, prompt_ids, cfg
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.optimiser.lr, weight_decay=0.0)

    def _logp(self, model, ids, attn, P):
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, P - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)

    def step(self, B: int) -> dict[str, float]:
        ro, lo, t = self.cfg.rollout, self.cfg.loss, {}
        G, P, eos = ro.n_samples_per_prompt, self.prompt_ids.shape[0], self.tok.eos_token_id
        ids = self.prompt_ids.expand(B * G, P)
        self.policy.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                       temperature=ro.temperature, top_p=ro.top_p, top_k=0,
                                       max_new_tokens=ro.max_response_len, eos_token_id=eos, pad_token_id=eos)
        t["generate"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        resp = out[:, P:]
        is_eos = resp == eos
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((resp.shape[0],), resp.shape[1]))
        mask = (torch.arange(resp.shape[1])[None] <= first[:, None]).float()
        rewards = -mask.sum(1) / resp.shape[1]  # trivial reward: shorter is better
        adv = A.grpo_advantages(rewards, G)[:, None].expand_as(mask)
        t["reward"] = time.perf_counter() - t0
        self.mean_len = float(mask.sum(1).mean())
        attn = torch.cat([torch.ones(resp.shape[0], P), mask], 1).long()
        mb = self.cfg.optimiser.micro_batch_size
        chunks = [slice(i, i + mb) for i in range(0, resp.shape[0], mb)]
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = torch.cat([self._logp(self.ref, out[c], attn[c], P) for c in chunks])
        t["reference"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.policy.train()
        for c in chunks:
            logp = self._logp(self.policy, out[c], attn[c], P)
            m = mask[c]
            pg, _ = A.policy_loss(logp, logp.detach(), adv[c], m, eps_low=lo.eps_low, eps_high=lo.eps_high,
                                  agg="token-mean")
            kl = A.aggregate_loss(A.kl_penalty(logp, ref[c], "k3", mask=m), m, "token-mean")
            ((pg + lo.kl_coef * kl) * (m.sum() / mask.sum())).backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t["policy"] = time.perf_counter() - t0
        return t


def hf_generate_embeds(worker, vectors: torch.Tensor, G: int, max_new: int, ro, greedy: bool) -> torch.Tensor:
    """HF ``generate(inputs_embeds=...)``: the prompt embedded once with the vector injected by hand."""
    model, P = worker.model, worker.prompt_ids.shape[0]
    vec = vectors.repeat_interleave(G, 0)
    ids = worker.prompt_ids.expand(vec.shape[0], P)
    kw = {"do_sample": False} if greedy else {"do_sample": True, "temperature": ro.temperature, "top_p": ro.top_p,
                                              "top_k": 0}
    model.eval()
    with torch.no_grad():
        with worker.hook.vectors(vec):
            emb = model.get_input_embeddings()(ids)
        out = model.generate(inputs_embeds=emb, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             eos_token_id=worker.eos_id, pad_token_id=worker.pad_id,
                             suppress_tokens=[worker.sidecar.injection_token_id], **kw)
    return out  # inputs_embeds: HF returns only the new tokens


def matmul_gflops(n: int = 512, seconds: float = 2.0) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        k += 1
    return 2 * n**3 * k / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--av", default=f"{QS}/av/checkpoints/step_00001000")
    ap.add_argument("--ar", default=f"{QS}/ar/checkpoints/step_00000800")
    ap.add_argument("--dataset", default=f"{QS}/datagen/rl_train.parquet")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--micro", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="counted steps per loop (after one warm-up)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: nla.threads)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: nla,ar,stock,rollout,passes")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    threads = apply_threads(args.threads)
    cfg = RLConfig.from_dict(dict(
        av=args.av, ar=args.ar, dataset=args.dataset, out_dir="/tmp/bench_rl_step", device="cpu", seed=0,
        steps=args.steps + 1, tensorboard=False, progress=False,
        rollout=dict(rollout_batch_size=args.prompts, n_samples_per_prompt=args.samples,
                     max_response_len=args.max_len),
        optimiser=dict(micro_batch_size=args.micro, lr=2e-4), reconstructor=dict(lr=3e-4)))
    data = RLData.load(cfg.dataset)
    groups = build_groups(cfg)
    B, G = args.prompts, args.samples
    print(f"threads {threads}; {B} prompts x {G} samples, cap {args.max_len}, micro-batch {args.micro}, "
          f"{args.steps} counted steps (+1 warm-up); load {open('/proc/loadavg').read().split()[0]}")
    gflops = matmul_gflops()
    print(f"fp32 matmul rate (512^3, this process): {gflops:.1f} GFLOP/s")
    results = {}

    if "nla" not in skip:
        times, facts = defaultdict(list), []
        for s in range(args.steps + 1):
            torch.manual_seed(s)
            rows = torch.arange(s * B, (s + 1) * B) % data.vectors.shape[0]
            t, f = nla_step(groups, cfg, data.vectors[rows], rows)
            if s:
                for k, v in t.items():
                    times[k].append(v)
                facts.append(f)
        tot = [sum(vals) for vals in zip(*times.values(), strict=True)]
        step_s = statistics.median(tot)
        results["nla"] = B * G / step_s
        print(f"\n== nla rl step (median of {args.steps}): {step_s:.2f} s, {results['nla']:.1f} samples/s, "
              f"mean response {statistics.mean(f['mean_len'] for f in facts):.1f} tokens; duplicate rows "
              f"{sum(f['dups'] for f in facts)}/{sum(f['n'] for f in facts)}")
        for k, v in times.items():
            med = statistics.median(v)
            print(f"  {k:<10} {med:7.2f} s  {100 * med / step_s:5.1f}%")
        body = [p for n, p in groups.policy.model.named_parameters() if "embed" not in n]
        n_params = sum(p.numel() for p in body)
        tok = statistics.mean(f["real_tokens"] for f in facts)
        rate = 6 * n_params * tok / statistics.median(times["policy"]) / 1e9
        print(f"  policy update rate: {rate:.1f} GFLOP/s = {100 * rate / gflops:.0f}% of the matmul rate "
              f"(6 x {n_params / 1e6:.2f}M non-embedding params x {tok:.0f} tokens: every row's prompt + real "
              "response, the work of a plain per-row pass)")

    if "ar" not in skip:
        # The AR's work on one rollout (reward on the rollout rows, then the AR update), with the
        # reward window on (the reward forwards backpropagate; the update only steps) and off.
        ro, w = cfg.rollout, groups.reconstructor
        torch.manual_seed(0)
        r = groups.rollout.generate(data.vectors[:B], torch.arange(B), G, ro.max_response_len)
        items = reward_items(r)
        exps, golds = [e for e, _ in items], torch.stack([g for _, g in items]) if items else None
        fused_default, times = w.fuse_reward, defaultdict(list)
        try:
            for rep in range(args.steps + 1):
                for fused in (False, True):
                    w.fuse_reward = fused
                    w.begin_rollout()
                    _, dr = _timed(w.mse_batch, items)
                    _, du = _timed(w.update, exps, golds)
                    if rep:
                        times[fused].append((dr, du))
        finally:
            w.fuse_reward = fused_default
        print(f"\n== AR work on one rollout ({len(items)} rows): reward + AR update, medians of {args.steps}")
        tot = {}
        for fused, label in ((False, "window off (plain)"), (True, "window on (fused)")):
            dr, du = (statistics.median(x[i] for x in times[fused]) for i in (0, 1))
            tot[fused] = statistics.median(a + b for a, b in times[fused])
            print(f"  {label:<19} reward {dr:.3f} s + update {du:.3f} s = {tot[fused]:.3f} s")
        print(f"  plain / fused: {tot[False] / tot[True]:.2f}x")

    if "stock" not in skip:
        from nla.arch import load_tokenizer
        from nla.rl.setup import load_av

        model, _ = load_av(cfg.av, torch.device("cpu"), torch.float32)
        stock = StockGRPO(model, load_tokenizer(cfg.av), groups.rollout.prompt_ids, cfg)
        times = defaultdict(list)
        for s in range(args.steps + 1):
            torch.manual_seed(s)
            t = stock.step(B)
            if s:
                for k, v in t.items():
                    times[k].append(v)
        step_s = statistics.median([sum(v) for v in zip(*times.values(), strict=True)])
        results["stock"] = B * G / step_s
        print(f"\n== stock GRPO step (no AR): {step_s:.2f} s, {results['stock']:.1f} samples/s, "
              f"last mean response {stock.mean_len:.1f} tokens")
        for k, v in times.items():
            print(f"  {k:<10} {statistics.median(v):7.2f} s")
        if "nla" in results:
            print(f"  nla / stock samples/s: {results['nla'] / results['stock']:.2f}x (target >= 1.5x)")

    if "passes" not in skip:
        # The same rollout through the reference and policy passes, fast (shared prefix, trimmed
        # padding, length-ordered micro-batches) and plain (every row's prompt + padded response).
        import nla.rl.workers as W

        ro = cfg.rollout
        torch.manual_seed(0)
        r = groups.rollout.generate(data.vectors[:B], torch.arange(B), G, ro.max_response_len)
        adv = A.broadcast_to_tokens(A.grpo_advantages(torch.randn(r.n), G), r.response_mask.float())
        fast_fn, plain_order = W.response_logprobs, W.by_group_length
        times = defaultdict(list)
        for rep in range(args.steps + 1):
            for mode in ("plain", "fast"):
                if mode == "plain":
                    W.response_logprobs = lambda *a, **kw: fast_fn(*a, **{**kw, "share_prefix": False})
                    W.by_group_length = lambda rollout, rows: torch.arange(len(rows))
                try:
                    ref, dr = _timed(groups.reference.logprobs, r)
                    _, dp = _timed(groups.policy.update, r, adv, ref)
                finally:
                    W.response_logprobs, W.by_group_length = fast_fn, plain_order
                if rep:
                    times[mode, "reference"].append(dr)
                    times[mode, "policy"].append(dp)
        print(f"\n== reference + policy passes on one rollout (mean response {float(r.lengths.float().mean()):.1f} "
              f"of {r.response_ids.shape[1]} columns, prompt {r.prompt_ids.shape[0]} tokens)")
        for part in ("reference", "policy"):
            a, b = statistics.median(times["plain", part]), statistics.median(times["fast", part])
            print(f"  {part:<10} plain {a:.3f} s, fast {b:.3f} s: {a / b:.2f}x")

    if "rollout" not in skip:
        ro, w = cfg.rollout, groups.rollout
        vec = data.vectors[:B]
        rows = torch.arange(B)
        t_nla, t_hf = [], []
        for s in range(args.steps + 1):
            torch.manual_seed(100 + s)
            _, dt = _timed(w.generate, vec, rows, G, ro.max_response_len, ro.temperature, ro.top_p)
            torch.manual_seed(100 + s)
            _, dh = _timed(hf_generate_embeds, w, vec, G, ro.max_response_len, ro, False)
            if s:
                t_nla.append(dt)
                t_hf.append(dh)
        a, b = statistics.median(t_nla), statistics.median(t_hf)
        print(f"\n== rollout, {B * G} samples: RolloutWorker.generate {a:.2f} s, HF generate(inputs_embeds) "
              f"{b:.2f} s: {b / a:.2f}x (target >= 1.5x)")
        g = w.generate(vec, rows, 1, ro.max_response_len, greedy=True)
        h = hf_generate_embeds(w, vec, 1, ro.max_response_len, ro, True)
        same = sum(int(torch.equal(g.response_ids[i, : g.lengths[i]], h[i, : g.lengths[i]])) for i in range(B))
        print(f"  greedy outputs identical to HF generate(inputs_embeds): {same}/{B}")


if __name__ == "__main__":
    main()
