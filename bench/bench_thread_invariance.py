"""Which torch CPU ops give the same bits at 1 and 2 threads? (why nla fixes the thread count)

    python -m bench.bench_thread_invariance            # each case in a fresh process per thread count
    python -m bench.bench_thread_invariance --threads 1 4

Each case runs in a fresh process at each thread count (``torch.set_num_threads`` before any
op), hashes its outputs (and gradients), and the table says whether the hashes agree. A "no"
means a thread count that changes during a run (the ``--threads auto`` governor) changes what
is computed. BENCHMARKS.md, "Threads", records a run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys


def _h(*tensors) -> str:
    m = hashlib.md5()
    for t in tensors:
        m.update(t.detach().contiguous().numpy().tobytes())
    return m.hexdigest()[:10]


def _cases() -> dict[str, str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out: dict[str, str] = {}
    g = torch.Generator().manual_seed(0)
    for n in (4096, 65536, 1 << 20):
        x = torch.randn(n, generator=g)
        out[f"sum of {n:,} elements"] = _h(x.sum())
        out[f"vector_norm of {n:,} elements"] = _h(torch.linalg.vector_norm(x))
    y = torch.randn(4096, 1000, generator=g)
    out["softmax over rows, 4096 x 1000"] = _h(torch.softmax(y, -1))
    w = torch.randn(500, 128, requires_grad=True)
    w[torch.randint(0, 500, (100_000,), generator=g)].sum().backward()
    out["embedding-style gather backward"] = _h(w.grad)
    for L, T in ((1, 60), (1, 200), (60, 60)):
        q, k, v = (torch.randn(32, 4, n, 16, generator=g, requires_grad=True) for n in (L, T, T))
        mask = torch.ones(32, 1, L, T, dtype=torch.bool)
        if L == T:
            mask = mask.tril()
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        a.pow(2).sum().backward()
        out[f"attention forward, {L} quer{'y' if L == 1 else 'ies'} x {T} keys"] = _h(a)
        out[f"attention backward, {L} quer{'y' if L == 1 else 'ies'} x {T} keys"] = _h(q.grad, k.grad, v.grad)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(cfg)
    for T in (48, 54):
        ids = torch.randint(5, 500, (32, T), generator=g)
        mask = torch.ones_like(ids)
        for i in range(32):
            mask[i, T - (i * 7) % (T // 2):] = 0  # right padding of varied length
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        out[f"Llama d=64 forward + backward, padded length {T}"] = _h(*[p.grad for p in model.parameters()])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs=2, default=[1, 2])
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        import torch

        torch.set_num_threads(args.child)
        print(json.dumps(_cases()))
        return 0
    runs = []
    for n in args.threads:
        proc = subprocess.run([sys.executable, __file__, "--child", str(n)], capture_output=True, text=True,
                              check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    a, b = args.threads
    print(f"| op | same bits at {a} and {b} threads? |\n|---|---|")
    for key in runs[0]:
        print(f"| {key} | {'yes' if runs[0][key] == runs[1][key] else '**no**'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
