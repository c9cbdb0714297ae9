"""Where the RL'd verbalizer's round trip loses against the oracle: its quotation or its facts.

    python -m dev.experiments.quote_vs_facts RUN [RUN...] [--rows N]

For a quickstart run (``nla quickstart``; the language that quotes the text's end), the RL'd AV
explains every held-out row of ``RUN/datagen/eval.parquet`` greedily; the live AR then reads four
texts per row: the AV's own, the AV's facts with the true quotation, the true facts with the AV's
quotation, and the oracle (true facts, true quotation). Prints FVE of each and how often the AV's
quotation is exactly the text's end (and its last unit, the token, is right). Ground truth is
used only to build these diagnostic texts, never in training.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

QUOTE = re.compile(r'^The text ends with "([^"]*)"\.\s*')


def split(text: str) -> tuple[str | None, str]:
    """(the quotation, the rest) of an explanation in the world's language."""
    m = QUOTE.match(text or "")
    return (m.group(1), text[m.end():]) if m else (None, text or "")


def main(argv: list[str] | None = None) -> int:
    from nla.client import NLAClient
    from nla.core.vectors import check_spread, fve
    from nla.world.explain import oracle_explanation, render_text_end
    from nla.world.facts import Fact

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--rows", type=int, default=None)
    args = ap.parse_args(argv)
    print("| run | AV as written | AV facts + true quotation | true facts + AV quotation | oracle | quotation exact | token right |")
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        step = sorted((run / "rl" / "checkpoints").glob("step_*"))[-1]
        client = NLAClient(step / "av", step / "ar")
        t = pq.read_table(run / "datagen" / "eval.parquet")
        n = t.num_rows if args.rows is None else min(args.rows, t.num_rows)
        vec = np.asarray(t.column("activation_vector").to_pylist()[:n], dtype=np.float32)
        facts = t.column("facts").to_pylist()[:n]
        ends = t.column("text_end").to_pylist()[:n]
        texts = [v.explanation or "" for v in client.verbalize(vec, max_new_tokens=64)]
        oracles = [oracle_explanation([Fact.parse(f) for f in fs], e, i) for i, (fs, e) in enumerate(zip(facts, ends, strict=False))]
        av_q = [split(x)[0] for x in texts]
        av_rest = [split(x)[1] for x in texts]
        or_rest = [split(o)[1] for o in oracles]

        def join(q: str | None, rest: str) -> str:
            return (render_text_end(q) + " " + rest).strip() if q else rest

        variants = {"av": texts, "av_facts_true_quote": [join(e, r) for e, r in zip(ends, av_rest, strict=False)],
                    "true_facts_av_quote": [join(q, r) for q, r in zip(av_q, or_rest, strict=False)], "oracle": oracles}
        import torch

        gold = torch.from_numpy(vec)
        scale = client.mse_scale
        check_spread(gold, scale, str(run))
        f = {k: fve(client.reconstruct(v), gold, scale) for k, v in variants.items()}
        exact = np.mean([q == e for q, e in zip(av_q, ends, strict=False)])
        token = np.mean([q is not None and q.split()[-1:] == e.split()[-1:] for q, e in zip(av_q, ends, strict=False)])
        print(f"| {run.name} | {f['av']:.3f} | {f['av_facts_true_quote']:.3f} | {f['true_facts_av_quote']:.3f} | "
              f"{f['oracle']:.3f} | {exact:.3f} | {token:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
