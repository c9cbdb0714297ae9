"""Where one pair for several blocks spends its training time, against one-block pairs (issue 59).

Reads finished ``nla quickstart`` run directories (nothing is trained again): PAIR, a run with
``datagen.layers``, and ONE, a one-block run for each of its blocks. Prints, as markdown:

- each training stage's seconds (datagen, AR, AV, RL) and the pair's against the one-block pairs' sum;
- the AV's steps, seconds a step and the tokens a batch of its training rows runs (prompt + response +
  EOS, padded to the batch's longest row, as ``nla.train.av.collate`` pads): the pair's step runs its blocks'
  rows mixed, and each row's prompt names its block;
- RL's time split (``rl.jsonl``'s ``time_generate`` / ``time_reward`` / ``time_policy`` / ``time_ar``): the AR
  that scores and trains on a pair's rollouts keeps blocks 0..K of the deepest block K for every row.

    python -m dev.experiments.layers_cost PAIR ONE [ONE ...] [--batches 150]

The padded lengths are of ``--batches`` random batches of the AV's batch size drawn from each run's
``datagen/av_sft.parquet`` (seeded), tokenized by the run's final AV checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import yaml

STAGES = ("datagen", "ar", "av", "rl")
RL_PARTS = ("time_generate", "time_reward", "time_policy", "time_ar")


def stage_seconds(run: Path) -> dict[str, float]:
    out = {}
    for s in STAGES:
        f = run / f"{s}.stage_done.json"
        if not f.is_file():
            raise SystemExit(f"{run}: no {f.name}; give finished quickstart run directories")
        out[s] = float(json.loads(f.read_text())["seconds"])
    return out


def av_tokens(run: Path, batches: int) -> dict[str, float]:
    """Mean prompt / response tokens a row and the mean padded length of a random batch."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from nla.train.av import build_examples

    ckpt = sorted((run / "av" / "checkpoints").glob("step_*"))[-1]
    cfg = yaml.safe_load((ckpt / "train_config.yaml").read_text())
    meta = yaml.safe_load((ckpt / "nla_meta.yaml").read_text())
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    tab = pq.read_table(run / "datagen" / "av_sft.parquet", columns=["prompt", "response"])
    ex = build_examples(tok, tab.column("prompt").to_pylist(), tab.column("response").to_pylist(),
                        meta["tokens"]["injection_char"], int(cfg["max_length"]), "av_sft")
    p = np.array([len(e.prompt_ids) for e in ex])
    r = np.array([len(e.response_ids) for e in ex])
    b = int(cfg["batch_size"])
    rng = np.random.default_rng(0)
    lengths = p + r
    padded = [lengths[rng.choice(len(ex), b, replace=False)].max() for _ in range(batches)]
    return {"prompt": float(p.mean()), "response": float(r.mean()), "row": float(lengths.mean()),
            "padded": float(np.mean(padded)), "steps": int(cfg["max_steps"])}


def rl_split(run: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run / "rl" / "rl.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "time_step" in r]
    return {"steps": len(steps), **{k: sum(float(r.get(k, 0.0)) for r in steps) for k in (*RL_PARTS, "time_step")}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", type=Path)
    ap.add_argument("ones", type=Path, nargs="+")
    ap.add_argument("--batches", type=int, default=150)
    a = ap.parse_args(argv)
    runs = [a.pair, *a.ones]
    secs = {r: stage_seconds(r) for r in runs}
    toks = {r: av_tokens(r, a.batches) for r in runs}
    rl = {r: rl_split(r) for r in runs}
    names = {r: r.name for r in runs}
    one_sum = {s: sum(secs[r][s] for r in a.ones) for s in STAGES}
    print("| stage | " + " | ".join(names[r] for r in a.ones) + " | one-block sum | " + names[a.pair] + " | pair / sum |")
    print("|---|" + "---|" * (len(a.ones) + 3))
    for s in (*STAGES, "total"):
        val = (lambda r: sum(secs[r].values())) if s == "total" else (lambda r, s=s: secs[r][s])
        tot = sum(one_sum.values()) if s == "total" else one_sum[s]
        print(f"| {s} s | " + " | ".join(f"{val(r):.0f}" for r in a.ones) + f" | {tot:.0f} | {val(a.pair):.0f} | "
              f"{val(a.pair) / tot:.2f}× |")
    print()
    print("| AV | " + " | ".join(names[r] for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    print("| steps | " + " | ".join(str(toks[r]["steps"]) for r in runs) + " |")
    print("| seconds a step | " + " | ".join(f"{secs[r]['av'] / toks[r]['steps']:.3f}" for r in runs) + " |")
    for k in ("prompt", "response", "row", "padded"):
        print(f"| {k} tokens | " + " | ".join(f"{toks[r][k]:.1f}" for r in runs) + " |")
    mean_step = np.mean([secs[r]["av"] / toks[r]["steps"] for r in a.ones])
    mean_pad = np.mean([toks[r]["padded"] for r in a.ones])
    print(f"\nAV, pair against the one-block mean: seconds a step {secs[a.pair]['av'] / toks[a.pair]['steps'] / mean_step:.2f}×, "
          f"padded tokens a batch {toks[a.pair]['padded'] / mean_pad:.2f}×")
    print()
    print("| RL seconds | " + " | ".join(names[r] for r in a.ones) + " | one-block sum | " + names[a.pair] + " | pair / sum |")
    print("|---|" + "---|" * (len(a.ones) + 3))
    for k in (*RL_PARTS, "time_step"):
        tot = sum(rl[r][k] for r in a.ones)
        print(f"| {k} | " + " | ".join(f"{rl[r][k]:.1f}" for r in a.ones) + f" | {tot:.1f} | {rl[a.pair][k]:.1f} | "
              f"{rl[a.pair][k] / tot:.2f}× |")
    print("| steps | " + " | ".join(str(rl[r]["steps"]) for r in a.ones) + f" | {sum(rl[r]['steps'] for r in a.ones)} | "
          f"{rl[a.pair]['steps']} | |")


if __name__ == "__main__":
    main()
