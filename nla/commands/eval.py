"""`nla eval --av DIR --ar DIR --dataset PARQUET [--frozen-ar DIR] [--grader NAME] [--max-rows N] [--out DIR]`: held-out evaluation.

`nla eval --suite [PARTS] ...`: the explanation suite instead (``nla.eval.suite``: claim attribution,
hidden-code tests, causal edits, directions, confabulation, best-of-N), to suite.json / suite.md.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from nla.util.flags import non_negative_int, positive_int, seed_flag, temperature_flag
from nla.util.threads import THREADS_HELP, threads_flag

log = logging.getLogger("nla.eval")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by eval / verbalize / score to load checkpoints (and ``--threads``, applied by
    :func:`apply_threads_flag` before any model loads)."""
    p.add_argument("--sidecar", help="explicit nla_meta.yaml (overrides the checkpoints' own)")
    p.add_argument("--allow-mixed-provenance", action="store_true",
                   help="run even when the checkpoints and the data record different subjects, layers or "
                        "tokenizers (a warning instead of an error)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=threads_flag, help=f"torch CPU threads ({THREADS_HELP})")


def add_layer_arg(p: argparse.ArgumentParser) -> None:
    """``--layer``, shared by verbalize / score: the block the vectors come from (:func:`vector_blocks`)."""
    p.add_argument("--layer", type=non_negative_int,
                   help="the block every vector comes from; a pair of several blocks (extraction.layers) needs one, "
                        "by default each row's activation_layer of a parquet nla datagen built")


def vector_blocks(flag: int | None, layers: tuple[int, ...] | None, source: str, rows: Sequence[int],
                  what: str = "--vectors") -> int | list[int] | None:
    """The block of each vector, for the client's ``layer=``: ``--layer`` (``flag``) when given; for a pair of
    several blocks (``layers``) without it, the ``activation_layer`` of ``source`` (a parquet) at ``rows`` (the
    file's row numbers of the vectors used; ``what``: the flag that named the file); None for a pair of one (it
    reads its own block). A ValueError naming the file, the row and what to pass when a pair of several blocks
    cannot be told which block a vector is of."""
    if flag is not None or layers is None:
        return flag
    asks = f"give --layer K (one of {list(layers)}) or vectors from a parquet nla datagen built with those blocks"
    head = f"{what} {source}: this pair reads several blocks ({list(layers)}, extraction.layers) and its prompts name the block"
    if not str(source).endswith(".parquet"):
        raise ValueError(f"{head}, but a .npy does not say which block its vectors come from; {asks}")
    import pyarrow.parquet as pq

    if "activation_layer" not in pq.read_schema(source).names:
        raise ValueError(f"{head}, but it has no activation_layer column; {asks}")
    column = pq.read_table(source, columns=["activation_layer"]).column(0).to_pylist()
    out = []
    for i in rows:
        k = column[int(i)]
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(f"{what} {source}: row {int(i)}: activation_layer is {k!r}, expected a block number "
                             f"(one of {list(layers)}); {asks}")
        out.append(k)
    return out


def apply_threads_flag(args: argparse.Namespace) -> int:
    """``--threads`` as every command applies it (``nla.util.threads.apply_threads``: the flag, else
    ``$OMP_NUM_THREADS``, else every core, fixed for the run); call it before any model loads."""
    from nla.util import threads

    return threads.apply_threads(args.threads)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate an AV/AR pair on a held-out parquet (FVE, faithfulness, baselines)")
    p.add_argument("--av", help="verbalizer checkpoint dir (omit to evaluate the AR alone)")
    p.add_argument("--ar", required=True, help="reconstructor checkpoint dir")
    p.add_argument("--frozen-ar", help="a second AR (the warm-start one) that also reads the AV's explanations: "
                                       "a private code between an RL'd pair shows as a gap to it")
    p.add_argument("--dataset", required=True, help="held-out parquet with activation_vector (+ sidecar)")
    p.add_argument("--max-rows", type=positive_int, help="evaluate a seeded random subset of this many rows")
    p.add_argument("--seed", type=seed_flag, default=0, help="seed of the row subset and the suite (0..2**32-1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=150)
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--samples", type=non_negative_int, default=8,
                   help="explanations shown next to their ground truth")
    p.add_argument("--grader", help="the dataset's grader (nla.core.graders: generic, world, or one an installed package "
                                    "registers under the nla.core.graders entry points); default: the one the "
                                    "dataset names")
    p.add_argument("--no-text-explainer", action="store_true", help="skip the text-explainer baseline row")
    p.add_argument("--out", help="directory for eval.json and eval.md (suite.json and suite.md with --suite)")
    p.add_argument("--suite", nargs="?", const="all", metavar="PARTS",
                   help="run the explanation suite (does it explain?) instead of the eval table: all parts, or a "
                        "comma-separated list of claims, hidden_code, causal, directions, confabulation, best_of")
    p.add_argument("--layer", type=non_negative_int,
                   help="--suite, a pair for several blocks: test this block only (its rows of the dataset); default: "
                        "every block, each on its own rows (the eval table always reports each block)")
    p.add_argument("--subject", help="--suite: the subject model dir for causal edits (default: the one the "
                                     "dataset's sidecar records)")
    p.add_argument("--baseline-av", help="--suite: the warm-start AV, whose false-claim rate is compared with the "
                                         "pair's")
    p.add_argument("--best-of", default=None, help="--suite: the N of best-of-N decoding (comma-separated, each "
                                                    "at most 1024; default 1,4,8)")
    p.add_argument("--temperature", type=temperature_flag, default=0.7, help="--suite: best-of-N's sampling temperature")
    p.add_argument("--paraphrase-provider", choices=["anthropic", "openai"],
                   help="--suite: re-phrase the claims the grader cannot through this API (off by default; needs "
                        "the provider's key in its environment variable)")
    p.add_argument("--paraphrase-model", help="--suite: the provider's model name")
    p.add_argument("--paraphrase-base-url", help="--suite: the provider's endpoint (default: its public one)")
    p.add_argument("--paraphrase-key-env", help="--suite: the environment variable holding the key")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from nla.client import NLAClient
    from nla.datagen.io import read_vectors
    from nla.eval.evaluate import evaluate_pair
    from nla.util.checkpoint_files import check_checkpoint
    from nla.util.validation import check_device, check_output_path

    check_device(args.device)
    parts = _suite_parts(args) if args.suite is not None else None
    if args.best_of is not None and parts is None:  # it was ignored: the figure asked for never came
        raise ValueError("--best-of: only the suite's best_of part decodes best-of-N; add --suite best_of (or --suite)")
    best_of = _best_of(args.best_of or "1,4,8") if parts is not None else None
    if args.layer is not None and parts is None:  # the eval table reports every block; the flag would be ignored
        raise ValueError("--layer: only the suite is run a block at a time (nla eval reports each block of a pair for "
                         "several blocks in one table); add --suite, or leave --layer out")
    if parts is not None and not args.av:
        raise ValueError("--suite: give the pair's AV (--av DIR) as well as its AR; the suite reads its explanations")
    if args.grader:
        from nla.core.graders import get_grader

        get_grader(args.grader)  # an unknown name is refused before any model loads
    if args.out:
        check_output_path(args.out, "--out")
    if args.subject is not None:
        # a missing --subject used to be reported as "causal: not run" with exit 0
        if parts is None:
            raise ValueError("--subject: only the suite's causal edits read a subject; add --suite causal (or --suite)")
        check_checkpoint(args.subject, "--subject")
        from nla.eval.suite.run import check_subject_dir

        check_subject_dir(args.subject)  # a verbalizer given as the subject: causal edits 0.000 (issue 58)
    apply_threads_flag(args)
    read_vectors(args.dataset)  # NaN / Inf / zero rows are named with the file before any model loads
    mixed = args.allow_mixed_provenance
    client = NLAClient(args.av, args.ar, device=args.device, dtype=args.dtype, sidecar=args.sidecar,
                       allow_mixed_provenance=mixed)
    if parts is not None:
        return _run_suite(args, client, parts, best_of)
    frozen = (NLAClient(None, args.frozen_ar, device=args.device, dtype=args.dtype, allow_mixed_provenance=mixed)
              if args.frozen_ar else None)
    report = evaluate_pair(client, args.dataset, max_rows=args.max_rows, seed=args.seed,
                           text_explainer_baseline=not args.no_text_explainer, n_show=args.samples,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, frozen_ar=frozen,
                           grader=args.grader)
    return _write_report(report, args.out, "eval")


def _write_report(report, out_dir: str | None, name: str) -> int:
    """``name``.json and ``name``.md into ``out_dir`` (when given); the markdown to stdout."""
    from pathlib import Path

    from nla.datagen.io import write_text_atomic

    md = report.to_markdown()
    if out_dir:
        out = Path(out_dir)
        write_text_atomic(report.to_json() + "\n", out / f"{name}.json")
        write_text_atomic(md, out / f"{name}.md")
        log.info("wrote %s and %s", out / f"{name}.json", out / f"{name}.md")
    print(md)
    return 0


def _suite_parts(args: argparse.Namespace) -> list[str]:
    from nla.eval.suite import PARTS

    if args.suite == "all":
        return list(PARTS)
    parts = [x.strip() for x in args.suite.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise ValueError(f"--suite: expected 'all' or a comma-separated list of {', '.join(PARTS)}, found "
                         f"{args.suite!r}")
    return parts


def _best_of(spec: str) -> list[int]:
    from nla.util.validation import MAX_SAMPLES_PER_VECTOR

    try:
        ns = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        ns = []
    if not ns or ns[0] < 1 or ns[-1] > MAX_SAMPLES_PER_VECTOR:
        raise ValueError(f"--best-of: expected comma-separated sample counts in 1..{MAX_SAMPLES_PER_VECTOR} such as "
                         f"1,4,8 (every sample of a vector is decoded in one batch), found {spec!r}")
    return ns


def _run_suite(args: argparse.Namespace, client, parts: list[str], best_of: list[int]) -> int:
    from nla.client import NLAClient
    from nla.eval.suite import run_suite, run_suite_by_block

    paraphraser = None
    if args.paraphrase_provider:
        from nla.datagen.config import ProviderConfig
        from nla.datagen.providers import provider_paraphraser

        paraphraser = provider_paraphraser(args.paraphrase_provider, ProviderConfig(
            model=args.paraphrase_model or "", base_url=args.paraphrase_base_url, api_key_env=args.paraphrase_key_env))
    baseline = (NLAClient(args.baseline_av, None, device=args.device, dtype=args.dtype,
                          allow_mixed_provenance=args.allow_mixed_provenance) if args.baseline_av else None)
    if baseline is not None:
        baseline.check_data(args.dataset)
    kw = dict(parts=parts, subject=args.subject, baseline_av=baseline, grader=args.grader, max_rows=args.max_rows,
              seed=args.seed, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, best_of=best_of,
              n_show=args.samples, paraphraser=paraphraser, temperature=args.temperature)
    side = client.av_sidecar or client.ar_sidecar
    if side.layers is not None and args.layer is None:  # a pair for several blocks: each block, one report
        report = run_suite_by_block(client, args.dataset, **kw)
    else:
        report = run_suite(client, args.dataset, layer=args.layer, **kw)
    return _write_report(report, args.out, "suite")
