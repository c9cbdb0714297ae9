"""Mixed precision on the CPU (``autocast: bfloat16``, nla.util.precision): what it buys, part by part, in one run.

1. **matmul**: GFLOPS of one ``a @ b`` in fp32 and in bf16 at the shapes nla's models run (the default
   world's d 128 / 344 / vocabulary 1,025; SmolLM2's 576 / 1,536 / 49,152), with oneDNN's cap lifted
   as ``prepare_autocast`` lifts it; and bf16 under the CPU pin's cap (``--pinned``: oneDNN at AVX2,
   where bf16 is emulated), the reason the cap is lifted.
2. **sft**: SmolLM2-135M's warm-start steps (forward + backward, the optimiser excluded) at the smollm2
   preset's sizes: the AR (10 blocks, 16 rows of 70 tokens, the last position read) and the AV (30
   blocks, the LM head on 30 response positions of each row), fp32 and autocast in turn, ``--repeat``
   times each. Needs the SmolLM2 wheel (``make smollm2``); skipped without it.
3. **rl**: ``nla rl`` on a quickstart run's config (``--run``: its AV, AR and data; the world default's
   by default), fp32 and autocast in turn, ``--steps`` counted steps after one warm-up, with the step's
   phases.

Each pair's ratio (autocast / fp32) is of numbers measured in this process, in turn. Prints the
CPU (its model name and whether it has bf16 instructions); a CPU without them is refused by
``prepare_autocast``, and the bench says so and stops.

    python -m bench.bench_autocast [--threads 2] [--parts matmul,sft,rl] [--run RUN] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _rate(m: int, k: int, n: int, dtype, seconds: float = 0.5) -> float:
    import torch

    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


MATMUL_SHAPES = [(128, 128, 128), (2048, 128, 344), (4096, 128, 1025), (1120, 576, 576), (1120, 576, 1536),
                 (480, 576, 49152)]


def part_matmul(pinned: bool) -> list[dict]:
    import torch

    rows = []
    for shape in MATMUL_SHAPES:
        f, b = _rate(*shape, torch.float32), _rate(*shape, torch.bfloat16)
        rows.append({"shape": list(shape), "fp32_gflops": round(f, 1), "bf16_gflops": round(b, 1),
                     "ratio": round(b / f, 2)})
        print(f"  {str(shape):<20} fp32 {f:7.1f}  bf16 {b:7.1f} GFLOPS  ({b / f:.2f}x)", flush=True)
    if pinned:
        print("  (bf16 under the pin's oneDNN cap: see --pinned's own process)")
    return rows


SMOLLM2_AR_BLOCKS = 10  # the smollm2 preset's AR reads block 10


def smollm2_av_and_ar():
    """SmolLM2-135M in fp32 as the smollm2 preset's AV (the whole model) and AR body (its first
    ``SMOLLM2_AR_BLOCKS`` blocks), two separate copies; None where the wheel is not installed."""
    import torch
    from transformers import AutoModelForCausalLM

    from nla.datagen.real_sources import smollm2_dir

    try:
        d = smollm2_dir()
    except Exception as e:  # the wheel is not installed: make smollm2
        print(f"  skipped: SmolLM2 not available ({e})")
        return None
    av = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ar = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).model
    ar.layers = ar.layers[:SMOLLM2_AR_BLOCKS]
    return av, ar


def part_sft(repeat: int) -> dict | None:
    import torch

    from nla.util.precision import keep_heads_fp32

    models = smollm2_av_and_ar()
    if models is None:
        return None
    av, ar = models
    keep_heads_fp32(av)
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (16, 70))

    def av_step(amp: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            h = av.model(input_ids=ids).last_hidden_state[:, 40:]
            lp = torch.log_softmax(av.lm_head(h), -1)
        lp.mean().backward()

    def ar_step(amp: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            h = ar(input_ids=ids).last_hidden_state[:, -1]
        h.float().pow(2).mean().backward()

    out = {}
    for name, fn in (("ar", ar_step), ("av", av_step)):
        times = {False: [], True: []}
        for amp in (False, True) * repeat:
            fn(amp)  # a warm-up of this setting
            t0 = time.perf_counter()
            fn(amp)
            times[amp].append(time.perf_counter() - t0)
        f, b = statistics.median(times[False]), statistics.median(times[True])
        out[name] = {"fp32_s": round(f, 3), "autocast_s": round(b, 3), "speedup": round(f / b, 2)}
        print(f"  {name}: fp32 {f:.3f} s/step, autocast {b:.3f} s/step ({f / b:.2f}x)", flush=True)
    return out


def part_rl(run: str, steps: int, threads: int) -> dict:
    from bench.bench_rl_step import bench_config, loop_steps

    out = {}
    for amp in (None, "bfloat16", None, "bfloat16"):
        a = argparse.Namespace(run=run, av=None, ar=None, dataset=None, steps=steps, threads=threads,
                               set=[] if amp is None else [f"autocast={amp}"])
        s, length = loop_steps(bench_config(a, tempfile.mkdtemp()), f"autocast={amp}")
        out.setdefault(str(amp), []).append({"step_s": round(s, 3), "response_len": round(length, 1)})
    f = statistics.median(r["step_s"] for r in out["None"])
    b = statistics.median(r["step_s"] for r in out["bfloat16"])
    out["speedup"] = round(f / b, 2)
    print(f"  rl step: fp32 {f:.2f} s, autocast {b:.2f} s ({f / b:.2f}x)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="matmul,sft,rl")
    ap.add_argument("--run", default="runs/quickstart-default", help="a finished quickstart run (the rl part)")
    ap.add_argument("--steps", type=int, default=4, help="counted RL steps per setting")
    ap.add_argument("--repeat", type=int, default=3, help="SFT steps per setting")
    ap.add_argument("--pinned", action="store_true", help="matmul only, oneDNN left at the pin's cap (AVX2)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    from nla.util.numerics import cpuinfo_field
    from nla.util.precision import bf16_native, prepare_autocast

    torch.set_num_threads(args.threads)
    cpu = cpuinfo_field("model name")
    print(f"CPU: {cpu}; bf16 instructions: {bf16_native()}; threads {args.threads}")
    if not args.pinned:
        try:
            prepare_autocast("bfloat16", torch.device("cpu"), "bench")
        except ValueError as e:
            sys.exit(f"bench_autocast: {e}")
    print(f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}")
    parts = set(args.parts.split(",")) if not args.pinned else {"matmul"}
    res: dict = {"cpu": cpu, "threads": args.threads, "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA")}
    if "matmul" in parts:
        print("== matmul")
        res["matmul"] = part_matmul(args.pinned)
    if "sft" in parts:
        print("== SmolLM2 warm-start steps")
        res["sft"] = part_sft(args.repeat)
    if "rl" in parts:
        print("== nla rl steps")
        res["rl"] = part_rl(args.run, args.steps, args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
