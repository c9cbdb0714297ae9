"""`nla rl` against TRL's GRPOTrainer at equal, stated thread counts, interleaved, pair by pair (issue 60).

Both trainers get the same AV, chat prompt, batch (prompts x samples), response cap, micro-batch,
KL (k3, the same coefficient), learning rate and clip range: those of a quickstart run's RL stage
(``--run``: its ``rl/rl_config.yaml``, so the world's default or the SmolLM2 preset). nla runs its
own loop (``nla.rl.loop.run_rl``: rollout with the vector injected, the AR's reward on every
sample, the policy update, the AR update with its replay rows); TRL scores with a seeded-noise
reward and has no AR work, so every figure here counts the AR's work against nla.

Each measurement is a fresh process (``--child``) with torch, OpenMP and MKL all set to the same
thread count, so no thread pool carries over from one trainer to the other, and the order of the
two alternates from pair to pair (nla first, then TRL first, ...). A pair's ratios are taken
within the pair; the summary gives every pair's ratio and their median. The first optimiser step
of every process is a warm-up and is not counted.

Printed per pair: each trainer's matmul work per response token (``work_model``: the models' sizes and
the token counts measured), their ratio (what the tokens/s ratio would be at equal matmul rates: the
bound the issue's target meets at this prompt length and response length), and each trainer's achieved
GFLOP/s. Printed per trainer: seconds per step, samples/s, response tokens/s (each trainer's own responses:
TRL's AV writes without its vector, so its lengths differ), and the split of the step:
nla's ``time_generate / time_reward / time_policy / time_ar`` from its metrics; TRL's generation
(``GRPOTrainer._generate``), the rest of its rollout (``_generate_and_score_completions`` less the
generation: the reward and the reference log-probs) and the update (the rest of the step).

    python -m bench.bench_rl_vs_trl --run RUN [--threads 1 2] [--pairs 2] [--steps 4] [--json OUT]

Both run the same AdamW: torch's default loop (TRL ``optim="adamw_torch"``), or with ``--set adamw=fused`` the
fused kernel (``"adamw_torch_fused"``, transformers' own default, which the runs before 2026-12-07 gave TRL
while nla ran the loop). With ``--set autocast=bfloat16`` both run mixed precision: nla its ``autocast`` (nla.util.precision), TRL
``GRPOConfig(bf16=True)`` (accelerate's autocast), each with oneDNN's cap lifted.

Needs TRL (``pip install -e '.[bench]'``; Python >= 3.11).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_MARK = "BENCH_RL_VS_TRL "


def child_nla(args: argparse.Namespace) -> dict:
    """``run_rl`` on the run's RL config for ``steps + 1`` steps; medians over the counted steps."""
    from bench.bench_rl_step import bench_config
    from nla.rl.loop import run_rl

    cfg = bench_config(args, tempfile.mkdtemp(prefix="bench_rl_vs_trl_"))
    res = run_rl(cfg)
    rows = [json.loads(line) for line in (res.out_dir / "rl.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time_step" in r][1:]
    n = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    step_s = statistics.median(r["time_step"] for r in rows)
    mean_len = statistics.mean(r["response_len"] for r in rows)
    phases = {k[5:]: statistics.median(r[k] for r in rows) for k in ("time_generate", "time_reward", "time_policy",
                                                                     "time_ar")}
    ar_rows = statistics.mean(r.get("ar_rows", n) for r in rows)  # the AR update's rows (with replay)
    return dict(step_s=step_s, samples=n, mean_len=mean_len, phases=phases, steps=len(rows), ar_rows=ar_rows)


def child_trl(args: argparse.Namespace) -> dict:
    """TRL's GRPOTrainer (``bench.bench_rl_step.trl_grpo_steps``) with its phases timed."""
    from trl import GRPOTrainer

    from bench.bench_rl_step import bench_config, trl_grpo_steps

    spans: dict[str, list[float]] = {"generate": [], "rollout": []}

    def timed(name: str, fn):
        def wrapper(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                spans[name].append(time.perf_counter() - t0)
        return wrapper

    GRPOTrainer._generate = timed("generate", GRPOTrainer._generate)
    GRPOTrainer._generate_and_score_completions = timed("rollout", GRPOTrainer._generate_and_score_completions)
    cfg = bench_config(args, tempfile.mkdtemp(prefix="bench_rl_vs_trl_"))
    step_s, mean_len, _ = trl_grpo_steps(cfg, args.steps, args.threads)
    # one generation per optimiser step (the whole rollout, then its micro-batches): drop the warm-up's
    gen, roll = spans["generate"][1:], spans["rollout"][1:]
    if len(roll) != args.steps:
        raise SystemExit(f"trl: expected one rollout per optimiser step ({args.steps}), found {len(roll)}")
    g, r = statistics.median(gen), statistics.median(roll)
    n = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return dict(step_s=step_s, samples=n, mean_len=mean_len,
                phases={"generate": g, "reward + reference": r - g, "update": step_s - r}, steps=args.steps)


def run_child(which: str, args: argparse.Namespace, threads: int) -> dict:
    """One trainer in a fresh process at ``threads`` threads; its result dict."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "OPENBLAS_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "bench.bench_rl_vs_trl", "--child", which, "--run", args.run, "--threads",
           str(threads), "--steps", str(args.steps)] + [x for s in args.set for x in ("--set", s)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(CHILD_MARK)]
    if out.returncode or not lines:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"{which} at {threads} thread(s) failed (exit {out.returncode})")
    res = json.loads(lines[-1][len(CHILD_MARK):])
    res["wall_s"] = time.perf_counter() - t0
    return res


def _numels(checkpoint: str) -> dict[str, int]:
    """Tensor name -> element count of a checkpoint's ``model.safetensors`` (its header only)."""
    from safetensors import safe_open

    with safe_open(str(Path(checkpoint) / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_shape()[0] * max(1, _prod(f.get_slice(k).get_shape()[1:])) for k in f.keys()}


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def work_model(args: argparse.Namespace, nla: dict, trl: dict) -> dict:
    """Each trainer's matmul work per step (GFLOP), from the models' sizes and the token counts measured.

    Forward work is 2 x parameters x tokens (attention's score products left out: at these lengths a few
    per cent), a backward twice the forward. Both trainers: generation (1 forward), the reference (1) and
    the policy (forward + backward: 3), the LM head at response positions only. TRL runs every sample's
    prompt (P tokens) through all five; nla runs a group's prompt once (``nla.rl.kernels``) and adds the
    AR's work: forward + backward on ``ar_rows`` rows (the rollout's and the replayed), each the AR's
    prompt template around the explanation; the rollout rows' reward forward is that forward (the
    reward window, ``FusedRewardWindow``, the default of a local AR without dropout). So
    ``trl_gflop_per_token / nla_gflop_per_token`` is the tokens/s ratio the two would reach at the
    same matmul rate; the achieved rates (GFLOP/s) say how far each is from it.
    """
    from bench.bench_rl_step import bench_config
    from nla.core.arch import load_tokenizer
    from nla.core.sidecar import SIDECAR_NAME, load_sidecar
    from nla.core.token_ids import canonical_av_prompt_ids

    cfg = bench_config(args, tempfile.mkdtemp(prefix="bench_rl_vs_trl_"))
    av, ar = _numels(cfg.av), _numels(cfg.ar)
    embed = next(v for k, v in av.items() if k.endswith("embed_tokens.weight"))
    head = av.get("lm_head.weight", embed)  # tied: the embedding is the head
    body_av = sum(av.values()) - embed - av.get("lm_head.weight", 0)
    body_ar = sum(v for k, v in ar.items() if not k.endswith("embed_tokens.weight"))
    tok = load_tokenizer(cfg.av)
    side = load_sidecar(Path(cfg.av) / SIDECAR_NAME)
    P = len(canonical_av_prompt_ids(tok, side.av_messages()))
    ar_side = load_sidecar(Path(cfg.ar) / SIDECAR_NAME)
    ar_template = len(load_tokenizer(cfg.ar)(ar_side.ar_text(""))["input_ids"])
    B, N = cfg.rollout.rollout_batch_size, nla["samples"]
    Rn, Rt = nla["mean_len"], trl["mean_len"]
    A = ar_template + Rn
    ar_rows = nla.get("ar_rows", N)
    nla_w = 2e-9 * (body_av * 5 * (B * P + N * Rn) + head * 5 * N * Rn + body_ar * 3 * ar_rows * A)
    trl_w = 2e-9 * (body_av * 5 * N * (P + Rt) + head * 5 * N * Rt)
    out = dict(prompt_tokens=P, ar_tokens=A, ar_rows=ar_rows, body_params=body_av, head_params=head,
               ar_body_params=body_ar, nla_gflop=nla_w, trl_gflop=trl_w,
               nla_mflop_per_token=1e3 * nla_w / (N * Rn), trl_mflop_per_token=1e3 * trl_w / (N * Rt),
               nla_gflops=nla_w / nla["step_s"], trl_gflops=trl_w / trl["step_s"])
    out["work_ratio"] = out["trl_mflop_per_token"] / out["nla_mflop_per_token"]
    return out


def describe(name: str, r: dict) -> str:
    sps = r["samples"] / r["step_s"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
    return (f"  {name:<4} {r['step_s']:.2f} s/step, {sps:.1f} samples/s, {sps * r['mean_len']:.0f} response tokens/s "
            f"(mean response {r['mean_len']:.1f}); {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/quickstart-default", help="a quickstart run dir (its RL config and pair)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts, each given to both")
    ap.add_argument("--pairs", type=int, default=2, help="interleaved (nla, TRL) pairs per thread count")
    ap.add_argument("--steps", type=int, default=4, help="counted optimiser steps per process (after one warm-up)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="RL config override (repeatable)")
    ap.add_argument("--json", metavar="FILE", help="also write every pair's figures as JSON")
    ap.add_argument("--child", choices=["nla", "trl"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.av = args.ar = args.dataset = None  # bench_rl_step.bench_config's optional overrides
    if args.child:
        from nla.util.threads import apply_threads

        args.threads = args.threads[0]
        apply_threads(args.threads)
        res = child_nla(args) if args.child == "nla" else child_trl(args)
        print(CHILD_MARK + json.dumps(res), flush=True)
        return
    try:
        import trl  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"TRL is not installed ({err}): pip install -e '.[bench]' (Python >= 3.11)") from None
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"{cpu}; {os.cpu_count()} cores; load {open('/proc/loadavg').read().split()[0]}; run {args.run}")
    report: dict = {"cpu": cpu, "run": args.run, "steps": args.steps, "pairs": []}
    for threads in args.threads:
        ratios = []
        print(f"\n== {threads} thread(s) each, {args.pairs} interleaved pairs, {args.steps} counted steps per process")
        for p in range(args.pairs):
            order = ("nla", "trl") if p % 2 == 0 else ("trl", "nla")
            res = {w: run_child(w, args, threads) for w in order}
            a, b = res["nla"], res["trl"]
            s_ratio = (a["samples"] / a["step_s"]) / (b["samples"] / b["step_s"])
            t_ratio = s_ratio * a["mean_len"] / b["mean_len"]
            ratios.append((s_ratio, t_ratio))
            print(f" pair {p + 1} ({' then '.join(order)}): nla / TRL samples/s {s_ratio:.2f}x, response tokens/s "
                  f"{t_ratio:.2f}x")
            print(describe("nla", a))
            print(describe("TRL", b))
            w = work_model(args, a, b)
            print(f"  work per response token (matmuls): nla {w['nla_mflop_per_token']:.0f} MFLOP (AR's included), "
                  f"TRL {w['trl_mflop_per_token']:.0f}: {w['work_ratio']:.2f}x, the tokens/s ratio at equal matmul "
                  f"rates; achieved nla {w['nla_gflops']:.0f}, TRL {w['trl_gflops']:.0f} GFLOP/s (prompt "
                  f"{w['prompt_tokens']} tokens, AR rows {w['ar_rows']:.0f} of {w['ar_tokens']:.0f} tokens)")
            report["pairs"].append(dict(threads=threads, order=order, nla=a, trl=b, samples_ratio=s_ratio,
                                        tokens_ratio=t_ratio, work=w))
        s_med = statistics.median(r[0] for r in ratios)
        t_med = statistics.median(r[1] for r in ratios)
        print(f" {threads} thread(s): nla / TRL samples/s {', '.join(f'{r[0]:.2f}' for r in ratios)} (median "
              f"{s_med:.2f}x); tokens/s {', '.join(f'{r[1]:.2f}' for r in ratios)} (median {t_med:.2f}x; "
              "issue 60's target >= 2x)")
    report["load_after"] = float(open("/proc/loadavg").read().split()[0])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
