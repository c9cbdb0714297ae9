"""Checksum verification at load: the first load of a checkpoint on a machine vs every later one.

    python -m bench.bench_checkpoint_load [--gib 2]

Writes a safetensors file of ``--gib`` GiB with its ``nla_checksums.sha256`` record, then times
``nla.util.checkpoint_files.verify_checksums`` in fresh processes (what every policy, reference and rollout
copy, and every rank, does at start): with ``NLA_VERIFY_CHECKSUMS=always`` (every load hashes:
the behaviour before issue 23), the first ``once`` load (hashes and records), and a later ``once``
load (reads the machine's record). Prints seconds and the ratio to the ``always`` load measured
in the same run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CODE = "import sys; from nla.util.checkpoint_files import verify_checksums; verify_checksums(sys.argv[1])"


def timed(ckpt: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CODE, str(ckpt)], env=env, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file

    from nla.util.checkpoint_files import write_checksums

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        n = int(args.gib * 2**30 / 4)
        save_file({"w": torch.zeros(n, dtype=torch.float32)}, str(ckpt / "model.safetensors"))
        write_checksums(ckpt)
        base = {**os.environ, "NLA_CACHE": str(Path(tmp) / "cache")}
        timed(ckpt, {**base, "NLA_VERIFY_CHECKSUMS": "off"})  # warm the page cache and the imports
        off = timed(ckpt, {**base, "NLA_VERIFY_CHECKSUMS": "off"})
        always = timed(ckpt, {**base, "NLA_VERIFY_CHECKSUMS": "always"})
        first = timed(ckpt, {**base, "NLA_VERIFY_CHECKSUMS": "once"})
        later = [timed(ckpt, {**base, "NLA_VERIFY_CHECKSUMS": "once"}) for _ in range(3)]
    print(f"{args.gib:g} GiB safetensors file, one fresh process per load (import included)")
    print("| load | seconds | / always |")
    print("|---|---|---|")
    for name, t in (("always (every load hashes)", always), ("once, first load on the machine", first),
                    ("once, every later load (median of 3)", sorted(later)[1]), ("off (no hashing)", off)):
        print(f"| {name} | {t:.2f} | {t / always:.2f} |")


if __name__ == "__main__":
    main()
