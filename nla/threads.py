"""How many CPU threads torch uses: one rule, resolved once, applied by every stage.

Precedence (``resolve_threads``):

1. an explicit setting (a config's ``threads`` field or ``--threads``) wins;
2. else ``OMP_NUM_THREADS`` when set to a positive integer (the usual way a scheduler or a
   user caps a job; an unparsable value is an error naming the variable);
3. else automatic. One process (every local stage): ``ThreadGovernor`` starts at half the
   cores and, every couple of seconds of work (``adapt_threads``, called once per training
   step or batch), sets the count to the cores that other processes leave idle, read from
   ``/proc/stat`` less this process's own CPU time. On an idle machine a stage uses every core;
   when another job starts it drops to what is left within one interval, so it never holds
   more threads than free cores. Several workers of one job (Ray actors, ``processes > 1``):
   a fixed ``max(1, cores // 2 // processes)``. Where ``/proc/stat`` cannot be read (macOS,
   Windows) the automatic count stays at half the cores.

Why not torch's default (one thread per core): its OpenMP workers spin at barriers, so on a
machine where another job is busy, every parallel region waits for a thread that has no
core. Measured on the 2-core development machine with ``bench/bench_threads.py`` (default
world AV, d=128, 4 blocks, fp32, forward + backward of a 32 x 60 batch, the lead's two
training jobs running; BENCHMARKS.md, "Threads"): 1 thread 5.83 it/s, 2 threads 0.54 it/s
(11x slower); with one more busy process, 2.96 vs 0.19 it/s (16x slower). Issue 14 measured
6x (policy update) and 10x (one rollout) with one competing job. Half the cores does not
collapse that way under one competing job of the same kind, but on an idle machine it gives
up the other half (the default quickstart: 11 min 14 s at 1 thread, 9 min 28 s at 2 on the
idle 2-core machine); the governor takes the idle half back and gives it up when another job
needs it (``bench/bench_threads.py --governor``, BENCHMARKS.md "Threads").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping

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


def read_cpu_seconds() -> tuple[float, float] | None:
    """``(busy CPU-seconds of the whole machine, CPU-seconds of this process)`` since boot/start,
    or None where ``/proc/stat`` is not there. Busy = user + nice + system + irq + softirq + steal
    over all CPUs (the first ``cpu`` line); this process = user + system of all its threads."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return busy, t.user + t.system


def threads_for_idle_cores(others_busy: float, cores: int) -> int:
    """Threads to use when other processes keep ``others_busy`` cores busy (a mean over the last
    interval): the idle cores, rounding up a core that is at least 70 % idle, in ``[1, cores]``."""
    return max(1, min(cores, int(cores - others_busy + 0.3)))


class ThreadGovernor:
    """Sets torch's thread count to the cores other processes leave idle, re-read every
    ``interval`` seconds from ``tick()`` (cheap otherwise: one clock read).

    Why our own: torch and OpenMP fix the thread count for the process (``OMP_DYNAMIC`` only
    lowers it inside a parallel region, and not at all in torch's intra-op pool), and no library
    we depend on measures what other processes use. ``reader`` and ``clock`` are for tests.
    """

    def __init__(self, cores: int | None = None, interval: float = 2.0,
                 reader: Callable[[], tuple[float, float] | None] = read_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cores = available_cores() if cores is None else cores
        self.interval = interval
        self._reader, self._clock = reader, clock
        self.threads = max(1, self.cores // 2)
        self._last = (clock(), reader())
        self.decisions: list[tuple[float, int]] = []  # (others_busy, threads) per re-read
        # torch.set_num_threads acts on the calling thread's OpenMP settings: only the thread that
        # made the governor (the main one) adjusts; helper threads (the reward service) just read.
        self._owner = threading.get_ident()

    def tick(self) -> int:
        """Re-decide if ``interval`` has passed since the last decision; returns the thread count."""
        now = self._clock()
        t_prev, prev = self._last
        if now - t_prev < self.interval or threading.get_ident() != self._owner:
            return self.threads
        cur = self._reader()
        self._last = (now, cur)
        if prev is None or cur is None:
            return self.threads
        others = max(0.0, ((cur[0] - prev[0]) - (cur[1] - prev[1])) / (now - t_prev))
        n = threads_for_idle_cores(others, self.cores)
        self.decisions.append((others, n))
        if n != self.threads:
            self.threads = n
            torch.set_num_threads(n)
        return n


_governor: ThreadGovernor | None = None


def apply_threads(requested: int | None = None, *, processes: int = 1) -> int:
    """Resolve and ``torch.set_num_threads``; returns the number set now.

    With no explicit setting and no ``$OMP_NUM_THREADS`` in a single process, the count is
    automatic: a ``ThreadGovernor`` (kept across stages) adjusts it from ``adapt_threads()``.
    """
    global _governor
    automatic = requested is None and not os.environ.get(ENV_VAR, "").strip() and processes == 1
    n = resolve_threads(requested, processes=processes)
    if automatic:
        if _governor is None:
            _governor = ThreadGovernor()
        n = _governor.threads
    else:
        _governor = None
    torch.set_num_threads(n)
    return n


def adapt_threads() -> int:
    """Call once per step or batch of a long loop: with automatic threads, follow the idle
    cores (``ThreadGovernor.tick``); otherwise a no-op. Returns torch's thread count."""
    if _governor is not None:
        return _governor.tick()
    return torch.get_num_threads()


def check_threads(name: str, value: object) -> None:
    """Config validation: ``value`` is a positive integer or None; the error names the field."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name}: expected a positive integer or null (automatic: $OMP_NUM_THREADS, else half "
                         f"the cores), found {value!r}")


__all__ = ["ENV_VAR", "ThreadGovernor", "adapt_threads", "apply_threads", "available_cores", "check_threads",
           "read_cpu_seconds", "resolve_threads", "threads_for_idle_cores"]
