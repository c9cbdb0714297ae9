"""The same config and seed give the same numbers, whatever else the machine runs (issue 25).

Run A is the shared tiny quickstart run (a process of its own, as a user runs it, on an idle
machine as far as it knows; nla pins the CPU paths). Run B is the same command in a fresh process
with an empty world cache, so every stage from the world's tokenizer to the RL eval is computed
again, beside a competing busy process for the whole run, with the CPU paths pinned by hand. Before the fix, the thread count followed the machine's load (the governor
saw the busy process and dropped a thread) and the two runs differed from the first stage
on (warm-start FVE -0.2125955 vs -0.2125967, after RL -0.148 vs -0.053).

The competing process runs at nice 19: it takes every cycle nla leaves idle (and shows up as
busy CPU time in /proc/stat, which is what a load-following thread count reads) without
slowing run B several-fold, so the test stays within CI's budget.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PINNED_BY_HAND, busy_process, numpy_avx512_targets, user_environment

pytestmark = pytest.mark.slow

# Keys that measure time or name paths: they may differ between two runs of the same computation.
_NOT_METRICS = {"dataset", "seconds"}


def metrics(report: dict) -> dict[str, object]:
    """Every number and string of report.json's headline and both evals, keyed by path."""
    flat: dict[str, object] = {}

    def walk(x: object, path: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k not in _NOT_METRICS and not k.endswith("_seconds"):
                    walk(v, f"{path}/{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        else:
            flat[path] = x

    for part in ("headline", "eval_warmstart", "eval_rl"):
        walk(report[part], part)
    return flat


def test_metrics_ignore_time_and_paths_only():
    r = {"headline": {"fve": 0.5, "total_seconds": 3.0, "by_kind_rl": {"time": [1.0, 0.5]}},
         "eval_warmstart": {"rows": [{"fve": 0.1, "mse_mean": 1.2}], "dataset": "/a"},
         "eval_rl": {"n_rows": 64, "samples": [{"explanation": "x", "time_step": 1.0}]}}
    assert metrics(r) == {"headline/fve": 0.5, "headline/by_kind_rl/time[0]": 1.0,  # the fact kind "time" stays
                          "headline/by_kind_rl/time[1]": 0.5, "eval_warmstart/rows[0]/fve": 0.1,
                          "eval_warmstart/rows[0]/mse_mean": 1.2, "eval_rl/n_rows": 64,
                          "eval_rl/samples[0]/explanation": "x", "eval_rl/samples[0]/time_step": 1.0}


@pytest.mark.timeout(1500)  # two tiny quickstarts (the shared run and run B beside the busy process)
def test_tiny_quickstart_is_identical_beside_a_busy_process(tiny_quickstart_run, tmp_path):
    out = tmp_path / "run_b"
    # Run B's CPU paths are pinned by hand, every library written out (NumPy's targets read from NumPy),
    # where run A (the fixture, a user's shell) has nla pin them: a library nla's pin left to the CPU
    # runs its widest path in A and differs on a CPU whose widest path is not AVX2 (issue 61).
    by_hand = {**PINNED_BY_HAND, "NPY_DISABLE_CPU_FEATURES": numpy_avx512_targets()}
    env = {**user_environment(), **by_hand, "NLA_CACHE": str(tmp_path / "cache")}
    with busy_process():
        proc = subprocess.run([sys.executable, "-m", "nla.cli", "quickstart", "--preset", "tiny", "--out", str(out),
                               "--no-progress"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = metrics(json.loads((Path(tiny_quickstart_run) / "report.json").read_text()))
    b = metrics(json.loads((out / "report.json").read_text()))
    floats = [k for k, v in a.items() if isinstance(v, float) and math.isfinite(v)]
    assert len(floats) > 100  # the comparison covers the evals' numbers, not just a headline
    assert a["headline/threads"] == b["headline/threads"]
    diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert not diff, f"{len(diff)} report values differ, e.g. {sorted(diff.items())[:5]}"
