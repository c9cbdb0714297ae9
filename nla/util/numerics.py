"""Which CPU code paths the numeric libraries run: pinned, so a seed gives the same numbers on every x86 machine.

Every numeric library in nla's path picks its code by the CPU it finds, and RL turns a last-bit
difference into a different run. Measured with torch 2.13 on an Intel Xeon with AVX-512 and AMX
(2026-12-05, ``dev/experiments/cpu_paths.py``: every ATen op a tiny quickstart runs, replayed on
its own inputs under each setting):

1. **ATen** (torch's vectorised kernels: softmax, log-softmax, attention, ...) uses AVX-512 where
   the CPU has it, else AVX2. Pinned by ``ATEN_CPU_CAPABILITY=avx2``.
2. **MKL** (torch's CPU wheel does its matmuls, ``bmm``, ``dot``, the CPU flash attention's GEMMs
   and the vector math of ``exp``, ``log`` and ``sqrt`` in MKL) picks its own branch by CPU. On
   an Intel CPU it is pinned by ``MKL_CBWR=AVX2``, MKL's conditional numerical reproducibility
   (CNR) on its AVX2 branch. MKL offers branches other than AUTO and COMPATIBLE on Intel CPUs
   only (and silently runs AUTO where one is asked elsewhere), so on AMD and other x86 CPUs the
   pin asks ``MKL_CBWR=AUTO``: CNR on the branch MKL picks for that CPU, with fixed cache sizes
   and deterministic reductions, the same on every CPU of that kind but not the Intel one.
   ``NLA_CPU_PIN=portable`` asks ``MKL_CBWR=COMPATIBLE`` on every CPU (SSE2 code without the
   approximate reciprocals, which differ between vendors): every x86 machine then agrees, at the
   cost BENCHMARKS.md measures. Everywhere ``MKL_DYNAMIC=FALSE``, so MKL runs the thread count
   torch asks for rather than one of its own choice (which counts physical cores), as MKL's
   reproducibility conditions ask. ``,STRICT`` is not asked: it makes MKL's GEMMs independent
   of the thread count, which nla fixes anyway (``nla.util.threads``), and ATen's own reductions
   depend on it all the same.
3. **oneDNN** (torch's ``mkldnn``: bf16 matmuls, convolutions) dispatches up to AMX. No op of
   the fp32 pipeline reaches it today (the replay: capping it changes no op); pinned by
   ``ONEDNN_MAX_CPU_ISA=AVX2`` so that a bf16 or future path does not bring the CPU back in.
4. **NumPy** dispatches its ufuncs and reductions up to AVX-512 (``X86_V4``, ``AVX512_ICL``,
   ``AVX512_SPR`` in NumPy 2.4); float32 sums, ``exp`` and ``log`` differ in the last bits.
   Pinned by ``NPY_DISABLE_CPU_FEATURES`` (the AVX-512 targets of the installed NumPy).
5. **OpenBLAS** (NumPy's matmul and ``linalg``) picks a kernel set by CPU (SapphireRapids,
   SkylakeX, Zen, Haswell). Pinned by ``OPENBLAS_CORETYPE=Haswell``, its AVX2 kernels.
Checked and left alone: Arrow's compute kernels (nla uses them to select rows by id; a float
sum and product gave the same bits at every ``ARROW_USER_SIMD_LEVEL``).

So ``import nla`` sets each variable before the library reads it, on every x86 CPU that has AVX2
(every x86 server since 2013), unless the user set that variable: an explicit setting wins,
variable by variable (``ATEN_CPU_CAPABILITY=avx512 nla ...`` runs torch's widest kernels and
gives up agreement with other machines). ``NLA_CPU_PIN`` chooses the pin as a whole: unset (or
``on``) as above; ``portable``, the same with MKL on its COMPATIBLE branch, so that Intel and AMD
machines agree too; ``off``, nothing pinned (every library runs the CPU's widest path: faster on
an AVX-512 machine, and that machine's own numbers). Worker processes (Ray
actors, spawned ranks) inherit the variables.

The libraries read them once: ATen at its first kernel, MKL at its first call, NumPy and
OpenBLAS when NumPy is imported. A process that ran torch ops or imported NumPy before
``import nla`` keeps what they chose. So nothing here trusts what it asked for:
``cpu_paths()`` reads back what each library runs (torch's capability, MKL's CNR branch and
dynamic flag through MKL's own service calls, NumPy's enabled targets, OpenBLAS's core name),
``pin_shortfalls()`` lists where that differs from the pin, and the quickstart's report, the
world build's summary and the start of every CLI command name them.

Not pinned: CPUs that are not x86 (their kernels differ from x86's anyway) and x86 CPUs without
AVX2 (the libraries' defaults there). Thread counts are the other half of the same promise
(``nla.util.threads``).

What the pin costs: BENCHMARKS.md, "Which CPU paths".
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

ENV_VAR = "ATEN_CPU_CAPABILITY"
OPT_OUT = "NLA_CPU_PIN"  # "off": pin nothing; "portable": MKL's COMPATIBLE branch on every CPU (module docstring)
PINNED = "avx2"  # the widest kernels every current x86 server has; AVX-512 is not everywhere

# MKL's CNR branch codes (mkl_service.h: MKL_CBWR_*), for reading the branch back.
_MKL_BRANCHES = {0: "UNSET", 1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
                 9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
_MKL_CBWR_BRANCH = 1  # mkl_cbwr_get's argument: the branch in force


def _numpy_avx512_targets() -> str:
    """The AVX-512 dispatch targets of the installed NumPy, by name (NumPy 2.4 renamed them), read
    from its version without importing it (importing would fix its choice before the pin)."""
    from importlib import metadata

    try:
        major, minor = (int(p) for p in metadata.version("numpy").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return ""
    if (major, minor) >= (2, 4):
        return "X86_V4 AVX512_ICL AVX512_SPR"
    return "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"


@dataclass(frozen=True)
class LibraryPin:
    """One environment variable of the pin: which library reads it, and the value nla sets."""

    library: str
    var: str
    value: str


def cpuinfo_field(name: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first ``name : value`` of /proc/cpuinfo (Linux), "" where it cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...), empty where it cannot be read."""
    return cpuinfo_field("vendor_id", cpuinfo)


def mkl_branch(mode: str | None = None, vendor: str | None = None) -> str:
    """The MKL CNR branch the pin asks for (module docstring): COMPATIBLE in the portable mode, else
    AVX2 on an Intel CPU and AUTO on any other (where MKL offers no other branch)."""
    mode = os.environ.get(OPT_OUT, "") if mode is None else mode
    if mode.strip().lower() == "portable":
        return "COMPATIBLE"
    return "AVX2" if (_cpu_vendor() if vendor is None else vendor) == "GenuineIntel" else "AUTO"


def pins(mode: str | None = None, vendor: str | None = None) -> tuple[LibraryPin, ...]:
    """Every variable of the pin (module docstring), in the order the docstring explains them;
    ``mode`` is ``NLA_CPU_PIN``'s value (default: the environment's), ``vendor`` the CPU's."""
    numpy_targets = _numpy_avx512_targets()
    return tuple(p for p in (
        LibraryPin("ATen", ENV_VAR, PINNED),
        LibraryPin("MKL", "MKL_CBWR", mkl_branch(mode, vendor)),
        LibraryPin("MKL", "MKL_DYNAMIC", "FALSE"),
        LibraryPin("oneDNN", "ONEDNN_MAX_CPU_ISA", "AVX2"),
        LibraryPin("NumPy", "NPY_DISABLE_CPU_FEATURES", numpy_targets),
        LibraryPin("OpenBLAS", "OPENBLAS_CORETYPE", "Haswell"),
    ) if p.value)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux), empty where they cannot be read."""
    return set(cpuinfo_field("flags", cpuinfo).split())


def pin_applies(machine: str | None = None, flags: set[str] | None = None) -> bool:
    """True on an x86-64 CPU with AVX2, where the pin holds (module docstring)."""
    machine = (platform.machine() if machine is None else machine).lower()
    if machine not in ("x86_64", "amd64"):
        return False
    return "avx2" in (cpu_flags() if flags is None else flags)


def _opted_out(env: dict[str, str] | os._Environ) -> bool:
    return env.get(OPT_OUT, "").strip().lower() in ("off", "0", "false", "no")


def pinned_environment(env: dict[str, str] | os._Environ | None = None, machine: str | None = None,
                       flags: set[str] | None = None, vendor: str | None = None) -> dict[str, str]:
    """The variables ``pin_cpu_kernels`` sets: every pin whose variable is unset (blank counts as
    unset), on an x86-64 CPU with AVX2; nothing elsewhere, nor where ``NLA_CPU_PIN=off``."""
    env = os.environ if env is None else env
    if _opted_out(env):
        return {}
    if not pin_applies(machine, flags):
        return {}
    return {p.var: p.value for p in pins(env.get(OPT_OUT, ""), vendor) if not env.get(p.var, "").strip()}


# What the pin found when ``import nla`` ran it: libraries that had already chosen their path.
_ALREADY_LOADED: tuple[str, ...] = ()


def pin_cpu_kernels() -> dict[str, str]:
    """Set every pin variable the user has not set (module docstring); the variables set."""
    global _ALREADY_LOADED
    values = pinned_environment()
    os.environ.update(values)
    _ALREADY_LOADED = tuple(m for m in ("torch", "numpy") if m in sys.modules)
    if values.get("MKL_DYNAMIC") == "FALSE" and "torch" in sys.modules:
        # importing torch already made MKL read MKL_DYNAMIC; this one setting can still be changed
        lib = _torch_cpu_lib()
        if lib is not None and hasattr(lib, "mkl_serv_set_dynamic"):
            lib.mkl_serv_set_dynamic(0)
    return values


def cpu_kernels() -> str:
    """The CPU kernels ATen runs in this process (``"AVX2"``, ``"AVX512"``, ``"DEFAULT"``, ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


@lru_cache(maxsize=1)
def _torch_cpu_lib() -> Any:
    """libtorch_cpu, where torch's CPU wheel links MKL in; None where it cannot be opened."""
    import torch

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.*")):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _mkl_paths() -> dict[str, str]:
    """MKL's branch in force, the one it would pick by itself, and its dynamic-threads flag, read
    through MKL's service calls (``mkl_cbwr_get``, ``mkl_get_dynamic``) that torch's wheel exports."""
    import torch

    if not torch.backends.mkl.is_available():
        return {"mkl": "absent"}
    lib = _torch_cpu_lib()
    try:
        branch = int(lib.mkl_serv_cbwr_get(_MKL_CBWR_BRANCH))
        auto = int(lib.mkl_serv_cbwr_get_auto_branch())
        dynamic = int(lib.mkl_serv_get_dynamic())
    except (AttributeError, OSError):
        return {"mkl": "unreadable"}
    name = _MKL_BRANCHES.get(branch, str(branch))
    # OFF: no CNR; MKL dispatches by CPU, to the branch it would pick by itself. AUTO: CNR on that branch.
    by_cpu = _MKL_BRANCHES.get(auto, str(auto))
    in_force = {"OFF": f"{by_cpu} (by CPU)", "UNSET": f"{by_cpu} (by CPU)", "AUTO": f"AUTO ({by_cpu})"}.get(name, name)
    return {"mkl": in_force, "mkl_dynamic": "TRUE" if dynamic else "FALSE"}


def _numpy_paths() -> dict[str, str]:
    """NumPy's widest enabled dispatch target and OpenBLAS's kernel set (NumPy's own build)."""
    import numpy as np

    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # NumPy < 2
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    enabled = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    paths = {"numpy": enabled[-1] if enabled else "baseline"}
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                       "openblas_get_corename"):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                paths["openblas"] = fn().decode()
                break
    return paths


def cpu_paths() -> dict[str, str]:
    """The code paths the numeric libraries run in this process, read back from each (module
    docstring): ``aten``, ``mkl``, ``mkl_dynamic``, ``numpy``, ``openblas`` (where NumPy ships it),
    and ``onednn`` (the variable in force: oneDNN's ISA cannot be asked from Python)."""
    paths = {"aten": cpu_kernels(), **_mkl_paths(), **_numpy_paths()}
    var = "ONEDNN_MAX_CPU_ISA"
    paths["onednn"] = f"{os.environ[var]} (set)" if os.environ.get(var, "").strip() else "by CPU"
    return paths


def pin_shortfalls(paths: dict[str, str] | None = None) -> list[str]:
    """Where a library does not run the pinned path although nla set its variable: it chose before
    ``import nla`` (``_ALREADY_LOADED``), or something reset it. Empty where the pin holds, and
    where it does not apply; a variable the user set is the user's choice, not a shortfall."""
    if not pin_applies() or _opted_out(os.environ):
        return []
    paths = cpu_paths() if paths is None else paths
    asked = {p.var: p.value for p in pins()}
    ours = {var for var, value in asked.items() if os.environ.get(var) == value}
    checks = (
        (ENV_VAR, "aten", "AVX2"), ("MKL_CBWR", "mkl", asked["MKL_CBWR"]), ("MKL_DYNAMIC", "mkl_dynamic", "FALSE"),
        ("OPENBLAS_CORETYPE", "openblas", "Haswell"),
    )
    out = [f"{key} runs {paths[key]} where {var}={asked[var]} asks {want}"
           for var, key, want in checks if var in ours and key in paths and paths[key].split(" ")[0] != want]
    if "NPY_DISABLE_CPU_FEATURES" in ours and paths.get("numpy") not in (None, "X86_V3", "AVX2", "baseline"):
        out.append(f"numpy runs {paths['numpy']} where NPY_DISABLE_CPU_FEATURES asks AVX2 (X86_V3)")
    if out and _ALREADY_LOADED:
        out.append(f"{' and '.join(_ALREADY_LOADED)} were imported before nla; import nla first")
    return out


def describe_cpu_paths(paths: dict[str, str] | None = None) -> str:
    """One line for logs and report titles: ``ATen AVX2, MKL AVX2, NumPy X86_V3, OpenBLAS Haswell``."""
    paths = cpu_paths() if paths is None else paths
    names = (("aten", "ATen"), ("mkl", "MKL"), ("numpy", "NumPy"), ("openblas", "OpenBLAS"))
    return ", ".join(f"{label} {paths[key]}" for key, label in names if key in paths)
