"""Torch CPU threads under contention: policy-update-like forward+backward, 1..N threads.

Each setting runs in a fresh subprocess (``torch.set_num_threads`` before any work) for
``--seconds``; ``--busy`` adds one competing busy process (a Python spin loop) during the
second pass. Prints iterations/s and the ratio to 1 thread measured in the same run. This is
the measurement behind ``nla.threads``' default.

    python bench/bench_threads.py --model /tmp/exp/qs3/av/checkpoints/step_00000500 --threads 1 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

WORKER = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[2]))
m = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.randint(0, m.config.vocab_size, (int(sys.argv[4]), int(sys.argv[5])))
def step():
    m(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
step()
t, k = time.perf_counter(), 0
while time.perf_counter() - t < float(sys.argv[3]):
    step(); k += 1
print(k / (time.perf_counter() - t))
"""

SPIN = "while True: pass"


def run(model: str, threads: int, seconds: float, batch: int, length: int) -> float:
    out = subprocess.run([sys.executable, "-c", WORKER, model, str(threads), str(seconds), str(batch), str(length)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF causal LM directory (e.g. the default world AV)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=60)
    ap.add_argument("--no-busy", action="store_true", help="skip the pass with a competing busy process")
    args = ap.parse_args()
    passes = [("as is", False)] + ([] if args.no_busy else [("+1 busy process", True)])
    print(f"forward+backward of {args.batch} x {args.length} tokens, fp32; load at start: "
          f"{open('/proc/loadavg').read().split()[0]}")
    print(f"{'load':<18}{'threads':>8}{'it/s':>10}{'vs 1 thread':>13}")
    for name, busy in passes:
        spin = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
        try:
            time.sleep(0.5 if busy else 0.0)
            rates = {n: run(args.model, n, args.seconds, args.batch, args.length) for n in args.threads}
        finally:
            if spin is not None:
                spin.kill()
                spin.wait()
        base = rates.get(1, next(iter(rates.values())))
        for n, r in rates.items():
            print(f"{name:<18}{n:>8}{r:>10.2f}{r / base:>12.2f}x")


if __name__ == "__main__":
    main()
