"""What the world's vectors hold beyond what an explanation can say (issue 25, item 4).

    python -m dev.experiments.ceiling_features runs/quickstart-default [RUN...]

The quickstart's oracle (an explanation naming every true fact and the quoted current word, read
by the AR) reaches FVE ~0.72. This asks which text features would lift it: for each feature set,
a ridge regression from one-hot features to the L2-normalised layer-K vector is fitted on a run's
``datagen/av_sft.parquet`` and scored on its ``datagen/ar_sft.parquet`` (other documents), as
FVE = 1 - MSE / MSE of predicting the training mean (the eval's baseline, up to the common scale).
A linear read of one-hot features is a floor on what the same words could give a trained AR.

Features, added one at a time: the true facts (``kind=value``), the explanation's current word,
the actual current token (the explanation quotes the word before a full stop or question mark,
so 19 % of positions say a word where the token is punctuation), the previous word, the word
before it, the position in the sentence, the words of the sentence so far, the position in the
story (buckets of 8 tokens).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

WORD = re.compile(r"[A-Za-z']+|[.?!,]")
SETS = (
    ("facts alone", ("facts",)),
    ("facts + current word (the oracle's words)", ("facts", "cw")),
    ("+ the current token", ("facts", "cw", "tok")),
    ("+ the previous word", ("facts", "cw", "tok", "w1")),
    ("+ the word before it", ("facts", "cw", "tok", "w1", "w2")),
    ("+ position in the sentence", ("facts", "cw", "tok", "w1", "w2", "spos")),
    ("+ words of the sentence so far", ("facts", "cw", "tok", "w1", "w2", "spos", "sbag")),
    ("+ position in the story", ("facts", "cw", "tok", "w1", "w2", "spos", "sbag", "pos")),
    ("the previous word alone", ("w1",)),
)


def load(path: Path) -> tuple[np.ndarray, list[dict]]:
    t = pq.read_table(path, columns=["activation_vector", "context", "token", "facts", "current_word", "position"])
    x = np.asarray(t.column("activation_vector").to_pylist(), dtype=np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    rows = []
    cols = (t.column(c).to_pylist() for c in ("context", "token", "facts", "current_word", "position"))
    for ctx, tok, facts, cw, pos in zip(*cols, strict=True):
        words = WORD.findall(ctx)
        sentence = WORD.findall(re.split(r"(?<=[.?!])\s+", ctx.strip())[-1])
        rows.append({"facts": list(facts), "cw": [f"cw={cw.lower()}"], "tok": [f"tok={tok.strip().lower()}"],
                     "w1": [f"w1={words[-2].lower() if len(words) > 1 else '^'}"],
                     "w2": [f"w2={words[-3].lower() if len(words) > 2 else '^'}"],
                     "spos": [f"spos={min(len(sentence), 12)}"], "pos": [f"pos={pos // 8}"],
                     "sbag": [f"sb={w.lower()}" for w in sentence[:-1]]})
    return x, rows


def one_hot(rows: list[dict], keys: tuple[str, ...], vocab: dict[str, int] | None = None):
    feats = [[f for k in keys for f in r[k]] for r in rows]
    if vocab is None:
        vocab = {f: i for i, f in enumerate(sorted({f for fs in feats for f in fs}))}
    m = np.zeros((len(rows), len(vocab) + 1))
    m[:, -1] = 1.0  # intercept
    for i, fs in enumerate(feats):
        for f in fs:
            if f in vocab:  # a value never seen in training contributes nothing
                m[i, vocab[f]] = 1.0
    return m, vocab


def ridge_fve(x_tr, r_tr, x_te, r_te, keys, lam: float = 1.0) -> float:
    a, vocab = one_hot(r_tr, keys)
    b, _ = one_hot(r_te, keys, vocab)
    w = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ x_tr)
    mse = ((b @ w - x_te) ** 2).sum(1).mean()
    base = ((x_te - x_tr.mean(0)) ** 2).sum(1).mean()
    return float(1.0 - mse / base)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="quickstart run directories")
    args = ap.parse_args(argv)
    table = {}
    for run in args.runs:
        tr, te = run / "datagen" / "av_sft.parquet", run / "datagen" / "ar_sft.parquet"
        for p in (tr, te):
            if not p.is_file():
                raise SystemExit(f"ceiling_features: {p} not found; pass run directories of `nla quickstart`")
        x_tr, r_tr = load(tr)
        x_te, r_te = load(te)
        table[run.name] = [ridge_fve(x_tr, r_tr, x_te, r_te, keys) for _, keys in SETS]
        print(f"{run.name}: {len(r_tr)} train / {len(r_te)} test rows", file=sys.stderr)
    names = list(table)
    print("| features (ridge, held-out FVE) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for i, (label, _) in enumerate(SETS):
        print(f"| {label} | " + " | ".join(f"{table[n][i]:.3f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
