"""`nla world build | probe`: the synthetic corpus, its tokenizer and subject model; what its vectors hold."""

from __future__ import annotations

import argparse
from pathlib import Path

from nla.util.threads import THREADS_HELP, threads_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("world", help="the built-in synthetic world: corpus, tokenizer, subject model")
    wsub = p.add_subparsers(dest="world_command", metavar="ACTION")
    b = wsub.add_parser("build", help="build (or reuse the cached) world and print a summary")
    b.add_argument("--preset", default="default", help="world preset: tiny | default (default: default)")
    b.add_argument("--config", type=Path, default=None, help="world_config YAML (overrides --preset)")
    b.add_argument("--out", type=Path, default=None, help="base directory (default: $NLA_CACHE/world)")
    b.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    b.add_argument("--threads", type=threads_flag, help=f"torch CPU threads ({THREADS_HELP})")
    b.set_defaults(func=run_build)
    pr = wsub.add_parser("probe", help="linear-probe each fact kind at every layer: what is in the vector?")
    pr.add_argument("--preset", default="default", help="world preset: tiny | default (default: default)")
    pr.add_argument("--config", type=Path, default=None, help="world_config YAML (overrides --preset)")
    pr.add_argument("--out", type=Path, default=None, help="world base directory (default: $NLA_CACHE/world)")
    pr.add_argument("--layers", default=None, help="comma-separated block indices (default: every block)")
    pr.add_argument("--train-docs", type=int, default=1500, help="training stories the probes fit on (default 1500)")
    pr.add_argument("--test-docs", type=int, default=None,
                    help="held-out stories they are scored on (default: 300, or all the world holds out if fewer)")
    pr.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    pr.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    pr.add_argument("--threads", type=threads_flag, help=f"torch CPU threads ({THREADS_HELP})")
    pr.set_defaults(func=run_probe)
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


def _target(args: argparse.Namespace):
    from nla.util.validation import check_output_path
    from nla.world.build import WORLD_PRESETS, WorldConfig

    if args.out is not None:
        check_output_path(args.out, "--out")
    if args.config is not None:
        return WorldConfig.from_yaml(args.config)
    if args.preset in WORLD_PRESETS:
        return args.preset
    raise ValueError(f"--preset: expected one of {sorted(WORLD_PRESETS)}, found {args.preset!r}")


def run_build(args: argparse.Namespace) -> int:
    from nla.commands.eval import apply_threads_flag
    from nla.world.build import build_world

    target = _target(args)
    apply_threads_flag(args)
    art = build_world(target, out=args.out, force=args.force, progress=not args.no_progress)
    print(format_summary(art))
    return 0


def _parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers: expected comma-separated block indices like 1,2,3, found {text!r}") from None


def run_probe(args: argparse.Namespace) -> int:
    from nla.commands.eval import apply_threads_flag
    from nla.world.build import build_world
    from nla.world.probe import best_layer, probe_table_markdown, probe_world, write_probe_json

    for name in ("train_docs", "test_docs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, found {getattr(args, name)}")
    target = _target(args)
    apply_threads_flag(args)
    art = build_world(target, out=args.out, progress=not args.no_progress)
    n_test = args.test_docs if args.test_docs is not None else min(300, art.config.n_heldout_docs)
    results = probe_world(art, layers=_parse_layers(args.layers), n_train_docs=args.train_docs,
                          n_test_docs=n_test, progress=not args.no_progress)
    best = best_layer(results)
    print(f"world '{art.config.name}' at {art.root}: top-1 accuracy of a linear probe per fact kind, "
          f"on {n_test} held-out stories")
    print(probe_table_markdown(results, chosen=art.config.default_layer))
    print(f"best layer {best}; the world's default extraction layer is {art.config.default_layer}")
    if args.json is not None:
        write_probe_json(args.json, results, world=str(art.root), default_layer=art.config.default_layer,
                         best_layer=best)
        print(f"wrote {args.json}")
    return 0
