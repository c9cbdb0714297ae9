"""`nla world build`: generate the synthetic corpus, train its tokenizer and subject model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("world", help="the built-in synthetic world: corpus, tokenizer, subject model")
    wsub = p.add_subparsers(dest="world_command", metavar="ACTION")
    b = wsub.add_parser("build", help="build (or reuse the cached) world and print a summary")
    b.add_argument("--preset", default="default", help="world preset: tiny | default (default: default)")
    b.add_argument("--config", type=Path, default=None, help="world_config YAML (overrides --preset)")
    b.add_argument("--out", type=Path, default=None, help="base directory (default: $NLA_CACHE/world)")
    b.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    b.set_defaults(func=run_build)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def format_summary(art) -> str:
    s = art.summary
    ratio = art.heldout_loss / art.unigram_entropy if art.unigram_entropy else float("nan")
    lines = [
        f"world '{s['name']}' ({'cached' if art.from_cache else 'built'}) at {art.root}",
        f"  corpus      {s['n_docs']} training stories, {s['n_heldout_docs']} held out, "
        f"{s['n_explanation_samples']} explanation samples, {s['train_tokens']:,} training tokens",
        f"  tokenizer   vocab {s['vocab_size']}, marker id {s['injection_token_id']} "
        f"(neighbours {s['injection_left_neighbor_id']}, {s['injection_right_neighbor_id']})",
        f"  subject     {s['n_params'] / 1e6:.2f}M params, d_model {s['d_model']}, {s['n_layers']} layers, "
        f"extraction layer {s['default_layer']}",
        f"  held-out    {art.heldout_loss:.3f} nats/token vs unigram entropy {art.unigram_entropy:.3f} "
        f"(ratio {ratio:.2f})",
        f"  loss curve  {art.loss_curve_png}",
        f"  time        pretrain {s['train_seconds']:.1f}s ({s['tokens_per_second']:,.0f} tok/s), "
        f"whole build {s['build_seconds']:.1f}s",
        f"  model dir   {art.subject_dir}",
    ]
    return "\n".join(lines)


def run_build(args: argparse.Namespace) -> int:
    from nla.validation import check_output_path
    from nla.world.build import WORLD_PRESETS, WorldConfig, build_world

    if args.out is not None:
        check_output_path(args.out, "--out")
    if args.config is not None:
        target = WorldConfig.from_yaml(args.config)
    elif args.preset in WORLD_PRESETS:
        target = args.preset
    else:
        print(f"unknown preset {args.preset!r}; choose one of {sorted(WORLD_PRESETS)}", file=sys.stderr)
        return 2
    art = build_world(target, out=args.out, force=args.force, progress=not args.no_progress)
    print(format_summary(art))
    return 0
