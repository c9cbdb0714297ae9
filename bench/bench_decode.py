"""The rollout's decode, eager vs captured (``rollout.decode``), in tokens/s at several batch sizes.

A shape preset's model (``nla.core.shapes``, random weights, optionally at a test width) with
Qwen2.5's real tokenizer and the default AV prompt; ``nla.rl.sampling.sample_responses`` decodes
``--len`` tokens per row, greedy (no row ends: EOS is a token the model is kept from writing, the
worst case), once eager and once captured, in turn, ``--repeat`` times; the tokens should agree. Printed:
tokens/s of each and their ratio per batch. On a GPU the captured step is a CUDA graph; on a CPU
the static cache runs without one (a check of the path, not a speed claim).

    python -m bench.bench_decode --shape qwen2.5-0.5b --rows 64 1024 [--len 150] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    import torch

    from bench.bench_gpu_scale import at_test_width, qwen_tokenizer
    from nla.core.injection import InjectionHook
    from nla.core.shapes import SHAPES, get_shape
    from nla.core.sidecar import NLAConfig
    from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR
    from nla.core.token_ids import canonical_av_prompt_ids
    from nla.rl.sampling import sample_responses
    from nla.train.device import resolve_device, resolve_dtype

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--samples", type=int, default=8, help="rows per prompt (the prefill runs per prompt)")
    ap.add_argument("--len", type=int, default=150)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--width", type=int, help="a test width (keeps the vocabulary)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()

    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    shape = at_test_width(get_shape(args.shape), args.width, args.layers)
    tok = qwen_tokenizer()
    torch.manual_seed(0)
    model = shape.build(dtype=dtype, device=device).eval()
    d = model.config.hidden_size
    side = NLAConfig.from_tokenizer(tok, kind="nla_model", role="av", d_model=d, layer_index=0,
                                    av_template=DEFAULT_AV_TEMPLATE, ar_template=DEFAULT_AR_TEMPLATE,
                                    injection_char=DEFAULT_INJECTION_CHAR, injection_scale="sqrt_d_model")
    hook = InjectionHook.from_config(model, side)
    prompt = torch.tensor(canonical_av_prompt_ids(tok, side.av_messages()))
    eos = tok.eos_token_id
    rows = []
    for n in args.rows:
        prompts = max(1, n // args.samples)
        vectors = torch.randn(prompts, d, generator=torch.Generator().manual_seed(n))
        times: dict[str, list[float]] = {"eager": [], "captured": []}
        tokens = {}
        for _ in range(args.repeat):
            for decode in ("eager", "captured"):
                torch.manual_seed(1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                out = sample_responses(model, hook, prompt, vectors, args.samples, args.len, eos, eos,
                                       suppress_ids=[eos, side.injection_token_id], greedy=True, decode=decode)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[decode].append(time.perf_counter() - t)
                tokens[decode] = out.cpu()
        same = torch.equal(tokens["eager"], tokens["captured"])
        n_tok = tokens["eager"].numel()
        best = {k: min(v) for k, v in times.items()}
        row = {"rows": prompts * args.samples, "tokens": n_tok, "eager_tok_s": n_tok / best["eager"],
               "captured_tok_s": n_tok / best["captured"], "ratio": best["eager"] / best["captured"],
               "same_tokens": same}
        rows.append(row)
        print(f"{row['rows']:>5} rows x {args.len}: eager {row['eager_tok_s']:,.0f} tok/s, captured "
              f"{row['captured_tok_s']:,.0f} tok/s: {row['ratio']:.2f}x; same tokens: {same}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape.name, "device": str(device), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
