"""Which CPU kernels torch runs: pinned, so a seed gives the same numbers on every x86 machine.

Torch picks its vectorised CPU kernels (softmax, log-softmax, attention, ...) by the widest
instruction set the CPU has: AVX-512 where present, else AVX2. The two give different bits
(measured with torch 2.13 on an AMD EPYC with AVX-512: softmax, log_softmax and
scaled_dot_product_attention differ in the last bits; MKL's matmuls do not), and RL turns a
last-bit difference into a different run: the default quickstart, seed 0, reached round-trip FVE
0.562 -> 0.747 on that machine and 0.502 -> 0.712 on the AVX2 machines behind the README
(BENCHMARKS.md, "Which CPU kernels"). So ``import nla`` sets ``ATEN_CPU_CAPABILITY=avx2`` before
torch runs a kernel, on every x86 CPU that has AVX2 (every x86 server since 2013), unless the
variable is already set: a user who wants the machine's widest kernels sets
``ATEN_CPU_CAPABILITY=avx512`` (or ``default``) and gives up agreement with other machines.

This has to happen before torch runs its first CPU kernel, which reads the variable once. A
process that imported torch and ran kernels before ``import nla`` keeps the kernels it chose;
``cpu_kernels()`` reports what torch actually uses, and the quickstart's report records it.
Worker processes (Ray actors, spawned ranks) inherit the variable.

Not pinned: ARM and other non-x86 CPUs (their kernels differ from x86's anyway), and x86 CPUs
without AVX2 (torch's default kernels there). Thread counts are the other half of the same
promise (``nla.util.threads``).
"""

from __future__ import annotations

import os
import platform

ENV_VAR = "ATEN_CPU_CAPABILITY"
PINNED = "avx2"  # the widest kernels every current x86 server has; AVX-512 is not everywhere


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux), empty where they cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pinned_capability(env: dict[str, str] | os._Environ | None = None, machine: str | None = None,
                      flags: set[str] | None = None) -> str | None:
    """The value ``pin_cpu_kernels`` sets: ``"avx2"`` on an x86-64 CPU with AVX2 where the
    variable is unset, else None (left as it is)."""
    env = os.environ if env is None else env
    if env.get(ENV_VAR, "").strip():
        return None
    machine = (platform.machine() if machine is None else machine).lower()
    if machine not in ("x86_64", "amd64"):
        return None
    flags = _cpu_flags() if flags is None else flags
    if "avx2" not in flags:
        return None
    return PINNED


def pin_cpu_kernels() -> str | None:
    """Set ``ATEN_CPU_CAPABILITY`` to the pinned kernels (module docstring); the value set, or None."""
    value = pinned_capability()
    if value is not None:
        os.environ[ENV_VAR] = value
    return value


def cpu_kernels() -> str:
    """The CPU kernels torch runs in this process (``"AVX2"``, ``"AVX512"``, ``"DEFAULT"``, ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())
