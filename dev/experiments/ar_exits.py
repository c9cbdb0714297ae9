"""A pair's AR read at each row's own block, against at its deepest block (issue 59): the warm-start only.

The AR of a pair for several blocks keeps blocks 0..K of the deepest block K and reads every row, whatever
its block, after block K through one identity-initialised head. A one-block pair's AR at block k keeps blocks
0..k: its head starts from "the residual stream after block k is the prediction", which is what the target
is. This trains, on a finished layered run's ``datagen/ar_sft.parquet`` and with the same loop, data order,
steps and learning rate for each variant:

- ``deep``: the pair's AR as nla builds it (every row read after block K, one head);
- ``exits``: the same trunk, a row of block k read after block k through a head of its own block (each
  identity-initialised): four one-block ARs sharing their blocks' weights. Its rows need blocks 0..k only,
  so in work it is sum(k + 1) / (rows x (K + 1)) of ``deep``'s blocks (printed; this script runs every
  block on every row, it measures the reading, not the time);
- ``heads``: ``deep``'s reading (every row after block K) through a head of the row's own block;
- ``exits2``: ``exits``, the shallowest block's rows read after the next block (two hops of attention, not one).

Both read the run's own layered AR texts ("Block k. Explanation: ..."), the training rows with their sentences
shuffled where the run's AR was (``shuffle_sentences``). Held out: the AR's own eval split
(``nla.train.ar``'s, whole documents). Prints each variant's held-out FVE per block (each block against its
own baseline: ``nla.core.vectors.fve`` on that block's rows) and writes ``ar_exits.json`` in OUT.

    python -m dev.experiments.ar_exits RUN --out OUT [--steps 1280] [--variants deep exits]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn


def reader(variant: str, side, cfg: dict, texts: list[str], blocks: np.ndarray, layers: list[int]):
    """The AR of ``variant`` built from the subject's blocks 0..K (seeded), its heads a block (identity), the
    parameters it trains and ``predict(rows) -> [n, d]`` for row indices of ``texts`` / ``blocks``."""
    from nla.core import arch
    from nla.core.reconstructor import Reconstructor, last_token_index, tokenize_ar_texts

    torch.manual_seed(int(cfg["seed"]))
    ar = Reconstructor.from_base(side.base_model, max(layers))
    tok = ar.tokenizer
    d = arch.hidden_size(ar.config)
    heads = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in layers])
    for h in heads:
        nn.init.eye_(h.weight)
    # the blocks' outputs by forward hooks kept for the whole run: nla.core.activations.blocks_outputs does the
    # same for extraction, but under inference_mode and stopping at the deepest block, so no gradient reaches them
    captured: dict[int, torch.Tensor] = {}
    dec = arch.decoder_layers(ar.base)

    def keep(k: int):
        def hook(_m, _i, out):
            captured[k] = out[0] if isinstance(out, tuple) else out
        return hook

    for k in layers:
        dec[k].register_forward_hook(keep(k))

    def predict(idx: np.ndarray) -> torch.Tensor:
        enc = tokenize_ar_texts(tok, [texts[i] for i in idx], int(cfg["max_length"]))
        if variant == "deep":
            return ar.predict(enc["input_ids"], enc["attention_mask"])
        mask = enc["attention_mask"]
        pos = (mask.long().cumsum(1) - 1).clamp_min(0)
        ar.base(input_ids=enc["input_ids"], attention_mask=mask, position_ids=pos, use_cache=False)
        last = last_token_index(mask)
        rows = torch.arange(len(idx))
        out = torch.empty(len(idx), d)
        for j, k in enumerate(layers):
            sel = torch.from_numpy(blocks[idx] == k)
            if sel.any():
                at = {"heads": max(layers), "exits2": layers[min(1, len(layers) - 1)] if k == layers[0] else k}
                read = captured[at.get(variant, k)]
                out[sel] = heads[j](read[rows[sel], last[sel]])
        return out

    params = list(ar.parameters()) if variant == "deep" else list(ar.base.parameters()) + list(heads.parameters())
    return ar, params, predict


def train_variant(variant: str, side, cfg: dict, data: dict, steps: int, eval_every: int) -> dict[str, object]:
    """One AR trained from the subject's blocks 0..K; its held-out FVE by block along the way."""
    from nla.core.vectors import fve, mse_nrm
    from nla.train.optim import build_optimizer, warmup_cosine

    texts, blocks, vecs, tr, ev = data["texts"], data["blocks"], data["vecs"], data["tr"], data["ev"]
    scale, layers = data["scale"], data["layers"]
    ar, params, predict = reader(variant, side, cfg, texts, blocks, layers)

    def evaluate(step: int) -> dict[str, object]:
        ar.eval()
        with torch.no_grad():
            pred = torch.cat([predict(ev[s:s + 256]) for s in range(0, len(ev), 256)])
        ar.train()
        gold = vecs[torch.from_numpy(ev)]
        per = {int(k): fve(pred[torch.from_numpy(blocks[ev] == k)], gold[torch.from_numpy(blocks[ev] == k)], scale)
               for k in layers}
        return {"step": step, "fve_by_block": per, "fve_pooled": fve(pred, gold, scale)}

    opt = build_optimizer(params, float(cfg["lr"]), float(cfg.get("weight_decay", 0.0)))
    sched = warmup_cosine(opt, min(int(cfg["warmup_steps"]), steps), steps, float(cfg["min_lr_ratio"]))
    b = int(cfg["batch_size"])
    rng = np.random.default_rng(int(cfg["seed"]))
    order = np.concatenate([rng.permutation(tr) for _ in range(steps * b // len(tr) + 1)])
    curve = []
    t0 = time.perf_counter()
    ar.train()
    for step in range(1, steps + 1):
        idx = order[(step - 1) * b: step * b]
        loss = mse_nrm(predict(idx), vecs[torch.from_numpy(idx)], scale).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, float(cfg["max_grad_norm"]))
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            curve.append(evaluate(step))
            e = curve[-1]
            print(f"{variant} step {step}: loss {float(loss.detach()):.4f}; held-out FVE by block "
                  + " / ".join(f"{v:.3f}" for v in e["fve_by_block"].values()) + f"; pooled {e['fve_pooled']:.3f}",
                  flush=True)
    return {"curve": curve, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    from nla.core.sidecar import load_sidecar
    from nla.datagen.io import read_parquet, read_vectors
    from nla.train.ar import _split_eval
    from nla.util.threads import apply_threads

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=1280)
    ap.add_argument("--variants", nargs="+", default=["deep", "exits"], choices=["deep", "exits", "heads", "exits2"])
    ap.add_argument("--eval-every", type=int, default=320)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    ckpt = sorted((a.run / "ar" / "checkpoints").glob("step_*"))[-1]
    cfg = yaml.safe_load((ckpt / "train_config.yaml").read_text())
    apply_threads(cfg["threads"])
    path = a.run / "datagen" / "ar_sft.parquet"
    side = load_sidecar(path)
    if not side.layers:
        raise SystemExit(f"{path}: not a dataset of several blocks (no extraction.layers)")
    table = read_parquet(path)
    texts = table.column("prompt").to_pylist()
    if cfg.get("shuffle_sentences"):  # training rows read as nla's warm-start reads them; held-out rows as written
        from types import SimpleNamespace

        from nla.train.ar import _shuffled_prompts

        shuffled = _shuffled_prompts(table, side, SimpleNamespace(seed=int(cfg["seed"]), dataset=str(path)))
    blocks = np.asarray(table.column("activation_layer").to_pylist(), dtype=np.int64)
    vecs = torch.from_numpy(np.array(read_vectors(table, source=path), dtype=np.float32))  # a writable copy
    tr, ev = _split_eval(table, float(cfg["eval_fraction"]), int(cfg["seed"]))
    if cfg.get("shuffle_sentences"):
        train_rows = set(tr.tolist())
        texts = [shuffled[i] if i in train_rows else t for i, t in enumerate(texts)]
    scale = side.mse_scale_value()
    layers = sorted(side.layers)
    work = float(np.mean(blocks[tr] + 1) / (max(layers) + 1))
    work2 = float(np.mean(np.where(blocks[tr] == layers[0], layers[min(1, len(layers) - 1)], blocks[tr]) + 1)
                  / (max(layers) + 1))
    print(f"{len(tr)} train / {len(ev)} eval rows; blocks {layers}; the block work of exits / exits2: {work:.3f} / "
          f"{work2:.3f} of deep's")
    results: dict[str, object] = {"run": str(a.run), "steps": a.steps, "train_rows": len(tr), "eval_rows": len(ev),
                                  "exits_block_work": work, "exits2_block_work": work2, "variants": {}}
    data = {"texts": texts, "blocks": blocks, "vecs": vecs, "tr": tr, "ev": ev, "scale": scale, "layers": layers}
    for variant in a.variants:
        results["variants"][variant] = train_variant(variant, side, cfg, data, a.steps, a.eval_every)
    (a.out / "ar_exits.json").write_text(json.dumps(results, indent=1))
    print("| block | " + " | ".join(a.variants) + " |")
    print("|---|" + "---|" * len(a.variants))
    for k in layers:
        print(f"| {k} | " + " | ".join(f"{results['variants'][v]['curve'][-1]['fve_by_block'][k]:.3f}"
                                       for v in a.variants) + " |")


if __name__ == "__main__":
    main()
