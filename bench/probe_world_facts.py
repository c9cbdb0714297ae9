"""How much of the world's ground truth is linearly decodable from the activations?

Fits one logistic probe per fact kind (the 12 most common facts of that kind, one
sigmoid each) on the AV training split's vectors and reports, on the held-out split,
how often the probe's top fact is a true one when the kind is present, against chance.
This bounds what any verbalizer can say faithfully about the facts at that layer.

    python bench/probe_world_facts.py --datagen runs/quickstart-default/datagen
"""

from __future__ import annotations

import argparse
import collections

import pyarrow.parquet as pq
import torch

from nla.datagen.io import read_vectors
from nla.vectors import normalize_activation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datagen", default="runs/quickstart-default/datagen",
                    help="datagen output dir with av_sft.parquet and eval.parquet (from nla quickstart)")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.manual_seed(0)
    tr, te = pq.read_table(f"{args.datagen}/av_sft.parquet"), pq.read_table(f"{args.datagen}/eval.parquet")
    x_tr = normalize_activation(torch.from_numpy(read_vectors(tr).copy()), 1.0)
    x_te = normalize_activation(torch.from_numpy(read_vectors(te).copy()), 1.0)
    f_tr, f_te = tr.column("facts").to_pylist(), te.column("facts").to_pylist()
    by_kind: dict[str, list[str]] = collections.defaultdict(list)
    for fact, _ in collections.Counter(f for fs in f_tr for f in fs).most_common():
        by_kind[fact.split("=")[0]].append(fact)
    print(f"train rows {len(f_tr)}, held-out rows {len(f_te)}, d={x_tr.shape[1]}")
    print(f"{'kind':10s} {'facts':>5s} {'top-1 when present':>19s} {'chance':>7s}")
    for kind, facts in sorted(by_kind.items()):
        facts = facts[:12]
        y = torch.tensor([[f in fs for f in facts] for fs in f_tr], dtype=torch.float32)
        y_te = torch.tensor([[f in fs for f in facts] for fs in f_te], dtype=torch.float32)
        w = torch.zeros(x_tr.shape[1], len(facts), requires_grad=True)
        b = torch.zeros(len(facts), requires_grad=True)
        opt = torch.optim.Adam([w, b], lr=0.1)
        for _ in range(args.steps):
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(x_tr @ w * 10 + b, y).backward()
            opt.step()
        with torch.no_grad():
            p = x_te @ w * 10 + b
        has = y_te.sum(1) > 0
        top1 = float(y_te[has].gather(1, p[has].argmax(1, keepdim=True)).mean())
        # chance: pick uniformly among the kind's facts, given at least one is present
        chance = float((y_te[has].sum(1) / len(facts)).mean())
        print(f"{kind:10s} {len(facts):5d} {top1:19.3f} {chance:7.3f}")


if __name__ == "__main__":
    main()
