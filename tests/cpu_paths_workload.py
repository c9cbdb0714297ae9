"""A small workload that touches every numeric library nla pins (run as a script by tests/test_numerics.py).

Prints one JSON object: a digest of each library's outputs, and the code paths read back after the
work (``nla.util.numerics.cpu_paths``). With ``--import-nla`` nla is imported first, as the CLI does,
so its pin applies; without, the libraries choose their paths from the environment alone (nla is
imported only after the work, to read the paths back).
"""

from __future__ import annotations

import hashlib
import json
import sys

if "--import-nla" in sys.argv:
    import nla  # noqa: F401  (the pin, before torch and NumPy load)

import numpy as np
import torch

torch.set_num_threads(1)


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)).tobytes())
    return h.hexdigest()[:16]


g = torch.Generator().manual_seed(0)
x = torch.randn(64, 96, generator=g)
w = torch.randn(96, 80, generator=g)
q, k, v = (torch.randn(2, 4, 16, 32, generator=g) for _ in range(3))
logits = torch.randn(32, 1000, generator=g)
big = torch.randn(200_003, generator=g)
rng = np.random.default_rng(0)
f32 = rng.standard_normal(100_003).astype(np.float32)
f64 = rng.standard_normal(100_003)
m64 = rng.standard_normal((129, 257))

out = {
    # ATen's own vectorised kernels
    "aten": digest(logits.softmax(-1), logits.log_softmax(-1),
                   torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
    # MKL: GEMMs and its vector math (torch's exp/log/sqrt on large contiguous tensors)
    "mkl": digest(x @ w, torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)), torch.dot(big, big),
                  big.exp(), big.abs().log(), big.abs().sqrt()),
    # NumPy's dispatched ufuncs and its sort (an unstable argsort orders ties by the sort network it runs)
    "numpy": digest(np.exp(f64), np.log(np.abs(f64)), np.log1p(np.abs(f32)), np.argsort(np.round(f64, 1))),
    # OpenBLAS (NumPy's matmul)
    "openblas": digest(m64 @ m64.T),
}

from nla.util.numerics import cpu_paths  # noqa: E402  (after the work: reading the paths back)

out["paths"] = cpu_paths()
print(json.dumps(out))
