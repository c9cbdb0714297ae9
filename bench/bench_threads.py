"""Torch CPU threads under contention: policy-update-like forward+backward, 1..N threads.

Each setting runs in a fresh subprocess (``torch.set_num_threads`` before any work) for
``--seconds``; ``--busy`` adds one competing busy process (a Python spin loop) during the
second pass, and ``--late-busy`` a third pass in which it starts halfway through. A thread
setting of ``auto`` is the opt-in governor (``nla.util.threads.apply_threads("auto")``,
``adapt_threads()`` every step); the default is a fixed count (every core). Prints iterations/s
and the ratio to 1 thread measured in the same run, and for ``auto`` the thread counts it
chose: what a fixed count costs on a shared machine (BENCHMARKS.md, "Threads").

    python -m bench.bench_threads --model /tmp/exp/qs3/av/checkpoints/step_00000500 --threads 1 2 auto --late-busy
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

WORKER = r"""
import collections, sys, time, torch
from transformers import AutoModelForCausalLM
from nla.util.threads import adapt_threads, apply_threads
auto = sys.argv[2] == "auto"
apply_threads("auto" if auto else int(sys.argv[2]))
m = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.randint(0, m.config.vocab_size, (int(sys.argv[4]), int(sys.argv[5])))
def step():
    m(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
step()
t, k, used = time.perf_counter(), 0, collections.Counter()
while time.perf_counter() - t < float(sys.argv[3]):
    used[adapt_threads()] += 1
    step(); k += 1
print(k / (time.perf_counter() - t), dict(sorted(used.items())))
"""

SPIN = "while True: pass"


def run(model: str, threads: str, seconds: float, batch: int, length: int, spin_after: float | None = None
        ) -> tuple[float, str]:
    """it/s of one setting in a fresh process, and the steps run at each thread count; with
    ``spin_after``, a busy process starts that many seconds into the timed part."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, model, threads, str(seconds), str(batch), str(length)],
                            stdout=subprocess.PIPE, text=True, env=env)
    spin = None
    if spin_after is not None:
        time.sleep(3.0 + spin_after)  # model load + warm-up step take about 3 s here
        spin = subprocess.Popen([sys.executable, "-c", SPIN])
    out, _ = proc.communicate()
    if spin is not None:
        spin.kill()
        spin.wait()
    if proc.returncode:
        raise SystemExit(f"worker for threads={threads} failed (exit {proc.returncode})")
    rate, used = out.strip().splitlines()[-1].split(" ", 1)
    return float(rate), used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF causal LM directory (e.g. the default world AV)")
    ap.add_argument("--threads", nargs="+", default=["1", "2", "auto"], help="thread counts, or auto")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=60)
    ap.add_argument("--no-busy", action="store_true", help="skip the pass with a competing busy process")
    ap.add_argument("--late-busy", action="store_true", help="add a pass whose busy process starts halfway")
    args = ap.parse_args()
    passes = [("as is", False)] + ([] if args.no_busy else [("+1 busy process", True)]) + (
        [("busy from halfway", "late")] if args.late_busy else [])
    print(f"forward+backward of {args.batch} x {args.length} tokens, fp32; load at start: "
          f"{open('/proc/loadavg').read().split()[0]}")
    print(f"{'load':<18}{'threads':>8}{'it/s':>10}{'vs 1 thread':>13}  steps at each thread count")
    for name, busy in passes:
        spin = subprocess.Popen([sys.executable, "-c", SPIN]) if busy is True else None
        try:
            time.sleep(0.5 if busy is True else 0.0)
            late = args.seconds / 2 if busy == "late" else None
            rates = {n: run(args.model, n, args.seconds, args.batch, args.length, late) for n in args.threads}
        finally:
            if spin is not None:
                spin.kill()
                spin.wait()
        base = rates.get("1", next(iter(rates.values())))[0]
        for n, (r, used) in rates.items():
            print(f"{name:<18}{n:>8}{r:>10.2f}{r / base:>12.2f}x  {used}")


if __name__ == "__main__":
    main()
