"""`nla train ar|av --config FILE [--set key=value ...] [--resume]`: the warm-start stages."""

from __future__ import annotations

import argparse
import json
import logging

from nla.util.flags import positive_int
from nla.util.threads import THREADS_HELP, threads_flag

log = logging.getLogger("nla.train")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="warm-start the reconstructor (ar) or the verbalizer (av)")
    stages = p.add_subparsers(dest="train_stage", metavar="STAGE")
    for stage, what in (("ar", "reconstructor: explanation text -> activation"),
                        ("av", "verbalizer: activation -> explanation, vector injected")):
        sp = stages.add_parser(stage, help=f"warm-start the {what}")
        sp.add_argument("--config", help=f"YAML of {stage.upper()}TrainConfig fields (see configs/train/)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config field, e.g. --set lr=1e-4 --set max_steps=200 (every field: "
                             f"nla config describe {stage})")
        sp.add_argument("--dataset", help="training parquet (overrides dataset)")
        sp.add_argument("--out", help="run directory (overrides out_dir)")
        sp.add_argument("--base-model", help="HF model directory to start from (overrides base_model)")
        sp.add_argument("--max-steps", type=positive_int, help="optimiser steps (overrides max_steps)")
        sp.add_argument("--threads", type=threads_flag,
                        help=f"torch CPU threads ({THREADS_HELP})")
        sp.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in out_dir (the config must match the run's)")
        sp.add_argument("--overwrite", action="store_true", help="delete a previous run in out_dir and start over")
        sp.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run(args: argparse.Namespace) -> int:
    from nla.datagen.io import read_vectors
    from nla.train.config import ARTrainConfig, AVTrainConfig, load_config, normalise_paths
    from nla.train.rundir import prepare_run_dir
    from nla.util.checkpoint_files import check_model_source
    from nla.util.overrides import parse_overrides
    from nla.util.validation import check_device, check_output_path

    overrides = parse_overrides(args.set)
    for flag, key in (("dataset", "dataset"), ("out", "out_dir"), ("base_model", "base_model"),
                      ("max_steps", "max_steps"), ("threads", "threads")):
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    if args.train_stage == "ar":
        from nla.train.ar import train_ar as train

        cfg = load_config(ARTrainConfig, args.config, overrides)
    else:
        from nla.train.av import train_av as train

        cfg = load_config(AVTrainConfig, args.config, overrides)
    cfg = normalise_paths(cfg)  # one spelling per path, so --resume compares alike
    # Every input is checked before anything is written (nla.util.validation).
    check_output_path(cfg.out_dir, "out_dir")
    check_device(cfg.device)
    if cfg.base_model:
        check_model_source(cfg.base_model, "base_model")
        if args.train_stage == "av":
            from pathlib import Path

            from nla.train.av import check_av_base

            check_av_base(Path(cfg.base_model))
    for dataset in filter(None, (cfg.dataset, cfg.eval_dataset)):
        read_vectors(dataset)  # NaN / Inf / zero rows stop the run here, named
    # the out_dir's lock is held for the whole run: a second writer is refused (nla.train.rundir)
    with prepare_run_dir(cfg.out_dir, cfg.to_dict(), "train_config.yaml", resume=args.resume,
                         overwrite=args.overwrite):
        result = train(cfg, resume=args.resume)
    log.info("checkpoint: %s (%.1f s)", result.checkpoint_dir, result.seconds)
    log.info("final metrics:\n%s", json.dumps(result.metrics, indent=2, default=str))
    return 0
