"""Does a block's vector tell an object the protagonist holds from one the story put down? (issue 59)

On a finished world run of several blocks (``nla quickstart --preset layers``), the rows whose text read named
exactly one object (``nla.world.explain.named_in_text`` of the row's ``context``) are labelled by whether it holds
at the token (in the row's ``facts``: picked up and not put down) or not (put down). A logistic probe a block
(``nla.core.probing.fit_logistic`` on standardised vectors) is fitted on the warm-start splits' rows
(``av_sft`` + ``ar_sft``) and read on the eval rows (other documents). Prints, per block, the eval rows, the
share that hold (what always saying "held" gets right), the probe's accuracy, and where it says "held" at
p >= 0.5 and p >= 0.9 how often and how often rightly. Beside ``nla eval``'s share of object claims said
earlier in the text (``faithfulness.stale``), it shows whether the AV could have known: where the probe is no
better than always saying "held", the vector does not (linearly) hold that the object was put down.

    python -m dev.experiments.held_objects RUN [RUN ...]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import numpy as np
import torch

from nla.client import load_vectors
from nla.core.probing import fit_logistic, standardise
from nla.datagen.io import read_parquet
from nla.world.explain import named_in_text


def object_rows(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vectors, blocks, held) of the rows of ``path`` whose text read named exactly one object."""
    t = read_parquet(path)
    vectors, blocks = load_vectors(path), np.asarray(t.column("activation_layer").to_pylist())
    keep, held = [], []
    for i, (context, facts) in enumerate(zip(t.column("context").to_pylist(), t.column("facts").to_pylist(),
                                             strict=True)):
        now = set(ast.literal_eval(facts) if isinstance(facts, str) else facts or [])
        named = [f for f in named_in_text(context or "") if f.kind == "object"]
        if len(named) == 1:
            keep.append(i)
            held.append(int(str(named[0]) in now))
    idx = np.asarray(keep, dtype=np.int64)
    return vectors[idx], blocks[idx], np.asarray(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished quickstart run directories of several blocks")
    ap.add_argument("--l2", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    for run in args.runs:
        dg = run / "datagen"
        fit = [object_rows(dg / f"{split}.parquet") for split in ("av_sft", "ar_sft")]
        xf, bf, yf = (np.concatenate(z) for z in zip(*fit, strict=True))
        xe, be, ye = object_rows(dg / "eval.parquet")
        print(f"{run}")
        print("| block | eval rows | hold (always 'held') | probe accuracy | says held at p >= 0.5: rows, right | "
              "at p >= 0.9: rows, right |")
        print("|---|---|---|---|---|---|")
        for k in sorted(set(be.tolist())):
            a, e = bf == k, be == k
            torch.manual_seed(0)
            za, ze = standardise(torch.from_numpy(xf[a]).float(), torch.from_numpy(xe[e]).float())
            w, b = fit_logistic(za, torch.from_numpy(yf[a]).float()[:, None], args.l2, args.steps)
            p, y = torch.sigmoid(ze @ w + b).numpy().ravel(), ye[e]

            def said(bar: float, p: np.ndarray = p, y: np.ndarray = y) -> str:
                m = p >= bar
                return f"{m.mean():.2f}, {y[m].mean():.2f}" if m.any() else "0, –"

            print(f"| {k} | {int(e.sum())} | {y.mean():.2f} | {((p >= 0.5) == y).mean():.3f} | {said(0.5)} | "
                  f"{said(0.9)} |")


if __name__ == "__main__":
    main()
