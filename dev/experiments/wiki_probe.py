"""What a linear probe reads from SmolLM2's vectors, claim by claim (issues 56 and 57).

    python -m dev.experiments.wiki_probe RUN/datagen [--json PATH]

Reads ``activations.parquet`` of a ``source: wikipedia`` datagen (rows of every split, raw vectors) and
fits, on the ``ar_sft`` + ``av_sft`` documents, linear probes for each claim the ``wiki`` explainer makes,
scoring them on the ``rl`` documents (other articles):

- topic (12 labels) and position bucket (start/early/later): multinomial logistic regression;
- the token read (``quote[0]``), the tokens 1 and 2 before it, and the subject's next token: a ridge map
  from the vector to the subject's input embedding of that token, decoded as the nearest token of the
  whole vocabulary by cosine (a probe that can name tokens it never saw in training).

Beside each: the majority-class baseline (topic, position) or the share of test rows whose token is the
commonest one. The vectors are centred on the training rows' mean and scaled to unit variance per
dimension first. Ground truth only measures here; it never enters training.

The ceiling any explanation can reach on a claim is about the probe's accuracy: what the vector does
not hold linearly, an AV trained on a few thousand rows will not say truly.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch


def _split_docs(datagen: Path) -> tuple[set[int], set[int]]:
    train, test = set(), set()
    for name, dest in (("ar_sft", train), ("av_sft", train), ("rl", test)):
        dest.update(pq.read_table(datagen / "splits" / f"{name}.parquet", columns=["doc_id"]).column("doc_id").to_pylist())
    return train, test


def load_split(datagen: Path) -> tuple[list[dict], list[dict], torch.Tensor, torch.Tensor]:
    """The rows of ``activations.parquet`` on the warm-start documents (train) and the RL documents
    (test), with their vectors standardised on the training rows' mean and std per dimension."""
    rows = pq.read_table(datagen / "activations.parquet").to_pylist()
    train_docs, test_docs = _split_docs(datagen)
    tr = [r for r in rows if r["doc_id"] in train_docs]
    te = [r for r in rows if r["doc_id"] in test_docs]
    x_tr = torch.tensor(np.array([r["activation_vector"] for r in tr], dtype=np.float32))
    x_te = torch.tensor(np.array([r["activation_vector"] for r in te], dtype=np.float32))
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    return tr, te, (x_tr - mu) / sd, (x_te - mu) / sd


def _logistic(x_tr, y_tr, x_te, n_cls, l2=1e-3, steps=300):
    torch.manual_seed(0)
    w = torch.zeros(x_tr.shape[1], n_cls, requires_grad=True)
    b = torch.zeros(n_cls, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x_tr @ w + b, y_tr) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return (x_te @ w + b).argmax(-1)


def _ridge_to_embedding(x_tr, ids_tr, x_te, emb, lam=10.0):
    target = emb[ids_tr]
    a = x_tr.T @ x_tr + lam * torch.eye(x_tr.shape[1])
    w = torch.linalg.solve(a, x_tr.T @ target)
    pred = torch.nn.functional.normalize(x_te @ w, dim=-1)
    return (pred @ torch.nn.functional.normalize(emb, dim=-1).T).argmax(-1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("datagen", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla.datagen.real_sources import smollm2_dir

    d = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(d)
    emb = AutoModelForCausalLM.from_pretrained(d).get_input_embeddings().weight.detach().float()

    tr, te, x_tr, x_te = load_split(args.datagen)
    out: dict = {"rows_train": len(tr), "rows_test": len(te), "layer": tr[0]["activation_layer"]}

    def facts(r):
        return dict(f.split("=", 1) for f in r["facts"])

    for kind in ("topic", "position"):
        labels = sorted({facts(r)[kind] for r in tr + te})
        y_tr = torch.tensor([labels.index(facts(r)[kind]) for r in tr])
        y_te = torch.tensor([labels.index(facts(r)[kind]) for r in te])
        pred = _logistic(x_tr, y_tr, x_te, len(labels))
        major = Counter(y_tr.tolist()).most_common(1)[0][0]
        out[kind] = {"probe": float((pred == y_te).float().mean()), "majority": float((y_te == major).float().mean()),
                     "classes": len(labels)}

    def ids(rows, back):
        res = []
        for r in rows:
            toks = tok(r["context"], add_special_tokens=False)["input_ids"]
            res.append(toks[-1 - back] if len(toks) > back else -1)
        return res

    cases = {"token read (quote[0])": 0, "token before (quote[1] token)": 1, "two before (quote[2] token)": 2}
    for name, back in cases.items():
        i_tr, i_te = ids(tr, back), ids(te, back)
        keep_tr = [k for k, v in enumerate(i_tr) if v >= 0]
        keep_te = [k for k, v in enumerate(i_te) if v >= 0]
        pred = _ridge_to_embedding(x_tr[keep_tr], torch.tensor([i_tr[k] for k in keep_tr]), x_te[keep_te], emb)
        truth = torch.tensor([i_te[k] for k in keep_te])
        common = Counter(i_tr[k] for k in keep_tr).most_common(1)[0][0]
        out[name] = {"probe": float((pred == truth).float().mean()), "commonest": float((truth == common).float().mean()),
                     "rows": len(keep_te)}
    nxt_tr = [tok(r["next_token"], add_special_tokens=False)["input_ids"][0] for r in tr]
    nxt_te = [tok(r["next_token"], add_special_tokens=False)["input_ids"][0] for r in te]
    pred = _ridge_to_embedding(x_tr, torch.tensor(nxt_tr), x_te, emb)
    truth = torch.tensor(nxt_te)
    common = Counter(nxt_tr).most_common(1)[0][0]
    out["next token"] = {"probe": float((pred == truth).float().mean()),
                         "commonest": float((truth == common).float().mean()), "rows": len(nxt_te)}
    print(f"layer {out['layer']}: {out['rows_train']} training rows, {out['rows_test']} test rows (other articles)")
    print("| claim | probe top-1 | baseline |\n|---|---|---|")
    for k, v in out.items():
        if isinstance(v, dict):
            base = v.get("majority", v.get("commonest"))
            print(f"| {k} | {v['probe']:.3f} | {base:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")
    return out


if __name__ == "__main__":
    main()
