"""How much of a SmolLM2 vector the last few tokens of its text make (issue 56: why the round trip stops near 0.4).

    NLA_CACHE=DIR python -m dev.experiments.smollm2_context RUN/datagen [--ks 1 2 3 4 6 8 16] [--json PATH]

For each held-out row of a ``source: wikipedia`` datagen (``eval.parquet``) the subject itself is run on
only the last k tokens of the row's text (the article re-tokenised as extraction does, cut at the row's
position), after a fixed prefix or none, and its block-K state at the token, centred as the data is
(``extraction.vector_offset``), is scored against the row's vector with nla's FVE (``nla.core.vectors.fve``:
normalisation, the raw-mean baseline).

This bounds what an explanation that states k tokens of the text can give a reader that is a copy of the
subject (the AR is one, truncated at block K): with k = 1 the reader knows the token read and nothing of
what came before it, which is all the ``wiki`` language's quotation says. The AR can do better than the
subject run on the bare tokens (it learns a head and reads the topic, position and next-token claims), but
not by what the missing context holds. Ground truth only measures here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq
import torch
import yaml

PREFIXES = {"none": "", "Text:": "Text:", "a Wikipedia line": "The following is from a Wikipedia article:\n"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("datagen", type=Path, help="RUN/datagen of a source: wikipedia run")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from nla.core.activations import blocks_outputs, pad_right, tokenize_text
    from nla.core.vectors import fve
    from nla.datagen.extract import load_subject
    from nla.datagen.real_sources import wikipedia_corpus
    from nla.util.validation import safe_load_unique

    meta = yaml.safe_load((args.datagen / "eval.parquet.nla_meta.yaml").read_text())["extraction"]
    cfg = safe_load_unique((args.datagen / "datagen_config.yaml").read_text())
    if cfg.get("source") != "wikipedia":
        raise SystemExit(f"{args.datagen}: source is {cfg.get('source')!r}; this reads a source: wikipedia datagen")
    offset = torch.tensor(meta["vector_offset"] or [0.0] * meta["d_model"], dtype=torch.float32)
    scale, layer = meta["mse_scale"], meta["layer_index"]
    ev = pq.read_table(args.datagen / "eval.parquet", columns=["doc_id", "position", "context", "activation_vector"])
    ev = ev.to_pydict()
    model, tok = load_subject(meta["base_model"], "cpu")
    docs = {d.doc_id: d for d in wikipedia_corpus(cfg["n_docs"], cfg["seed"])}
    gold = torch.tensor(ev["activation_vector"], dtype=torch.float32)
    rows = []
    for i, (doc, pos) in enumerate(zip(ev["doc_id"], ev["position"], strict=True)):
        ids, _ = tokenize_text(tok, docs[doc].text, cfg["max_len"])
        rows.append(ids[: pos + 1])
        if i == 0 and tok.decode(rows[0]).strip() != ev["context"][0].strip():
            raise SystemExit("the re-tokenised text does not end where the row's context does: another corpus?")

    def states(seqs: list[list[int]]) -> torch.Tensor:
        out = []
        for i in range(0, len(seqs), 32):
            x, m = pad_right(seqs[i:i + 32], 0)
            with torch.no_grad():
                h = blocks_outputs(model, x, m, [layer])[layer]
            out.append(h[torch.arange(x.shape[0]), m.sum(1) - 1])
        return torch.cat(out) - offset

    full = fve(states(rows), gold, scale)
    print(f"{len(rows)} held-out rows, block {layer}; the whole text (a check: 1.0): FVE {full:.4f}", flush=True)
    table: dict[str, dict[int, float]] = {}
    for name, prefix in PREFIXES.items():
        pre = tok(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        table[name] = {}
        for k in args.ks:
            table[name][k] = round(fve(states([pre + r[-k:] for r in rows]), gold, scale), 4)
            print(f"prefix {name!r}, the last {k} token(s): FVE {table[name][k]:.3f}", flush=True)
    result = {"rows": len(rows), "layer": layer, "whole_text_fve": round(full, 4), "fve": table}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
