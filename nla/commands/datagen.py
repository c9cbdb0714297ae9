"""`nla datagen`: extract -> split -> explain -> build (each a step; `run` does all, resumably)."""

from __future__ import annotations

import argparse
import json
import logging

from nla.util.threads import THREADS_HELP, threads_flag

log = logging.getLogger("nla.datagen")

STEPS = ("extract", "split", "explain", "build", "run")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "datagen", help="generate activation/explanation training data (extract, split, explain, build)"
    )
    steps = p.add_subparsers(dest="datagen_step", metavar="STEP")
    for step in STEPS:
        sp = steps.add_parser(
            step, help="all stages in order, skipping finished ones" if step == "run" else f"the {step} stage"
        )
        sp.add_argument(
            "--config", required=True, help="YAML file of DatagenConfig fields (see configs/datagen/)"
        )
        sp.add_argument("--out", help="output directory (overrides out_dir)")
        sp.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE",
            help="override a config field, e.g. --set n_docs=200 --set provider.model=gpt-4o-mini (every field: "
                 "nla config describe datagen)",
        )  # fmt: skip
        sp.add_argument("--threads", type=threads_flag,
                        help=f"torch CPU threads ({THREADS_HELP})")
        sp.add_argument("--no-progress", action="store_true", help="hide progress bars (progress: false)")
        sp.add_argument("--force", action="store_true", help="redo the stage(s) even if done")
        sp.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run(args: argparse.Namespace) -> int:
    from nla.datagen.config import DatagenConfig, parse_override
    from nla.datagen.pipeline import STAGES
    from nla.datagen.pipeline import run as run_pipeline

    overrides = dict(parse_override(s) for s in args.set)
    if args.out:
        overrides["out_dir"] = args.out
    if args.threads is not None:
        overrides["threads"] = args.threads
    if args.no_progress:
        overrides["progress"] = False
    cfg = DatagenConfig.from_yaml(args.config, overrides)
    from nla.util.checkpoint_files import check_model_source
    from nla.util.validation import check_device, check_output_path

    check_output_path(cfg.out_dir, "out_dir")
    check_device(cfg.device)
    if cfg.model_dir:
        check_model_source(cfg.model_dir, "model_dir")
    stages = STAGES if args.datagen_step == "run" else (args.datagen_step,)
    from nla.train.rundir import lock_run_dir

    with lock_run_dir(cfg.out_dir):  # one writer per out_dir (nla.train.rundir)
        summary = run_pipeline(cfg, stages=stages, force=args.force)
    log.info("datagen summary:\n%s", json.dumps(summary, indent=2, default=str))
    return 0
