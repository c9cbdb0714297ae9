"""`nla sidecar fix-tokens PATH [--tokenizer DIR] [--write]`: re-derive a sidecar's token ids.

A newer tokenizer can give the injection marker, its neighbours or the AR template's tail other
ids than the sidecar records; every load then refuses the checkpoint, naming the mismatch. This
command computes the ids from the live tokenizer and prints what would change; only with
``--write`` does it change those keys (and nothing else), keeping the old file as ``.bak``.
Never done silently by any load.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("nla.core.sidecar")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sidecar", help="inspect and repair nla_meta.yaml sidecars")
    steps = p.add_subparsers(dest="sidecar_step", metavar="STEP")
    fx = steps.add_parser("fix-tokens", help="re-derive the token ids of a sidecar from the live tokenizer")
    fx.add_argument("path", help="a checkpoint dir, a dataset parquet, or a sidecar .yaml")
    fx.add_argument("--tokenizer", help="tokenizer dir (default: PATH itself, for a checkpoint dir)")
    fx.add_argument("--write", action="store_true", help="write the new ids (default: only show them)")
    fx.set_defaults(func=fix_tokens)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def fix_tokens(args: argparse.Namespace) -> int:
    from pathlib import Path

    from transformers import AutoTokenizer

    from nla.core.sidecar import rewrite_token_ids, sidecar_path_for, token_id_changes

    side = sidecar_path_for(args.path)
    if not side.is_file():
        raise FileNotFoundError(f"{args.path}: no sidecar at {side}")
    source = args.tokenizer or (args.path if Path(args.path).is_dir() else None)
    if source is None:
        raise ValueError(f"--tokenizer: {args.path} is not a checkpoint dir; pass the tokenizer dir to derive from")
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"--tokenizer: cannot load a tokenizer from {source} ({' '.join(str(err).split())[:200]})"
                         ) from None
    changes = token_id_changes(args.path, tok)
    if not changes:
        print(f"{side}: every token id matches the tokenizer at {source}; nothing to change")
        return 0
    for key, (old, new) in changes.items():
        print(f"{side}: {key}: {old} -> {new}")
    if not args.write:
        print("not written; rerun with --write to update these keys (the old file is kept as .bak)")
        return 0
    rewrite_token_ids(args.path, changes)
    print(f"wrote {side} (the previous file is {side.name}.bak)")
    return 0
