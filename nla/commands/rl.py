"""`nla rl --config FILE [--set key=value ...] [--backend local|ray] [--resume | --overwrite]`: GRPO/PPO/DAPO with the online AR."""

from __future__ import annotations

import argparse
import json
import logging
from typing import TYPE_CHECKING

from nla.util.flags import positive_int
from nla.util.threads import THREADS_HELP, threads_flag

if TYPE_CHECKING:
    from nla.rl.config import RLConfig

log = logging.getLogger("nla.rl")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rl", help="train the verbalizer with RL against the live reconstructor")
    p.add_argument("--config", help="YAML of RLConfig fields and sections (see configs/rl/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, section keys dotted: --set steps=20 --set loss.advantage=gae "
                        "(every field: nla config describe rl)")
    p.add_argument("--av", help="warm-started AV checkpoint dir (overrides av)")
    p.add_argument("--ar", help="warm-started AR checkpoint dir (overrides ar)")
    p.add_argument("--dataset", help="RL prompts parquet (overrides dataset)")
    p.add_argument("--out", help="run directory (overrides out_dir)")
    p.add_argument("--steps", type=positive_int, help="RL steps (overrides steps)")
    # no argparse choices: the config validates the name against nla.rl.config.BACKENDS
    p.add_argument("--backend", help="worker backend: local | ray (overrides backend.name)")
    p.add_argument("--ray-address", help="existing Ray cluster address (overrides backend.ray_address)")
    p.add_argument("--threads", type=threads_flag,
                   help=f"torch CPU threads per process ({THREADS_HELP})")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint in out_dir (the config must match the run's)")
    p.add_argument("--overwrite", action="store_true", help="delete a previous run in out_dir and start over")
    p.add_argument("--no-plan-check", action="store_true",
                   help="start even when the memory plan (nla plan) exceeds the GPU (local backend)")
    p.add_argument("--allow-mixed-provenance", action="store_true",
                   help="run even when the AV, the AR and the datasets record different subjects, layers or "
                        "tokenizers (sets allow_mixed_provenance)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nla.client import load_checkpoint_sidecar
    from nla.core.reconstructor import VALUE_HEAD_FILE, check_ar_max_length
    from nla.datagen.io import read_vectors
    from nla.rl.config import load_rl_config
    from nla.rl.loop import check_rollout_rows, check_run_provenance, run_rl
    from nla.rl.setup import load_pair_sidecars
    from nla.train.config import normalise_paths
    from nla.train.rundir import prepare_run_dir
    from nla.util.checkpoint_files import check_checkpoint
    from nla.util.overrides import parse_overrides
    from nla.util.validation import check_device, check_output_path

    overrides = parse_overrides(args.set)
    for flag, key in (("av", "av"), ("ar", "ar"), ("dataset", "dataset"), ("out", "out_dir"), ("steps", "steps"), ("threads", "threads"),
                      ("backend", "backend.name"), ("ray_address", "backend.ray_address")):
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    if args.allow_mixed_provenance:
        overrides["allow_mixed_provenance"] = True
    cfg = normalise_paths(load_rl_config(args.config, overrides))  # one spelling per path, so --resume compares alike
    # Every input is checked before anything is written (nla.util.validation).
    check_output_path(cfg.out_dir, "out_dir")
    check_device(cfg.device)
    load_checkpoint_sidecar(Path(cfg.av), "av")  # roles are checked, not warned about
    load_checkpoint_sidecar(Path(cfg.ar), "ar")
    check_checkpoint(cfg.av, "av")
    check_checkpoint(cfg.ar, "ar", extra=(VALUE_HEAD_FILE,))
    for dataset in filter(None, (cfg.dataset, cfg.eval_dataset)):
        rows = read_vectors(dataset).shape[0]  # NaN / Inf / zero rows stop the run here, named
        if dataset == cfg.dataset:
            check_rollout_rows(cfg, rows)
    av_side, ar_side = load_pair_sidecars(cfg.av, cfg.ar)
    check_run_provenance(cfg, av_side, ar_side)  # one subject for the pair and its data (nla.core.provenance)
    check_ar_max_length(cfg.reconstructor.max_length, ar_side.critic_suffix_ids, "reconstructor.max_length")
    if cfg.backend.name == "local" and not args.no_plan_check:
        check_plan_fits(cfg)
    # the out_dir's lock is held for the whole run: a second writer is refused (nla.train.rundir)
    with prepare_run_dir(cfg.out_dir, cfg.to_dict(), "rl_config.yaml", resume=args.resume, overwrite=args.overwrite):
        result = run_rl(cfg, resume=args.resume)
    log.info("checkpoint: %s (%.1f s)", result.checkpoint_dir, result.seconds)
    log.info("final metrics:\n%s", json.dumps(result.metrics, indent=2, default=str))
    return 0


def check_plan_fits(cfg: RLConfig) -> None:
    """Refuse, before any model loads, an RL run on one GPU whose memory plan (``nla.rl.plan``)
    exceeds the card; the message says what to change."""
    from nla.rl.plan import GIB, device_memory, plan_of_config
    from nla.rl.setup import RLSetupError
    from nla.train.device import resolve_device

    total = device_memory(str(resolve_device(cfg.device)))
    if total is None:  # the plan checks GPUs; a CPU run shares the machine's memory with the rest
        return
    plan = plan_of_config(cfg)
    if not plan.fits(total):
        raise RLSetupError(
            f"memory plan: this RL step needs about {plan.peak / GIB:.1f} GiB, the GPU has {total / GIB:.1f} GiB "
            f"(weights and training state {plan.persistent / GIB:.1f} GiB; `nla plan --model {cfg.av} "
            f"--layer {plan.settings.layer} ...` shows each role); lower optimiser.micro_batch_size or "
            "rollout.rollout_batch_size, set lora.r / reconstructor.lora_r or optimiser.gradient_checkpointing, "
            "use --backend ray across GPUs, or pass --no-plan-check")

