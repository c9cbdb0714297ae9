"""The AV warm-start's step with and without ``share_prompt_head``, timed in turn in one process.

One micro-batch of a run's AV training rows (its ``datagen/av_sft.parquet``, the vectors injected as
``nla train av`` injects them), forward and backward through ``nla.train.av.token_losses``: the plain
per-row forward (every row runs its whole prompt; the LM head on every position) against the shared
head (the prompt's common tokens once per batch, the LM head on the response only). The two are
timed alternately, ``--reps`` times each after one warm-up of each; the ratio is of the medians. The
loss and the gradients of the two are compared too (they must agree to float rounding).

    .venv/bin/python -m bench.bench_av_shared_head --run RUN            # RUN: an smollm2 quickstart's dir
    .venv/bin/python -m bench.bench_av_shared_head --run RUN --model RUN/av/checkpoints/step_00000250
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from nla.core.injection import InjectionHook
from nla.core.sidecar import load_sidecar
from nla.train.av import build_examples, collate, shared_prompt_head, token_losses
from nla.util.threads import apply_threads


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a quickstart run dir (its datagen/av_sft.parquet is read)")
    p.add_argument("--model", default=None, help="the AV weights (default: the dataset sidecar's base model)")
    p.add_argument("--batch", type=int, default=16, help="rows per micro-batch (the smollm2 preset's 16)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    apply_threads(a.threads)
    dataset = Path(a.run) / "datagen" / "av_sft.parquet"
    side = load_sidecar(dataset)
    model_dir = a.model or side.base_model
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = pq.read_table(dataset, columns=["prompt", "response", "activation_vector"]).slice(0, a.batch).to_pylist()
    ex = build_examples(tok, [r["prompt"] for r in rows], [r["response"] for r in rows], side.injection_char,
                        a.max_length)
    vectors = torch.tensor(np.array([r["activation_vector"] for r in rows]), dtype=torch.float32)
    shared = shared_prompt_head(ex, side.injection_token_id, side.injection_left_neighbor_id)
    hook = InjectionHook.from_config(model, side)
    batch = collate(ex, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, "right")

    def step(k: int) -> tuple[float, float, torch.Tensor]:
        model.zero_grad()
        t0 = time.perf_counter()
        with hook.vectors(vectors):
            nll, m = token_losses(model, batch, torch.device("cpu"), k)
        loss = (nll * m).sum() / m.sum()
        loss.backward()
        seconds = time.perf_counter() - t0
        return seconds, float(loss.detach()), torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])

    _, loss_plain, g_plain = step(0)
    _, loss_shared, g_shared = step(shared)
    times: dict[int, list[float]] = {0: [], shared: []}
    for _ in range(a.reps):
        for k in (0, shared):
            times[k].append(step(k)[0])
    plain, fast = statistics.median(times[0]), statistics.median(times[shared])
    out = {"prompt_tokens": len(ex[0].prompt_ids), "shared_tokens": shared,
           "response_tokens_mean": float(np.mean([len(e.response_ids) for e in ex])),
           "plain_s": plain, "shared_s": fast, "ratio": plain / fast, "loss_plain": loss_plain,
           "loss_shared": loss_shared, "grad_rel_diff": float((g_plain - g_shared).norm() / g_plain.norm())}
    print(f"{a.batch} rows, prompt {out['prompt_tokens']} tokens of which {shared} shared, response "
          f"{out['response_tokens_mean']:.1f} tokens on average; {a.threads} threads, {a.reps} steps each")
    print(f"plain  {plain:.2f} s a step ({', '.join(f'{t:.2f}' for t in times[0])})")
    print(f"shared {fast:.2f} s a step ({', '.join(f'{t:.2f}' for t in times[shared])})")
    print(f"ratio {out['ratio']:.2f}x; loss {loss_plain:.7f} vs {loss_shared:.7f}; gradients differ by "
          f"{out['grad_rel_diff']:.1e} (relative norm)")
    return out


if __name__ == "__main__":
    main()
