"""One `nla rl` step, broken down, against a stock GRPO loop, TRL's GRPOTrainer and HF generate, in one run.

Every measurement uses the same AV/AR pair, prompts, batch, response cap, micro-batch, KL and
learning rate: those of a quickstart run's RL stage (``--run``, default
``runs/quickstart-default``, read from its ``rl/rl_config.yaml``), so the numbers are those of
the configuration users run. Parts (``--skip`` any of them):

1. **loop**: ``nla.rl.loop.run_rl`` itself for ``--steps`` + 1 steps on that config (eval off,
   its own checkpoint write excluded): the loop's ``time_step`` per step, i.e. rollout, reward
   service, format checks, metrics, reference, policy update, AR update with replay rows, and
   weight sync. samples/s over the step is the issue's headline.
2. **nla**: the same roles driven by hand (generate -> reward with the AR reward window ->
   reference -> policy -> AR step), timed per phase; the breakdown behind the loop's figure
   (no replay rows, no metrics). The duplicate share is the share of rows whose (prompt,
   response tokens) repeat an earlier row of their rollout.
3. **stock**: a plain HF/torch GRPO loop with no AR work: ``model.generate(input_ids)`` on the
   same prompt (no injection), a trivial reward that ignores the text (seeded noise: a reward
   that favoured short answers shrank its responses from 45 to 38 tokens within the counted
   steps and flattered it), GRPO advantages, reference forward and a padded policy
   forward/backward per micro-batch with the same loss (clip + k3 KL), AdamW.
4. **trl**: TRL's ``GRPOTrainer`` (the off-the-shelf GRPO trainer; ``pip install -e '.[bench]'``)
   on the same AV, chat prompt, G, batch (micro-batch x accumulation), cap, KL (k3), learning
   rate, token-level loss (``dapo``) and the same seeded-noise reward; the wall time of each
   optimiser step from a trainer callback (generation, reference and policy all happen inside).
5. **rollout vs HF**: ``RolloutWorker.generate`` against ``model.generate(inputs_embeds=...)``
   with the vector injected into the embeddings by hand, same batch and sampling settings
   (target >= 1.5x); greedy outputs of the two are compared as a sanity check.
6. **passes**: the reference and policy passes on one rollout, fast (shared prompt prefix,
   trimmed padding, length-ordered micro-batches, length buckets, LM head at real positions
   only) against plain (every row's prompt and padded response), the same code otherwise.
7. **ar**: the AR's work on one rollout (reward, then AR update) with the reward window off
   and on (``ReconstructorWorker.fuse_reward``).
8. **loopthread** (last): the loop again with the reward service scoring on its own thread,
   as it did before a local CPU AR scored inline (``nla.rl.loop.scores_inline``).

The loop, stock and TRL trainers generate their own responses (the AV writes differently
without its vector), so the summary gives response tokens/s ratios beside samples/s.
Also printed: the policy update's rate (6 x non-embedding params x (prompt + real response
tokens of every row) per second, i.e. the work a plain per-row pass does) as a share of the
fp32 matmul rate measured in this process (target >= 60%).
The first step of each loop is a warm-up and is not counted.

    python -m bench.bench_rl_step [--run runs/quickstart-default] [--steps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from nla.core.arch import load_tokenizer
from nla.core.sidecar import SIDECAR_NAME, load_sidecar
from nla.core.token_ids import canonical_av_prompt_ids
from nla.rl import algorithms as A
from nla.rl.backend import build_groups
from nla.rl.config import RLConfig, load_rl_config
from nla.rl.loop import RLData, fill_rewards, reward_items, run_rl
from nla.rl.setup import load_av
from nla.util.overrides import parse_overrides
from nla.util.threads import apply_threads


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
    scored = groups.reconstructor.mse_batch(items).tolist() if items else []
    fill_rewards(r, scored, cfg, groups.ar_sidecar.mse_scale_value())  # as the loop makes rewards
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
        self.noise = torch.Generator().manual_seed(0)  # the trivial reward's own stream

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
        # Trivial reward that ignores the text: it leaves the response length where the model puts it.
        rewards = torch.randn(resp.shape[0], generator=self.noise)
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


def trl_grpo_steps(cfg: RLConfig, steps: int, threads: int) -> tuple[float, float, int]:
    """TRL ``GRPOTrainer`` on the AV's chat prompt with ``cfg``'s batch, G, cap, micro-batch, KL,
    lr and clip range, a seeded-noise reward and token-level loss: (median seconds per optimiser
    step after one warm-up step, mean completion length, prompt tokens). Raises ImportError
    without TRL."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    for name in ("trl", "transformers", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ro, op, lo = cfg.rollout, cfg.optimiser, cfg.loss
    B, G, N = ro.rollout_batch_size, ro.n_samples_per_prompt, ro.rollout_batch_size * ro.n_samples_per_prompt
    if N % op.micro_batch_size:
        raise SystemExit(f"trl: the rollout ({N} samples) must be a multiple of the micro-batch ({op.micro_batch_size})")
    tok = load_tokenizer(cfg.av)
    messages = load_sidecar(Path(cfg.av) / SIDECAR_NAME).av_messages()
    noise = torch.Generator().manual_seed(0)
    # autocast: TRL's own mixed precision (accelerate's bf16: torch.autocast on the CPU), with oneDNN's cap
    # lifted as nla lifts it, so both trainers run the same bf16 kernels
    from nla.util.precision import prepare_autocast

    prepare_autocast(cfg.autocast, torch.device("cpu"), "autocast")

    def reward(prompts, completions, **_kw):  # ignores the text, like the stock loop's
        return torch.randn(len(completions), generator=noise).tolist()

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t0, self.times = 0.0, []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"), max_steps=steps + 1, use_cpu=True, bf16=cfg.autocast == "bfloat16",
        per_device_train_batch_size=op.micro_batch_size, gradient_accumulation_steps=N // op.micro_batch_size,
        num_generations=G, max_completion_length=ro.max_response_len, temperature=ro.temperature, top_p=ro.top_p,
        top_k=0, beta=lo.kl_coef, epsilon=lo.eps_low, epsilon_high=lo.eps_high, loss_type="dapo",
        learning_rate=op.lr, lr_scheduler_type="constant", weight_decay=op.weight_decay,
        max_grad_norm=op.max_grad_norm, report_to=[], logging_steps=1, save_strategy="no", shuffle_dataset=False,
        # nla's ``adamw``: torch's default (the per-parameter loop on a CPU) or the fused kernel, which is
        # transformers' default; named here so both trainers run the same optimiser
        optim="adamw_torch_fused" if cfg.adamw == "fused" else "adamw_torch",
        disable_tqdm=True, dataloader_num_workers=0, seed=cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(cfg.av, dtype=torch.float32)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok, callbacks=[timer],
                          train_dataset=Dataset.from_list([{"prompt": messages}] * (B * (steps + 1))))
    torch.set_num_threads(threads)
    trainer.train()
    lens = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    P = len(canonical_av_prompt_ids(tok, messages))
    return statistics.median(timer.times[1:]), statistics.mean(lens[1:]), P


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


def bench_config(args: argparse.Namespace, out_dir: str) -> RLConfig:
    """The quickstart run's RL config (``--run``), with ``--av/--ar/--dataset`` and ``--set`` on
    top; eval off, fixed threads, metrics every step, one checkpoint at the end."""
    saved = Path(args.run) / "rl" / "rl_config.yaml"
    if not saved.exists():
        raise SystemExit(f"{saved} not found: run `make quickstart` first (it writes runs/quickstart-default), "
                         "or pass --run DIR of a finished quickstart run")
    over: dict = {k: v for k in ("av", "ar", "dataset") if (v := getattr(args, k))}
    over.update(out_dir=out_dir, steps=args.steps + 1, eval_dataset=None, tensorboard=False, progress=False,
                threads=args.threads, device="cpu", log_every=1, **{"checkpointing.save_every": args.steps + 1})
    over.update(parse_overrides(args.set))
    return load_rl_config(saved, overrides=over)


def loop_steps(cfg: RLConfig, label: str) -> tuple[float, float]:
    """``run_rl(cfg)``; prints its phases; returns (median step seconds, mean response length)
    over the steps after the first."""
    res = run_rl(cfg)
    rows = [json.loads(line) for line in (res.out_dir / "rl.jsonl").read_text().splitlines()][1:]
    step_s = statistics.median(r["time_step"] for r in rows)
    mean_len = statistics.mean(r["response_len"] for r in rows)
    print(f"\n== {label}, median of {len(rows)} steps): {step_s:.2f} s, "
          f"{cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt / step_s:.1f} samples/s, "
          f"mean response {mean_len:.1f} tokens")
    for k in ("time_generate", "time_reward", "time_policy", "time_ar"):
        med = statistics.median(r[k] for r in rows)
        print(f"  {k[5:]:<10} {med:7.2f} s  {100 * med / step_s:5.1f}%")
    return step_s, mean_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/quickstart-default",
                    help="a quickstart run dir: its RL config, warm-start pair and RL data (default %(default)s)")
    ap.add_argument("--av", help="AV dir (default: the run's)")
    ap.add_argument("--ar", help="AR dir (default: the run's)")
    ap.add_argument("--dataset", help="RL parquet (default: the run's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="RL config override, e.g. --set optimiser.micro_batch_size=32 (repeatable)")
    ap.add_argument("--steps", type=int, default=3, help="counted steps per loop (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every part (default %(default)s)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures (samples/s, tokens/s, ratios) as JSON")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: loop,nla,ar,stock,trl,rollout,passes,loopthread")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tmp = tempfile.mkdtemp(prefix="bench_rl_step_")
    cfg = bench_config(args, tmp)
    threads = apply_threads(args.threads)
    data = RLData.load(cfg.dataset)
    ro, op = cfg.rollout, cfg.optimiser
    B, G = ro.rollout_batch_size, ro.n_samples_per_prompt
    print(f"threads {threads}; {B} prompts x {G} samples, cap {ro.max_response_len}, micro-batch "
          f"{op.micro_batch_size}, KL {cfg.loss.kl_estimator} {cfg.loss.kl_coef}, lr {op.lr}; {args.steps} counted "
          f"steps (+1 warm-up); load {open('/proc/loadavg').read().split()[0]}\nAV {cfg.av}\nAR {cfg.ar}")
    gflops = matmul_gflops()
    print(f"fp32 matmul rate (512^3, this process): {gflops:.1f} GFLOP/s")
    results, tokens = {}, {}  # samples/s and response tokens/s per trainer
    extra: dict[str, float] = {"matmul_gflops": gflops}

    if "loop" not in skip:
        step_s, mean_len = loop_steps(cfg, "nla rl loop (run_rl")
        results["loop"], tokens["loop"] = B * G / step_s, B * G * mean_len / step_s
        apply_threads(args.threads)

    groups = None if {"nla", "ar", "passes", "rollout"} <= skip else build_groups(cfg)

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
        print(f"\n== nla step by hand, by phase (median of {args.steps}): {step_s:.2f} s, {B * G / step_s:.1f} "
              f"samples/s, mean response {statistics.mean(f['mean_len'] for f in facts):.1f} tokens; duplicate rows "
              f"{sum(f['dups'] for f in facts)}/{sum(f['n'] for f in facts)}")
        for k, v in times.items():
            med = statistics.median(v)
            print(f"  {k:<10} {med:7.2f} s  {100 * med / step_s:5.1f}%")
        body = [p for n, p in groups.policy.model.named_parameters() if "embed" not in n]
        n_params = sum(p.numel() for p in body)
        tok = statistics.mean(f["real_tokens"] for f in facts)
        rate = 6 * n_params * tok / statistics.median(times["policy"]) / 1e9
        extra["policy_rate_share"] = rate / gflops
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

    prompt_ids = torch.tensor(canonical_av_prompt_ids(load_tokenizer(cfg.av), load_sidecar(
        Path(cfg.av) / SIDECAR_NAME).av_messages()))

    if "stock" not in skip:
        model, _ = load_av(cfg.av, torch.device("cpu"), torch.float32)
        stock = StockGRPO(model, load_tokenizer(cfg.av), prompt_ids, cfg)
        times, lens = defaultdict(list), []
        for s in range(args.steps + 1):
            torch.manual_seed(s)
            t = stock.step(B)
            if s:
                for k, v in t.items():
                    times[k].append(v)
                lens.append(stock.mean_len)
        step_s = statistics.median([sum(v) for v in zip(*times.values(), strict=True)])
        results["stock"], tokens["stock"] = B * G / step_s, B * G * statistics.mean(lens) / step_s
        print(f"\n== stock GRPO loop (no AR, median of {args.steps}): {step_s:.2f} s, {results['stock']:.1f} "
              f"samples/s, mean response {statistics.mean(lens):.1f} tokens")
        for k, v in times.items():
            print(f"  {k:<10} {statistics.median(v):7.2f} s")
        del stock, model

    if "trl" not in skip:
        try:
            trl_step = trl_grpo_steps(cfg, args.steps, args.threads)
        except ImportError as err:
            print(f"\n== TRL GRPOTrainer: skipped ({err}; pip install -e '.[bench]')")
        else:
            step_s, mean_len, P_trl = trl_step
            results["trl"], tokens["trl"] = B * G / step_s, B * G * mean_len / step_s
            print(f"\n== TRL GRPOTrainer (no AR, median of {args.steps}): {step_s:.2f} s, {results['trl']:.1f} "
                  f"samples/s, mean response {mean_len:.1f} tokens (prompt {P_trl} tokens, nla's {len(prompt_ids)})")
        apply_threads(args.threads)

    if "passes" not in skip:
        # The same rollout through the reference and policy passes, fast (shared prefix, trimmed
        # padding, length-ordered micro-batches) and plain (every row's prompt + padded response).
        import nla.rl.kernels as K
        import nla.rl.roles.policy as P

        ro = cfg.rollout
        torch.manual_seed(0)
        r = groups.rollout.generate(data.vectors[:B], torch.arange(B), G, ro.max_response_len)
        adv = A.broadcast_to_tokens(A.grpo_advantages(torch.randn(r.n), G), r.response_mask.float())
        fast_fn, plain_order = K.response_logprobs, K.by_group_length
        times = defaultdict(list)
        for rep in range(args.steps + 1):
            for mode in ("plain", "fast"):
                if mode == "plain":  # in both modules that call them (the kernels and the policy role)
                    for mod in (K, P):
                        mod.response_logprobs = lambda *a, **kw: fast_fn(*a, **{**kw, "share_prefix": False})
                        mod.by_group_length = lambda rollout, rows: torch.arange(len(rows))
                try:
                    ref, dr = _timed(groups.reference.logprobs, r)
                    _, dp = _timed(groups.policy.update, r, adv, ref)
                finally:
                    for mod in (K, P):
                        mod.response_logprobs, mod.by_group_length = fast_fn, plain_order
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
        extra["rollout_vs_hf"] = b / a
        print(f"\n== rollout, {B * G} samples: RolloutWorker.generate {a:.2f} s, HF generate(inputs_embeds) "
              f"{b:.2f} s: {b / a:.2f}x (target >= 1.5x)")
        g = w.generate(vec, rows, 1, ro.max_response_len, greedy=True)
        h = hf_generate_embeds(w, vec, 1, ro.max_response_len, ro, True)
        same = sum(int(torch.equal(g.response_ids[i, : g.lengths[i]], h[i, : g.lengths[i]])) for i in range(B))
        print(f"  greedy outputs identical to HF generate(inputs_embeds): {same}/{B}")

    if "loopthread" not in skip:
        # Last: once a second thread has run torch ops its OpenMP team may outlive it.
        import nla.rl.loop as loop_module

        inline = loop_module.scores_inline
        loop_module.scores_inline = lambda groups: False
        try:
            cfg_thread = cfg.replace(out_dir=tempfile.mkdtemp(prefix="bench_rl_step_thread_"))
            step_t, _ = loop_steps(cfg_thread, "nla rl loop with the reward service on its own thread (as before")
        finally:
            loop_module.scores_inline = inline
        if "loop" in results:
            extra["inline_vs_thread"] = step_t / (B * G / results["loop"])
            print(f"  inline (the default for a local CPU AR) / own thread, step time: "
                  f"{step_t / (B * G / results['loop']):.2f}x faster")

    if "loop" in results:
        print("\n== summary: nla rl loop (AR reward + AR update included) against trainers without AR work")
        for other, label in (("stock", "stock GRPO loop"), ("trl", "TRL GRPOTrainer")):
            if other in results:
                print(f"  vs {label:<16} samples/s {results['loop'] / results[other]:.2f}x, response tokens/s "
                      f"{tokens['loop'] / tokens[other]:.2f}x (target >= 1.5x)")
    if args.json:
        ratios = {f"loop_vs_{o}_{kind}": src["loop"] / src[o] for o in ("stock", "trl") if o in results
                  and "loop" in results for kind, src in (("samples", results), ("tokens", tokens))}
        Path(args.json).write_text(json.dumps(dict(
            threads=threads, load=float(open("/proc/loadavg").read().split()[0]), config=cfg.to_dict(),
            samples_per_s=results, response_tokens_per_s=tokens, ratios=ratios, **extra), indent=2))


if __name__ == "__main__":
    main()
