"""`nla eval --av DIR --ar DIR --dataset PARQUET [--frozen-ar DIR] [--grader NAME] [--max-rows N] [--out DIR]`: held-out evaluation."""

from __future__ import annotations

import argparse
import logging

from nla.validation import non_negative_int, positive_int

log = logging.getLogger("nla.eval")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by eval / verbalize / score to load checkpoints."""
    p.add_argument("--sidecar", help="explicit nla_meta.yaml (overrides the checkpoints' own)")
    p.add_argument("--allow-mixed-provenance", action="store_true",
                   help="run even when the checkpoints and the data record different subjects, layers or "
                        "tokenizers (a warning instead of an error)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate an AV/AR pair on a held-out parquet (FVE, faithfulness, baselines)")
    p.add_argument("--av", help="verbalizer checkpoint dir (omit to evaluate the AR alone)")
    p.add_argument("--ar", required=True, help="reconstructor checkpoint dir")
    p.add_argument("--frozen-ar", help="a second AR (the warm-start one) that also reads the AV's explanations: "
                                       "a private code between an RL'd pair shows as a gap to it")
    p.add_argument("--dataset", required=True, help="held-out parquet with activation_vector (+ sidecar)")
    p.add_argument("--max-rows", type=positive_int, help="evaluate a seeded random subset of this many rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=positive_int, default=150)
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--samples", type=non_negative_int, default=8,
                   help="explanations shown next to their ground truth")
    p.add_argument("--grader", help="the dataset's grader (nla.graders: generic, world, or one an installed package "
                                    "registers under the nla.graders entry points); default: the one the "
                                    "dataset names")
    p.add_argument("--no-text-explainer", action="store_true", help="skip the text-explainer baseline row")
    p.add_argument("--out", help="directory for eval.json and eval.md")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nla.client import NLAClient
    from nla.datagen.io import read_vectors, write_text_atomic
    from nla.evaluation import evaluate_pair
    from nla.validation import check_device, check_output_path

    check_device(args.device)
    if args.grader:
        from nla.graders import get_grader

        get_grader(args.grader)  # an unknown name is refused before any model loads
    if args.out:
        check_output_path(args.out, "--out")
    read_vectors(args.dataset)  # NaN / Inf / zero rows are named with the file before any model loads
    mixed = args.allow_mixed_provenance
    client = NLAClient(args.av, args.ar, device=args.device, dtype=args.dtype, sidecar=args.sidecar,
                       allow_mixed_provenance=mixed)
    frozen = (NLAClient(None, args.frozen_ar, device=args.device, dtype=args.dtype, allow_mixed_provenance=mixed)
              if args.frozen_ar else None)
    report = evaluate_pair(client, args.dataset, max_rows=args.max_rows, seed=args.seed,
                           text_explainer_baseline=not args.no_text_explainer, n_show=args.samples,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, frozen_ar=frozen,
                           grader=args.grader)
    md = report.to_markdown()
    if args.out:
        out = Path(args.out)
        write_text_atomic(report.to_json() + "\n", out / "eval.json")
        write_text_atomic(md, out / "eval.md")
        log.info("wrote %s and %s", out / "eval.json", out / "eval.md")
    print(md)
    return 0
