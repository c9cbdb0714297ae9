"""`nla verbalize --av DIR --vectors (parquet|.npy) [--rows N] [--out jsonl]`: explanations for vectors.

`--reference DATASET` warns for each vector whose norm is far outside that data's (the AV never saw
such a vector); `--directions` reads the vectors as directions (SAE features, difference-of-means or
steering vectors) and explains each placed as the AV was trained: the reference data's mean direction
plus `--strength` of its spread along the direction, at its median norm (``nla.eval.suite``).
"""

from __future__ import annotations

import argparse
import logging

from nla.commands.eval import add_layer_arg, add_model_args, apply_threads_flag, vector_blocks
from nla.util.flags import positive_int, sample_count_flag, seed_flag, temperature_flag

log = logging.getLogger("nla.verbalize")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verbalize", help="explain activation vectors with a verbalizer (AV)")
    p.add_argument("--av", required=True, help="verbalizer checkpoint dir")
    p.add_argument("--vectors", required=True, help="parquet with activation_vector, or .npy [N, d] (RAW)")
    p.add_argument("--rows", type=positive_int, help="only the first N vectors")
    p.add_argument("--out", help="JSONL file (one {row, status, explanation, text} per sample); default stdout")
    p.add_argument("--max-new-tokens", type=positive_int, default=150)
    p.add_argument("--n-samples", type=sample_count_flag, default=1,
                   help="explanations per vector (at most nla.util.validation.MAX_SAMPLES_PER_VECTOR = 1024)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=temperature_flag, default=1.0)
    p.add_argument("--seed", type=seed_flag, help="the sampling seed (0..2**32-1)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--reference", help="parquet of the AV's training-like vectors: warn for vectors whose norm is far "
                                       "outside theirs (needed by --directions)")
    p.add_argument("--directions", action="store_true",
                   help="the vectors are directions, not activations: explain mean + strength x spread along each")
    p.add_argument("--strength", type=float, default=4.0,
                   help="--directions: how far along each direction, in standard deviations of the reference")
    p.add_argument("--skip-bad-rows", action="store_true",
                   help="drop vectors with NaN/Inf, zero or overflowing norms (counted and named) instead of refusing")
    add_layer_arg(p)
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from collections import Counter

    import numpy as np

    from nla.client import NLAClient, load_vectors
    from nla.util.fsutil import dumps_json, write_text_atomic
    from nla.util.validation import check_device, check_output_path, drop_bad_rows

    check_device(args.device)
    if args.directions and not args.reference:
        raise ValueError("--directions: give --reference DATASET (the vectors whose mean and spread place each "
                         "direction where the AV was trained)")
    if args.out:
        check_output_path(args.out, "--out", is_file=True)
    apply_threads_flag(args)
    if args.skip_bad_rows:
        vectors, kept, report = drop_bad_rows(load_vectors(args.vectors, rows=args.rows, check=False),
                                              f"vectors {args.vectors}")
        if report:
            log.warning(report)
    else:
        vectors = load_vectors(args.vectors, rows=args.rows)
        kept = range(vectors.shape[0])
    client = NLAClient(args.av, None, device=args.device, dtype=args.dtype, sidecar=args.sidecar,
                       allow_mixed_provenance=args.allow_mixed_provenance)
    if str(args.vectors).endswith(".parquet"):
        client.check_data(args.vectors, width=int(vectors.shape[1]))  # vectors of another subject would be explained as if they were this one's
    layers = client.av_sidecar.layers  # a pair of several blocks names each vector's block in its prompt
    kw = dict(max_new_tokens=args.max_new_tokens, greedy=not args.sample, temperature=args.temperature,
              n_samples=args.n_samples, seed=args.seed, batch_size=args.batch_size)
    if args.reference:
        import torch

        from nla.eval.suite import norm_warnings, verbalize_directions

        client.check_data(args.reference)
        reference = torch.from_numpy(load_vectors(args.reference))
        if reference.shape[1] != vectors.shape[1]:
            raise ValueError(f"--reference: {args.reference} holds {reference.shape[1]}-d vectors, --vectors "
                             f"{vectors.shape[1]}-d; give data of the same subject and layer")
        # Blocks differ in norm and direction: a pair of several blocks places and checks each vector against
        # the reference rows of its own block.
        ref_blocks = (None if layers is None else
                      np.asarray(vector_blocks(None, layers, args.reference, range(reference.shape[0]), "--reference")))
        if args.directions:
            if layers is not None:
                if args.layer is None:
                    raise ValueError(f"--directions: this pair reads several blocks ({list(layers)}, extraction.layers); "
                                     "give --layer K, the block whose --reference rows place the directions")
                reference = reference[torch.from_numpy(ref_blocks == args.layer)]
                if reference.shape[0] == 0:
                    raise ValueError(f"--reference: {args.reference} holds no row of block {args.layer} "
                                     "(activation_layer); give data of the block the directions are of")
            out, _ = verbalize_directions(client, torch.as_tensor(vectors), reference, strength=args.strength,
                                          layer=args.layer, **kw)
        else:
            layer = vector_blocks(args.layer, layers, args.vectors, kept)
            vecs = torch.as_tensor(vectors)
            if layers is None:
                warnings = norm_warnings(vecs, reference)
            else:
                per = [layer] * vecs.shape[0] if isinstance(layer, int) else layer
                warnings = []
                for k in sorted(set(per)):
                    idx = [i for i, b in enumerate(per) if b == k]
                    own = reference[torch.from_numpy(ref_blocks == k)]
                    if own.shape[0] == 0:
                        raise ValueError(f"--reference: {args.reference} holds no row of block {k} (activation_layer), "
                                         f"the block of vector {int(kept[idx[0]])}; give data of every block explained")
                    warnings += norm_warnings(vecs[idx], own, rows=[int(kept[i]) for i in idx])
            for w in warnings[:10]:
                log.warning("%s", w)
            if len(warnings) > 10:
                log.warning("... and %d more vectors outside the reference's norms", len(warnings) - 10)
            out = client.verbalize(vectors, layer=layer, **kw)
    else:
        out = client.verbalize(vectors, layer=vector_blocks(args.layer, layers, args.vectors, kept), **kw)
    # Rows are numbered as in the input file, skipped rows included.
    lines = "".join(dumps_json({**v.to_dict(), "row": int(kept[v.row])}, ensure_ascii=False) + "\n" for v in out)
    if args.out:
        write_text_atomic(lines, args.out)
        log.info("wrote %d samples to %s", len(out), args.out)
    else:
        print(lines, end="")
    log.info("statuses: %s", dict(Counter(str(v.status) for v in out)))
    return 0
