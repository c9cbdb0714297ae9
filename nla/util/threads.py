"""How many CPU threads torch uses: one rule, resolved once, applied by every stage.

Precedence (``resolve_threads``):

1. an explicit setting (a config's ``threads`` field or ``--threads``) wins: a positive integer,
   or ``"auto"`` (below);
2. else ``OMP_NUM_THREADS`` when set to a positive integer (the usual way a scheduler or a
   user caps a job; an unparsable value is an error naming the variable);
3. else a fixed count from the machine alone: every core this process may run on for one
   process (every local stage), ``max(1, cores // 2 // processes)`` for several workers of one
   job (Ray actors, ``processes > 1``).

**The count is fixed for a run, never decided from the machine's load or the clock.** Torch's CPU
kernels give different bits at different thread counts (measured with torch 2.13 on this x86
machine, ``bench/bench_thread_invariance.py``: a sum over more than 32,768 elements, attention
with one query per row (every decode step, the AR's read) forward and backward), and RL
amplifies a last-bit difference into a different run (issue 25: an 800-step run diverged at
step 13). So the same config and seed give the same numbers on the same machine, whatever
else runs there (``tests/test_determinism.py``).

The price: on a machine where another job is busy, a fixed count of threads waits at OpenMP
barriers for a thread that has no core. Measured on the 2-core development machine (d=128
Llama, forward + backward of a 32 x 96 batch; BENCHMARKS.md, "Threads"): 2 threads 4.50 it/s
idle and 1.50 it/s beside one busy process, where 1 thread gives 2.67 (1.8x slower), and 4.6x
slower for small decode-sized forwards. On a shared machine set ``--threads 1`` (or
``OMP_NUM_THREADS=1``): still reproducible, and it never waits for a core.

``"auto"`` (opt-in, gives up reproducibility): ``ThreadGovernor`` starts at half the cores
and, every couple of seconds of work (``adapt_threads``, called once per training step or
batch), sets the count to the cores that other processes leave idle, read from
``/proc/stat`` less this process's own CPU time: fastest on a machine whose load changes, but
the numbers then follow the load. Where ``/proc/stat`` cannot be read (macOS, Windows) it
stays at half the cores.

Why not torch's default (one thread per core, also fixed): the same as ours for one process;
ours also divides the cores among a job's workers and reads ``OMP_NUM_THREADS`` the same way
everywhere.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

ENV_VAR = "OMP_NUM_THREADS"
AUTO = "auto"  # the opt-in adaptive count (ThreadGovernor): follows the load, gives up reproducibility
# The --threads flag's help, after the command's own words ("torch CPU threads ...").
THREADS_HELP = ("a positive integer, or auto (follows the load; not reproducible); default $OMP_NUM_THREADS, "
                "else every core, fixed for the run")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def resolve_threads(requested: int | str | None = None, *, processes: int = 1,
                    env: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """Torch CPU threads for one process: ``requested`` > ``$OMP_NUM_THREADS`` > a count fixed by the
    machine (``cores`` for one process, ``cores // 2 // processes`` for several).

    processes: workers of this job sharing the machine (the default is divided among them;
    an explicit setting or the environment variable is per process and is not divided).
    ``requested="auto"`` returns the governor's starting count (half the cores); ``apply_threads``
    then lets it follow the load.
    """
    cores = available_cores() if cores is None else cores
    if requested == AUTO:
        return max(1, cores // 2 // max(1, processes))
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested <= 0:
            raise ValueError(f"threads: expected a positive integer, 'auto' or null (fixed by the machine), "
                             f"found {requested!r}")
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
    return cores if processes <= 1 else max(1, cores // 2 // processes)


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
            import torch

            torch.set_num_threads(n)
        return n


_governor: ThreadGovernor | None = None


def apply_threads(requested: int | str | None = None, *, processes: int = 1) -> int:
    """Resolve and ``torch.set_num_threads``; returns the number set now.

    Only ``requested="auto"`` in a single process is adaptive: a ``ThreadGovernor`` (kept across
    stages) adjusts the count from ``adapt_threads()``, and a warning says the numbers will follow
    the machine's load. Every other setting is fixed for the run.
    """
    global _governor
    automatic = requested == AUTO and processes == 1
    n = resolve_threads(requested, processes=processes)
    if automatic:
        if _governor is None:
            logger.warning("threads=auto: the thread count follows the machine's load, and torch's CPU results "
                           "change with it; this run is not reproducible (set threads to a number for that)")
            _governor = ThreadGovernor()
        n = _governor.threads
    else:
        _governor = None
    limit = max_threads()
    if n > limit:
        raise ValueError(
            f"threads: {n} is more than 4 x the {os.cpu_count()} cores of this machine (at most {limit} here); torch "
            "cannot start that many (a huge count crashed or hung it); pass --threads N with N up to the cores")
    import torch  # here, so configs can validate `threads` without importing torch

    torch.set_num_threads(n)
    return n


def max_threads() -> int:
    """The most threads a run may ask for on this machine: 4 x its cores (at least 8). More only
    waits at every OpenMP barrier, and torch segfaults or hangs on counts in the thousands."""
    return max(8, 4 * (os.cpu_count() or 1))


def adapt_threads() -> int:
    """Call once per step or batch of a long loop: with ``threads="auto"``, follow the idle
    cores (``ThreadGovernor.tick``); otherwise a no-op. Returns torch's thread count."""
    if _governor is not None:
        return _governor.tick()
    import torch

    return torch.get_num_threads()


def check_threads(name: str, value: object) -> None:
    """Config validation: ``value`` is a positive integer, ``"auto"`` or None; the error names the field."""
    if value is None or value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, 'auto' (follows the load, not reproducible) or null "
                         f"($OMP_NUM_THREADS, else every core), found {value!r}")


def threads_flag(text: str) -> int | str:
    """argparse type of ``--threads``: a positive integer or ``auto``."""
    import argparse

    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', found {value}")
    if value > max_threads():
        raise argparse.ArgumentTypeError(f"expected at most {max_threads()} (4 x the {os.cpu_count()} cores of this "
                                         f"machine), found {value}")
    return value


__all__ = ["AUTO", "ENV_VAR", "THREADS_HELP", "ThreadGovernor", "adapt_threads", "apply_threads", "available_cores",
           "check_threads", "max_threads", "read_cpu_seconds", "resolve_threads", "threads_flag",
           "threads_for_idle_cores"]
