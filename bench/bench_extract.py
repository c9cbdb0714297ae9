"""Benchmark datagen: extraction throughput on the world subject model, and 100k-row vector load time.

    .venv/bin/python -m bench.bench_extract [--preset tiny] [--docs 400] [--rows 100000]

Prints tokens/s of `extract_activations` (batched, hook stops after block K)
against a plain one-document-at-a-time `output_hidden_states=True` loop, and
the time to load a 100k-row activation parquet with `read_vectors`
(zero-copy) against a `to_pylist()` reader.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch


def bench_extract(preset: str, n_docs: int, batch_size: int, world_out: str | None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla.datagen.corpus import world_corpus
    from nla.datagen.extract import extract_activations
    from nla.world import build_world

    arts = build_world(preset, out=world_out)
    layer = arts.config.default_layer
    docs = world_corpus(arts.config.seed, n_docs)
    with tempfile.TemporaryDirectory() as tmp:
        # warm-up: first-time imports inside transformers would otherwise dominate a small run
        extract_activations(arts.subject_dir, docs[:8], layer, 8, 4, 0, batch_size, f"{tmp}/warm", 64)
        t0 = time.perf_counter()
        res = extract_activations(
            arts.subject_dir, docs, layer, 8, 4, 0, batch_size, tmp, arts.config.seq_len
        )
        dt = time.perf_counter() - t0
    print(f"extract  [{preset}, d={res.d_model}, layer {layer}, {n_docs} docs, batch {batch_size}]: "
          f"{res.n_tokens} tokens, {res.n_rows} rows in {dt:.2f}s -> {res.n_tokens / dt:,.0f} tokens/s "
          f"(incl. model load, warm imports)")  # fmt: skip

    model = AutoModelForCausalLM.from_pretrained(arts.subject_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(arts.subject_dir)
    n_ref = min(100, n_docs)
    t0 = time.perf_counter()
    n_tok = 0
    with torch.inference_mode():
        for d in docs[:n_ref]:
            ids = tok(d.text, truncation=True, max_length=arts.config.seq_len)["input_ids"]
            n_tok += len(ids)
            model(torch.tensor([ids]), output_hidden_states=True)
    ref = n_tok / (time.perf_counter() - t0)
    print(f"baseline [one doc per forward, all layers, {n_ref} docs]: {ref:,.0f} tokens/s "
          f"-> batched extract is {res.n_tokens / dt / ref:.1f}x")  # fmt: skip


def bench_load(rows: int, d: int) -> None:
    from nla.datagen.io import read_vectors, vectors_to_arrow, write_parquet_atomic

    v = np.random.default_rng(0).standard_normal((rows, d)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "acts.parquet"
        write_parquet_atomic(
            pa.table({"activation_vector": vectors_to_arrow(v), "doc_id": np.arange(rows)}), path
        )
        size = path.stat().st_size / 2**20
        t0 = time.perf_counter()
        arr = read_vectors(path)
        t_fast = time.perf_counter() - t0
        assert isinstance(arr, np.ndarray) and arr.dtype == np.float32 and arr.shape == (rows, d)
        t0 = time.perf_counter()
        slow = np.asarray(pq.read_table(path).column("activation_vector").to_pylist(), dtype=np.float32)
        t_slow = time.perf_counter() - t0
        assert np.array_equal(arr, slow)
        # The page checksums every nla read verifies (issue 21): the same file read with and
        # without verification, interleaved, median of 7 each.
        plain, verified = [], []
        for _ in range(7):
            for verify, times in ((False, plain), (True, verified)):
                t0 = time.perf_counter()
                pq.read_table(path, page_checksum_verification=verify)
                times.append(time.perf_counter() - t0)
        t_plain, t_verified = float(np.median(plain)), float(np.median(verified))
    print(f"load     [{rows:,} rows x d={d}, {size:.0f} MiB parquet]: read_vectors {t_fast:.3f}s, "
          f"to_pylist reader {t_slow:.3f}s -> {t_slow / t_fast:.0f}x faster")  # fmt: skip
    print(f"checksum [same file, read_table median of 7]: verified {t_verified:.4f}s vs unverified "
          f"{t_plain:.4f}s -> verification costs {t_verified / t_plain:.2f}x")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--world-out", default=None, help="world build dir (default: $NLA_CACHE/world)")
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--d", type=int, default=128, help="vector width for the load benchmark")
    p.add_argument("--skip-extract", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_load(args.rows, args.d)
    if not args.skip_extract:
        bench_extract(args.preset, args.docs, args.batch_size, args.world_out)


if __name__ == "__main__":
    main()
