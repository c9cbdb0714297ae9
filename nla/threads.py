"""How many CPU threads torch uses: one rule, resolved once, applied by every stage.

Precedence (``resolve_threads``):

1. an explicit setting (a config's ``threads`` field or ``--threads``) wins;
2. else ``OMP_NUM_THREADS`` when set to a positive integer (the usual way a scheduler or a
   user caps a job; an unparsable value is an error naming the variable);
3. else ``max(1, cores // 2 // processes)``: half of the cores this process may run on
   (``os.sched_getaffinity``), shared among ``processes`` workers of the same job (Ray actors).

Why not torch's default (one thread per core): its OpenMP workers spin at barriers, so on a
machine where another job is busy, every parallel region waits for a thread that has no
core. Measured on the 2-core development machine with ``bench/bench_threads.py`` (default
world AV, d=128, 4 blocks, fp32, forward + backward of a 32 x 60 batch, the lead's two
training jobs running; BENCHMARKS.md, "Threads"): 1 thread 5.83 it/s, 2 threads 0.54 it/s
(11x slower); with one more busy process, 2.96 vs 0.19 it/s (16x slower). Issue 14 measured
6x (policy update) and 10x (one rollout) with one competing job. Half the cores does not
collapse that way under one competing job of the same kind, and on an idle machine it gives
up at most the other half (at most 2x on two cores).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

ENV_VAR = "OMP_NUM_THREADS"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def resolve_threads(requested: int | None = None, *, processes: int = 1,
                    env: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """Torch CPU threads for one process: ``requested`` > ``$OMP_NUM_THREADS`` > ``cores // 2 // processes``.

    processes: workers of this job sharing the machine (the default is divided among them;
    an explicit setting or the environment variable is per process and is not divided).
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested <= 0:
            raise ValueError(f"threads: expected a positive integer or null (automatic), found {requested!r}")
        return requested
    env = os.environ if env is None else env
    raw = env.get(ENV_VAR, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"{ENV_VAR}: expected a positive integer, found {raw!r}; "
                             f"unset it or set e.g. {ENV_VAR}=1")
        return value
    cores = available_cores() if cores is None else cores
    return max(1, cores // 2 // max(1, processes))


def apply_threads(requested: int | None = None, *, processes: int = 1) -> int:
    """Resolve (``resolve_threads``) and ``torch.set_num_threads``; returns the number set."""
    n = resolve_threads(requested, processes=processes)
    torch.set_num_threads(n)
    return n


def check_threads(name: str, value: object) -> None:
    """Config validation: ``value`` is a positive integer or None; the error names the field."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name}: expected a positive integer or null (automatic: $OMP_NUM_THREADS, else half "
                         f"the cores), found {value!r}")


__all__ = ["ENV_VAR", "apply_threads", "available_cores", "check_threads", "resolve_threads"]
