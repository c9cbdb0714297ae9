"""`nla quickstart [--preset tiny|default|full|smollm2] [--out DIR] [--backend local|ray]`: the whole pipeline, one command."""

from __future__ import annotations

import argparse
import json
import sys

from nla.util.flags import non_negative_float, seed_flag
from nla.util.threads import THREADS_HELP, threads_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart", help="build the world, generate data, train AR/AV, run RL, evaluate, report")
    p.add_argument("--preset", default="default", choices=["tiny", "default", "full", "layers", "smollm2"],
                   help="tiny: about 2 minutes, for CI; default: the full CPU run (about 13 min on 2 cores, "
                        "BENCHMARKS.md); full: the default with a data explainer that names 3-6 of the true facts "
                        "instead of each with probability 0.8; layers: one pair for blocks 0-3 of the default "
                        "world, each row's block named in its prompts (issue 59; opt-in, BENCHMARKS.md); smollm2: "
                        "a real trained model, SmolLM2-135M-Instruct read on Wikipedia (both from pip wheels; "
                        "README, \"A real model\")")
    p.add_argument("--out", default=None, help="run directory (default runs/quickstart-<preset>)")
    p.add_argument("--backend", default="local", choices=["local", "ray"], help="RL worker backend")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--seed", type=seed_flag, default=0,
                   help="one seed for every stage: the world (stories, subject), datagen, both warm-starts, RL and "
                        "the held-out split (default 0; BENCHMARKS.md reports seeds 0-2)")
    p.add_argument("--threads", type=threads_flag, default=None,
                   help=f"torch CPU threads of every stage ({THREADS_HELP})")
    from nla.world.build import WORLD_PRESETS

    p.add_argument("--pair-world", default=None, choices=sorted(WORLD_PRESETS),
                   help="explain the subject with another world model trained on the same stories (e.g. default-d64, "
                        "half the width): the AV and AR start from it, the AV reads the vectors through a learned "
                        "injection adapter (docs/cross-model.md)")
    p.add_argument("--pair-roles", default="both", choices=["both", "av"],
                   help="with --pair-world: both roles start from it, or only the AV (the subject's own AR reads)")
    # nla.quickstart.INJECTION_ADAPTERS (not imported here: every command builds this parser)
    p.add_argument("--injection-adapter", default="none", choices=["none", "affine", "affine-mean-invariant", "affine-conformal",
                                                                     "affine-conformal-mean-invariant"],
                   help="affine: the same-model AV learns an affine injection adapter instead of the fixed scale; "
                        "affine-mean-invariant: one that reads vectors shifted along the training mean (a "
                        "difference of means, an offset) like the training data; affine-conformal: its weight a "
                        "learned gain times a rotation, so every direction is scaled alike (same-model only; "
                        "docs/cross-model.md)")
    p.add_argument("--mean-shift-augment", type=non_negative_float, default=0.0, metavar="M",
                   help="train the AV on vectors with a*mean added (a uniform in [-M, M], the response unchanged) so "
                        "it reads a shifted mean (a difference of means, an offset) like the training data; 0: off "
                        "(default), 1: the setting BENCHMARKS.md measures")
    p.add_argument("--injection-scale", type=non_negative_float, default=None, metavar="S",
                   help="the AV's fixed injection norm (a number in the AV's sidecar: the published format); "
                        "default: the preset's (32 for default and full; tiny: the dataset's sqrt(d_model))")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="change one of the preset's settings (repeatable): a stage's (datagen, ar, av, rl, suite, "
                        "probe, cross_model; nested with more dots, e.g. rl.rollout.n_samples_per_prompt=4) or a "
                        "field (world, eval_fraction, eval_max_rows, max_new_tokens), e.g. --set av.max_steps=1000 "
                        "--set rl.steps=50; the value is read as YAML; the run gets its own default --out and "
                        "its report names the settings")
    p.add_argument("--autocast", default=None, choices=["bfloat16"],
                   help="mixed precision for the AR and AV warm-starts and RL: their forwards' matmuls in bf16 "
                        "under torch.autocast, weights, heads and losses in fp32 (nla.util.precision; the same as "
                        "--set ar.autocast=bfloat16 --set av.autocast=bfloat16 --set rl.autocast=bfloat16). "
                        "Needs a CPU with AVX512_BF16 or AMX (or a GPU); that CPU kind's own numbers")
    p.add_argument("--overwrite", action="store_true",
                   help="run again a stage that finished in --out with another config (other --threads, seed or "
                        "CPU code paths), replacing it and the stages after it; without it such a stage is refused")
    p.set_defaults(func=run)


def _adapter_suffix(choice: str, pair_world: str | None) -> str:
    """The run dir's part for --injection-adapter: every choice its own dir, so two settings never share
    a run ("affine-conformal" -> "-adapter-conformal"; a cross-model pair always has the affine adapter,
    so only what follows "affine" is named there)."""
    if choice == "none":
        return ""
    rest = choice.removeprefix("affine")
    return rest if pair_world else "-adapter" + rest


def _settings_digest(settings: list[str]) -> str:
    """A short name for a run's --set settings (their order kept: a later one wins), so a changed preset
    never reuses the plain preset's run directory."""
    import hashlib

    return hashlib.sha256("\n".join(s.strip() for s in settings).encode()).hexdigest()[:8]


def _quiet_transformers() -> None:
    # The console shows the stages, their progress bars and the result. transformers' own
    # "Loading weights" / "Writing model shards" bars and notes (e.g. which layers FSDP would not
    # shard) describe library internals of loads the quickstart makes on purpose; its errors stay.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def run(args: argparse.Namespace) -> int:
    from nla.quickstart import run_quickstart
    from nla.util.validation import check_output_path

    if args.autocast:  # first: a later --set of one stage wins
        args.settings = [f"{stage}.autocast={args.autocast}" for stage in ("ar", "av", "rl")] + args.settings
    default_out = (f"runs/quickstart-{args.preset}" + (f"-pair-{args.pair_world}" if args.pair_world else "")
                   + ("-av" if args.pair_world and args.pair_roles == "av" else "")
                   + _adapter_suffix(args.injection_adapter, args.pair_world)
                   + (f"-augment{args.mean_shift_augment:g}" if args.mean_shift_augment else "")
                   + (f"-scale{args.injection_scale:g}" if args.injection_scale is not None else "")
                   + (f"-set-{_settings_digest(args.settings)}" if args.settings else "")
                   + (f"-seed{args.seed}" if args.seed else ""))
    out = str(check_output_path(args.out or default_out, "--out"))
    _quiet_transformers()
    report = run_quickstart(args.preset, out, backend=args.backend, progress=not args.no_progress,
                            threads=args.threads, seed=args.seed, pair_world=args.pair_world,
                            injection_adapter=args.injection_adapter, pair_roles=args.pair_roles,
                            mean_shift_augment=args.mean_shift_augment, overwrite=args.overwrite,
                            injection_scale=args.injection_scale, settings=args.settings)
    head = json.loads((report.parent / "report.json").read_text())["headline"]
    print("\n== nla quickstart: done ==", file=sys.stderr)
    print(f"round-trip FVE (held-out): warm-start {head['round_trip_fve_warmstart']:.3f} -> "
          f"after RL {head['round_trip_fve_rl']:.3f}", file=sys.stderr)
    print(f"AR held-out FVE {head['ar_heldout_fve_warmstart']:.3f}, AV real-vs-shuffled loss gap "
          f"{head['av_vector_gap']:.3f}", file=sys.stderr)
    print(f"total {head['total_seconds']:.0f} s; report: {report}", file=sys.stderr)
    return 0
