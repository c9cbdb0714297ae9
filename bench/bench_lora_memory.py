"""Training state held by the AV roles: full fine-tuning vs LoRA, measured on built RL roles
(``--stage rl``) or in the warm-starts, ``nla train av`` / ``nla train ar`` (``--stage sft``).

Builds the local backend's roles (policy, reference, rollout) for one RL step and counts, after
the step, the distinct parameter storages of the three roles (the rollout shares the policy;
full fine-tuning keeps a reference copy, LoRA reads the same module with its adapters off),
the buffers, Adam's state, and one gradient per trainable value (the step's peak)
(``nla.core.lora.held_state_bytes``). Ratios are full ÷ LoRA, from the same run.

    .venv/bin/python -m bench.bench_lora_memory                       # the RL test's tiny config (d=64)
    .venv/bin/python -m bench.bench_lora_memory --from-run runs/quickstart-default --ranks 4,16
    .venv/bin/python -m bench.bench_lora_memory --stage sft [--from-run runs/quickstart-default]

In the warm-starts the count is one model (no reference or rollout copy) and its optimiser
after one step on the stage's own dataset (the run's ``datagen/{av,ar}_sft.parquet``); the AR
under LoRA also trains its head in full.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from bench.bench_rl_backends import build_pair, run_config
from nla.core.lora import held_state_bytes
from nla.rl.backend import build_groups
from nla.rl.config import RLConfig
from nla.rl.loop import run_rl


def held(cfg: RLConfig) -> dict[str, int]:
    groups = build_groups(cfg)
    try:
        run_rl(cfg, groups=groups)
        return held_state_bytes([groups.policy.model, groups.reference.model, groups.rollout.model],
                                [groups.policy.opt])
    finally:
        groups.close()


def held_sft(role: str, dataset: Path, out: Path, lora: dict | None) -> dict[str, int]:
    """One optimiser step of ``nla train av|ar`` on ``dataset``; the held state of its model and optimiser."""
    from nla.train import loop as train_loop  # the warm-starts build their optimiser there
    from nla.train.ar import train_ar
    from nla.train.av import train_av
    from nla.train.config import ARTrainConfig, AVTrainConfig

    seen: dict[str, object] = {}
    real = train_loop.build_optimizer

    def capture(model, *a, **kw):  # the loop builds its optimiser here: keep the pair to count
        seen["model"], seen["opt"] = model, real(model, *a, **kw)
        return seen["opt"]

    kw = dict(dataset=str(dataset), out_dir=str(out), max_steps=1, warmup_steps=0, batch_size=32, eval_every=1,
              save_every=1, eval_max_rows=8, tensorboard=False, progress=False, threads=1, lr=1e-3)
    if lora is not None:
        kw["lora"] = lora
    train_loop.build_optimizer = capture
    try:
        if role == "av":
            train_av(AVTrainConfig(smoke_num=0, max_length=128, **kw))
        else:
            train_ar(ARTrainConfig(max_length=128, **kw))
    finally:
        train_loop.build_optimizer = real
    return held_state_bytes([seen["model"]], [seen["opt"]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-run", type=Path, default=None, help="a quickstart run dir (its RL stage's AV)")
    ap.add_argument("--ranks", default="4,16", help="LoRA ranks to measure")
    ap.add_argument("--stage", choices=("rl", "sft"), default="rl",
                    help="rl: the AV roles of one RL step; sft: the AV's and the AR's warm-start")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    ranks = [int(x) for x in args.ranks.split(",")]
    if args.stage == "sft":
        with tempfile.TemporaryDirectory(prefix="nla-bench-lora-") as tmp:
            root = Path(tmp)
            if args.from_run is not None:
                data = args.from_run.resolve() / "datagen"
                what = f"{args.from_run}'s datagen/*_sft.parquet"
            else:
                build_pair(root)
                data, what = root, "the RL test's tiny config (world tiny subject, d=64)"
            for role in ("av", "ar"):
                ds = data / f"{role}_sft.parquet"
                rows = {"full": held_sft(role, ds, root / f"{role}-full", None)}
                for r in ranks:
                    rows[f"LoRA r={r}"] = held_sft(role, ds, root / f"{role}-lora{r}", {"r": r})
                report(rows, f"the {role.upper()}'s warm-start after one step, {what}")
        return
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
        for r in ranks:
            rows[f"LoRA r={r}"] = held(cfg_for(f"lora{r}", lora=dict(r=r)))
    report(rows, f"the AV roles after one RL step, {what}")


def report(rows: dict[str, dict[str, int]], what: str) -> None:
    full = rows["full"]
    mib = 2**20
    print(f"\nTraining state of {what}; ratios full / this row")
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
