"""How well the vector holds each word of the text's end, position by position (issue 57).

    python -m dev.experiments.quote_probe RUN/datagen [RUN/datagen ...] [--positions 3] [--json PATH]

For a datagen directory (the world's or ``source: wikipedia``), a multinomial logistic probe per
position p from the end (``quote[0]`` = the unit the token read ends, ``quote[1]`` the one before...)
is fitted on the ``ar_sft`` + ``av_sft`` documents' vectors and scored on the ``rl`` documents (other
stories or articles). Classes are the units seen at least twice in training at that position; a
held-out unit outside them counts as a miss. Units are the dataset's own (``nla.world.facts.text_units``
or ``nla.datagen.wiki.text_units``), so this is the ceiling of the quotation's grading in ``nla eval``.
Beside each: the commonest unit's share. The rule it informs: quote only what the vector holds.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from dev.experiments.wiki_probe import _logistic, load_split


def unit_probe(datagen: Path, positions: int = 3) -> dict:
    meta = pq.read_schema(datagen / "activations.parquet").metadata or {}
    tr, te, x_tr, x_te = load_split(datagen)
    wiki = "topic" in tr[0] or meta.get(b"nla.grader") == b"wiki"
    if wiki:
        from nla.datagen.wiki import text_units
    else:
        from nla.world.facts import text_units
    out = {"datagen": str(datagen), "language": "wiki" if wiki else "world", "rows_train": len(tr),
           "rows_test": len(te), "layer": tr[0]["activation_layer"]}

    def unit(r, p):
        units = text_units(r["context"])
        return units[-1 - p] if len(units) > p else None

    for p in range(positions):
        u_tr, u_te = [unit(r, p) for r in tr], [unit(r, p) for r in te]
        counts = Counter(u for u in u_tr if u is not None)
        classes = sorted(u for u, c in counts.items() if c >= 2)
        index = {u: i for i, u in enumerate(classes)}
        keep_tr = [i for i, u in enumerate(u_tr) if u in index]
        keep_te = [i for i, u in enumerate(u_te) if u is not None]
        pred = _logistic(x_tr[keep_tr], torch.tensor([index[u_tr[i]] for i in keep_tr]), x_te[keep_te], len(classes))
        truth = [u_te[i] for i in keep_te]
        hit = [classes[int(k)] == t for k, t in zip(pred, truth, strict=True)]
        common = counts.most_common(1)[0][0]
        out[f"quote[{p}]"] = {"probe": float(np.mean(hit)), "commonest": float(np.mean([t == common for t in truth])),
                              "classes": len(classes), "rows": len(truth)}
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("datagen", type=Path, nargs="+")
    ap.add_argument("--positions", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    res = [unit_probe(d, args.positions) for d in args.datagen]
    print("| datagen | layer | " + " | ".join(f"quote[{p}] probe (commonest)" for p in range(args.positions)) + " |")
    print("|---|---|" + "---|" * args.positions)
    for r in res:
        cells = [f"{r[f'quote[{p}]']['probe']:.3f} ({r[f'quote[{p}]']['commonest']:.3f})" for p in range(args.positions)]
        print(f"| {r['datagen']} ({r['language']}) | {r['layer']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1), encoding="utf-8")
    return res


if __name__ == "__main__":
    main()
