"""The pair's AR step with each row read at its own block (``ar.exits``) against every row read after the deepest.

One AR training step's forward and backward (``Reconstructor.predict`` then the mean ``mse_nrm``, no optimiser) on
a batch of ``--batch`` rows, the rows' blocks spread evenly over ``--layers``, for the AR of a pair of several blocks
built both ways from the same subject: ``deep`` (every row after block K, ``_predict_last_block``) and ``exits``
(``set_exits``: a row of block k after block max(k, 1), the rows stopping at their exit). Random token ids of the
subject's vocabulary, lengths drawn from ``--min-len``..``--max-len``, right-padded (the training layout): the
step's cost does not depend on what the text says. The two run in turn, ``--repeat`` rounds, the first not
counted; prints the median milliseconds of each and their ratio (measured in one run).

Subject: the default world's (``--world``, built or read from the cache), or any HF model directory (``--model``).

    python -m bench.bench_ar_exits [--world default | --model DIR] [--layers 0 1 2 3] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(model_dir: str, layers: list[int], batch: int, lengths: tuple[int, int], repeat: int,
            seed: int = 0) -> dict:
    import torch

    from nla.core.reconstructor import Reconstructor
    from nla.core.vectors import mse_nrm

    torch.manual_seed(seed)
    deep = Reconstructor.from_base(model_dir, max(layers)).train()
    exits = Reconstructor.from_base(model_dir, max(layers)).train()
    exits.set_exits(layers)
    d, vocab = deep.config.hidden_size, deep.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (batch,), generator=gen)
    T = int(lens.max())
    ids = torch.randint(4, vocab, (batch, T), generator=gen)
    mask = (torch.arange(T)[None, :] < lens[:, None]).long()
    ids = ids * mask
    blocks = [layers[i % len(layers)] for i in range(batch)]
    gold = torch.randn(batch, d, generator=gen)
    times: dict[str, list[float]] = {"deep": [], "exits": []}
    for _ in range(repeat):
        for name, ar in (("deep", deep), ("exits", exits)):
            t0 = time.perf_counter()
            kw = {} if name == "deep" else {"blocks": blocks}
            mse_nrm(ar.predict(ids, mask, **kw), gold, float(d) ** 0.5).mean().backward()
            times[name].append(time.perf_counter() - t0)
            ar.zero_grad(set_to_none=True)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {"d_model": d, "blocks_kept": max(layers) + 1, "exits": dict(exits.exits), "batch": batch,
            "padded_length": T, "seconds": med, "exits_over_deep": med["exits"] / med["deep"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="default", help="the world preset whose subject is read (built or cached)")
    ap.add_argument("--model", help="an HF model directory instead of a world's subject")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=90)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=21, help="rounds of each, in turn (the first is not counted)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from nla.util.threads import apply_threads

    apply_threads(args.threads)
    from nla.util.numerics import cpuinfo_field

    if args.model:
        model_dir = args.model
    else:
        from nla.world import build_world

        model_dir = str(build_world(args.world, progress=False).subject_dir)
    r = measure(model_dir, args.layers, args.batch, (args.min_len, args.max_len), args.repeat)
    r.update(cpu=cpuinfo_field("model name"), threads=args.threads, model=model_dir)
    s = r["seconds"]
    print(f"CPU: {r['cpu']}; {args.threads} thread(s); d_model {r['d_model']}, blocks 0..{r['blocks_kept'] - 1}, "
          f"exits {r['exits']}, batch {r['batch']} padded to {r['padded_length']}")
    print(f"AR step (forward + backward): deep {1000 * s['deep']:.1f} ms, exits {1000 * s['exits']:.1f} ms: "
          f"exits/deep {r['exits_over_deep']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
