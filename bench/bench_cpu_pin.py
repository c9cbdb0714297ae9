"""What the CPU pin costs: the tiny quickstart's stages under each NLA_CPU_PIN mode, interleaved.

Each round runs `nla quickstart --preset tiny` once per mode, in turn, each a fresh process with an
empty NLA_CACHE and its own --out (every stage computed), and reads the stage times from its
report.json. Modes (nla.util.numerics):
- pinned: the default pin (ATen AVX2; MKL's AVX2 CNR branch on Intel, AUTO elsewhere; NumPy, OpenBLAS,
  oneDNN on their AVX2 paths);
- portable: the same with MKL's COMPATIBLE branch (every x86 vendor agrees);
- off: nothing pinned (each library's widest path on this CPU).

Prints per mode the median over rounds of the stages' total and of each stage, and each mode's
ratio to `off` per round (the pin's cost: a ratio above 1 is slower), with the round-trip FVE each
mode reached (pinned and portable give their own numbers, off this CPU's own).

    python -m bench.bench_cpu_pin --rounds 2 [--modes pinned portable off] [--preset tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nla.util.numerics import OPT_OUT, pins  # noqa: E402

PIN_VARS = (*(p.var for p in pins()), OPT_OUT)
MODE_ENV = {"pinned": {}, "portable": {"NLA_CPU_PIN": "portable"}, "off": {"NLA_CPU_PIN": "off"}}


def run_once(mode: str, preset: str, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARS}  # a clean shell: nla pins by itself
    env.update(MODE_ENV[mode])
    env["NLA_CACHE"] = str(work / "cache")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nla.cli", "quickstart", "--preset", preset, "--out",
                           str(work / "run"), "--no-progress"], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: quickstart failed\n{proc.stderr[-2000:]}")
    rep = json.loads((work / "run" / "report.json").read_text())
    stages = {s["name"]: s["seconds"] for s in rep["stages"] if not s.get("cached")}
    return {"wall": wall, "stages": stages, "total": sum(stages.values()),
            "fve": (rep["headline"]["round_trip_fve_warmstart"], rep["headline"]["round_trip_fve_rl"]),
            "paths": rep["headline"].get("cpu_paths")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["pinned", "portable", "off"], choices=sorted(MODE_ENV))
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args(argv)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            with tempfile.TemporaryDirectory(prefix=f"pin-{mode}-") as tmp:
                res = run_once(mode, args.preset, Path(tmp))
            results[mode].append(res)
            print(f"round {r + 1} {mode}: stages {res['total']:.1f} s, FVE {res['fve'][0]:.3f} -> {res['fve'][1]:.3f}, "
                  f"{res['paths']}", flush=True)
    base = "off" if "off" in results else args.modes[0]
    print(f"\n{'mode':<10} {'stages s (median)':>18} {'ratio to ' + base + ' per round':>26}")
    for mode, runs in results.items():
        ratios = [a["total"] / b["total"] for a, b in zip(runs, results[base], strict=True)]
        print(f"{mode:<10} {statistics.median(r['total'] for r in runs):>18.1f} "
              f"{' / '.join(f'{x:.2f}' for x in ratios):>26}")
    names = list(results[args.modes[0]][0]["stages"])
    print("\nper stage, median s: " + ", ".join(
        f"{n} " + " / ".join(f"{statistics.median(r['stages'][n] for r in results[m]):.1f}" for m in args.modes)
        for n in names) + f"  ({' / '.join(args.modes)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
