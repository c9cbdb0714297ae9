"""Training state held by the AV roles: full fine-tuning vs LoRA, measured on built RL roles.

Builds the local backend's roles (policy, reference, rollout) for one RL step and counts, after
the step, the distinct parameter storages of the three roles (the rollout shares the policy;
full fine-tuning keeps a reference copy, LoRA reads the same module with its adapters off),
the buffers, Adam's state, and one gradient per trainable value (the step's peak)
(``nla.lora.held_state_bytes``). Ratios are full ÷ LoRA, from the same run.

    .venv/bin/python bench/bench_lora_memory.py                       # the RL test's tiny config (d=64)
    .venv/bin/python bench/bench_lora_memory.py --from-run runs/quickstart-default --ranks 4,16
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rl_backends import build_pair, run_config  # noqa: E402

from nla.lora import held_state_bytes  # noqa: E402
from nla.rl.backend import build_groups  # noqa: E402
from nla.rl.config import RLConfig  # noqa: E402
from nla.rl.loop import run_rl  # noqa: E402


def held(cfg: RLConfig) -> dict[str, int]:
    groups = build_groups(cfg)
    try:
        run_rl(cfg, groups=groups)
        return held_state_bytes([groups.policy.model, groups.reference.model, groups.rollout.model],
                                [groups.policy.opt])
    finally:
        groups.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-run", type=Path, default=None, help="a quickstart run dir (its RL stage's AV)")
    ap.add_argument("--ranks", default="4,16", help="LoRA ranks to measure")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="nla-bench-lora-") as tmp:
        root = Path(tmp)
        if args.from_run is not None:
            def cfg_for(name: str, **kw) -> RLConfig:
                return run_config(args.from_run.resolve(), root / name, "local", 1).replace(**kw)
            what = f"{args.from_run} (its RL stage's AV)"
        else:
            pair = build_pair(root)

            def cfg_for(name: str, **kw) -> RLConfig:
                return RLConfig.from_dict(dict(
                    **pair, out_dir=str(root / name), steps=1, eval_every=10_000, tensorboard=False, progress=False,
                    threads=1, rollout=dict(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=24),
                    checkpointing=dict(save_every=10_000))).replace(**kw)
            what = "the RL test's tiny config (world tiny subject, d=64)"
        rows = {"full": held(cfg_for("full"))}
        for r in (int(x) for x in args.ranks.split(",")):
            rows[f"LoRA r={r}"] = held(cfg_for(f"lora{r}", lora=dict(r=r)))
    full = rows["full"]
    mib = 2**20
    print(f"\nTraining state of the AV roles after one RL step, {what}; ratios full / this row")
    head = f"{'':<11} {'params MiB':>11} {'trainable MiB':>14} {'Adam MiB':>9} {'total MiB':>10} {'total':>7} " \
           f"{'trainable+Adam':>15}"
    print(head)
    print("-" * len(head))
    for name, m in rows.items():
        ta = m["trainable"] + m["optimizer"]
        print(f"{name:<11} {m['params'] / mib:11.3f} {m['trainable'] / mib:14.3f} {m['optimizer'] / mib:9.3f} "
              f"{m['total'] / mib:10.3f} {full['total'] / m['total']:6.2f}x "
              f"{(full['trainable'] + full['optimizer']) / ta:14.1f}x")
    print("total = distinct parameters (+ buffers) + one gradient per trainable value + Adam's two moments")


if __name__ == "__main__":
    main()
