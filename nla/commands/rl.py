"""`nla rl --config FILE [--set key=value ...] [--backend local|ray] [--resume]`: GRPO/PPO/DAPO with the online AR."""

from __future__ import annotations

import argparse
import json
import logging

log = logging.getLogger("nla.rl")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rl", help="train the verbalizer with RL against the live reconstructor")
    p.add_argument("--config", help="YAML of RLConfig fields and sections (see configs/rl/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, section keys dotted: --set steps=20 --set loss.advantage=gae")
    p.add_argument("--av", help="warm-started AV checkpoint dir (overrides av)")
    p.add_argument("--ar", help="warm-started AR checkpoint dir (overrides ar)")
    p.add_argument("--dataset", help="RL prompts parquet (overrides dataset)")
    p.add_argument("--out", help="run directory (overrides out_dir)")
    p.add_argument("--steps", type=int, help="RL steps (overrides steps)")
    # no argparse choices: the config validates the name against nla.rl.config.BACKENDS
    p.add_argument("--backend", help="worker backend: local | ray (overrides backend.name)")
    p.add_argument("--ray-address", help="existing Ray cluster address (overrides backend.ray_address)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in out_dir")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nla.rl.config import load_rl_config
    from nla.rl.loop import run_rl
    from nla.train.config import parse_overrides

    overrides = parse_overrides(args.set)
    for flag, key in (("av", "av"), ("ar", "ar"), ("dataset", "dataset"), ("out", "out_dir"), ("steps", "steps"),
                      ("backend", "backend.name"), ("ray_address", "backend.ray_address")):
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    cfg = load_rl_config(args.config, overrides)
    result = run_rl(cfg, resume=args.resume)
    log.info("checkpoint: %s (%.1f s)", result.checkpoint_dir, result.seconds)
    log.info("final metrics:\n%s", json.dumps(result.metrics, indent=2, default=str))
    return 0
