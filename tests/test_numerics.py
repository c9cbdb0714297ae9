"""nla.util.numerics: every numeric library's CPU path is pinned, so a seed gives the same bits on AVX2 and AVX-512 machines."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PINNED_BY_HAND, numpy_avx512_targets

from nla.util.numerics import ENV_VAR, cpu_flags, cpu_kernels, mkl_branch, pinned_environment

HAS_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and "avx2" in cpu_flags()


def pinned_capability(env, machine, flags):
    """What pin_cpu_kernels sets for ATen: "avx2" on an x86-64 CPU with AVX2 where the variable is
    unset, else None (left as it is)."""
    return pinned_environment(env, machine, flags).get(ENV_VAR)


def test_pinned_capability_cases():
    avx2 = {"fpu", "sse2", "avx", "avx2", "fma"}
    assert pinned_capability(env={}, machine="x86_64", flags=avx2) == "avx2"
    assert pinned_capability(env={}, machine="AMD64", flags=avx2 | {"avx512f"}) == "avx2"  # AVX-512 too: still AVX2
    assert pinned_capability(env={ENV_VAR: "avx512"}, machine="x86_64", flags=avx2) is None  # the user's choice stays
    assert pinned_capability(env={ENV_VAR: " "}, machine="x86_64", flags=avx2) == "avx2"  # blank counts as unset
    assert pinned_capability(env={}, machine="x86_64", flags={"sse2", "avx"}) is None  # no AVX2: torch's default
    assert pinned_capability(env={}, machine="aarch64", flags={"asimd"}) is None  # not x86: left alone


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: x\n")
    assert cpu_flags(str(info)) == {"fpu", "sse2", "avx2", "fma"}
    assert cpu_flags(str(tmp_path / "absent")) == set()


def _kernels_in_child(env_value: str | None, first: str = "import nla, torch") -> str:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if env_value is not None:
        env[ENV_VAR] = env_value
    code = f"{first}; torch.ones(3).softmax(0); print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


@pytest.mark.skipif(not HAS_AVX2, reason="the pin applies to x86 CPUs with AVX2")
def test_import_nla_pins_avx2_and_keeps_an_explicit_choice():
    assert _kernels_in_child(None) == "AVX2"
    # torch imported first is fine as long as no kernel ran before nla
    assert _kernels_in_child(None, first="import torch, nla") == "AVX2"
    assert _kernels_in_child("default") == "DEFAULT"  # an explicit setting is the user's
    # this test process (conftest imports nla before any kernel) runs the kernels its environment names,
    # which its children inherit: the pinned ones unless the user set the variable before the run
    assert cpu_kernels() == os.environ[ENV_VAR].upper()


# ---------------------------------------------------------------- every library's path (issue 61)
PIN_VARS = (*PINNED_BY_HAND, "NPY_DISABLE_CPU_FEATURES")
WORKLOAD = Path(__file__).with_name("cpu_paths_workload.py")


def _avx512(path: str) -> bool:
    """Whether a read-back path runs AVX-512 code: ATen "AVX512", MKL "AVX512_E1 (by CPU)", NumPy
    "X86_V4" / "AVX512_SPR", OpenBLAS's SkylakeX, Cooperlake or SapphireRapids kernels. Only then must
    the unpinned bits differ: AMD's "Zen" OpenBLAS kernels or MKL's AUTO on an AVX2 CPU may share the
    pinned path's code."""
    return "512" in path or "X86_V4" in path or path in ("SkylakeX", "Cooperlake", "SapphireRapids")


def _workload(env_extra: dict[str, str], import_nla: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARS}  # a shell where nothing is pinned
    env.update(env_extra)
    cmd = [sys.executable, str(WORKLOAD), *(["--import-nla"] if import_nla else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pinned_environment_cases():
    avx2 = {"avx2", "fma"}
    env = pinned_environment(env={}, machine="x86_64", flags=avx2, vendor="GenuineIntel")
    assert set(env) == set(PIN_VARS)
    assert (env["ATEN_CPU_CAPABILITY"], env["MKL_CBWR"], env["MKL_DYNAMIC"], env["OPENBLAS_CORETYPE"]) == \
        ("avx2", "AVX2", "FALSE", "Haswell")
    # MKL offers its AVX2 branch on Intel CPUs only (elsewhere it would silently run AUTO): AUTO is asked there
    assert pinned_environment(env={}, machine="x86_64", flags=avx2, vendor="AuthenticAMD")["MKL_CBWR"] == "AUTO"
    # the portable pin: MKL's COMPATIBLE branch on every vendor, so Intel and AMD machines agree
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        assert pinned_environment(env={"NLA_CPU_PIN": "portable"}, machine="x86_64", flags=avx2,
                                  vendor=vendor)["MKL_CBWR"] == "COMPATIBLE"
    assert env["NPY_DISABLE_CPU_FEATURES"].split() == numpy_avx512_targets().split()
    # an explicit setting wins, variable by variable; the rest are still pinned
    mine = pinned_environment(env={"MKL_CBWR": "AUTO"}, machine="x86_64", flags=avx2)
    assert "MKL_CBWR" not in mine and mine["ATEN_CPU_CAPABILITY"] == "avx2"
    assert pinned_environment(env={}, machine="aarch64", flags={"asimd"}) == {}
    assert pinned_environment(env={}, machine="x86_64", flags={"avx"}) == {}


@pytest.mark.skipif(not HAS_AVX2, reason="the pin applies to x86 CPUs with AVX2")
def test_the_pin_puts_every_library_on_its_avx2_path_and_leaves_none_to_the_cpu():
    """nla's pin (a clean shell, `import nla` first, as the CLI does) gives the same bits, library by
    library, as a shell where a user pinned every library by hand (the variables written out here,
    NumPy's targets read from NumPy); a library nla's pin missed would run its widest path and differ
    wherever that path is not AVX2. The libraries' own choice (nothing pinned) is run too: on a CPU
    where a library's widest path is not AVX2, the workload must see that library's difference,
    or this test could not catch a missing pin."""
    pinned = _workload({}, import_nla=True)
    by_hand = _workload({**PINNED_BY_HAND, "NPY_DISABLE_CPU_FEATURES": numpy_avx512_targets()}, import_nla=False)
    libraries = ("aten", "mkl", "numpy", "openblas")
    assert {lib: pinned[lib] for lib in libraries} == {lib: by_hand[lib] for lib in libraries}
    # read back, not asked: what each library runs under the pin
    paths = pinned["paths"]
    assert (paths["aten"], paths["mkl_dynamic"], paths["openblas"]) == ("AVX2", "FALSE", "Haswell")
    assert paths["mkl"].split(" ")[0] == mkl_branch()  # AVX2 on Intel; "AUTO (<its branch>)" elsewhere
    assert paths["numpy"] in ("X86_V3", "AVX2")  # NumPy >= 2.4 calls AVX2+FMA3+... X86_V3
    free = _workload({}, import_nla=False)
    wider = [lib for lib in libraries if _avx512(free["paths"][lib]) and not _avx512(paths[lib])]
    for lib in wider:  # e.g. on an AVX-512 Xeon: ATen AVX512, MKL AVX512_E1, NumPy AVX512_SPR, OpenBLAS SkylakeX
        assert free[lib] != pinned[lib], f"{lib} runs {free['paths'][lib]} unpinned, yet the workload's bits match"


def test_pin_shortfalls_name_a_library_that_chose_before_nla():
    """A process that imported torch and NumPy and ran a kernel before `import nla`: the report's
    shortfall list says which library runs what, and why."""
    if not HAS_AVX2:
        pytest.skip("the pin applies to x86 CPUs with AVX2")
    code = ("import torch, numpy; torch.ones(3).softmax(0); import nla; "
            "from nla.util.numerics import pin_shortfalls; print('\\n'.join(pin_shortfalls()))")
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout
    free = _workload({}, import_nla=False)["paths"]
    expect = []
    if free["aten"] != "AVX2":
        expect.append(f"aten runs {free['aten']} where ATEN_CPU_CAPABILITY=avx2 asks AVX2")
    if free["openblas"] != "Haswell":
        expect.append(f"openblas runs {free['openblas']} where OPENBLAS_CORETYPE=Haswell asks Haswell")
    if free["numpy"] not in ("X86_V3", "AVX2"):
        expect.append(f"numpy runs {free['numpy']} where NPY_DISABLE_CPU_FEATURES asks AVX2 (X86_V3)")
    if expect:
        expect.append("torch and numpy were imported before nla; import nla first")
    assert sorted(out.split("\n")[:-1] if out else []) == sorted(expect)
    # MKL had made no call yet, and its dynamic threads were switched off after the fact: both pinned
    assert "mkl" not in out


def test_nla_cpu_pin_off_pins_nothing():
    avx2 = {"avx2"}
    for off in ("off", "OFF", "0", "false"):
        assert pinned_environment(env={"NLA_CPU_PIN": off}, machine="x86_64", flags=avx2) == {}
    assert pinned_environment(env={"NLA_CPU_PIN": "on"}, machine="x86_64", flags=avx2,
                              vendor="GenuineIntel")["MKL_CBWR"] == "AVX2"
    if HAS_AVX2:  # and the libraries then choose by CPU: as with nothing imported from nla
        off = _workload({"NLA_CPU_PIN": "off"}, import_nla=True)
        free = _workload({}, import_nla=False)
        libraries = ("aten", "mkl", "numpy", "openblas")
        assert {lib: off[lib] for lib in libraries} == {lib: free[lib] for lib in libraries}
        assert {lib: off["paths"][lib] for lib in libraries} == {lib: free["paths"][lib] for lib in libraries}
        assert off["paths"]["onednn"] == "by CPU"


@pytest.mark.skipif(not HAS_AVX2, reason="the pin applies to x86 CPUs with AVX2")
def test_the_portable_pin_runs_mkl_on_its_compatible_branch():
    """NLA_CPU_PIN=portable: MKL's COMPATIBLE branch, read back from MKL, the rest as the default pin."""
    portable = _workload({"NLA_CPU_PIN": "portable"}, import_nla=True)
    assert portable["paths"]["mkl"] == "COMPATIBLE" and portable["paths"]["aten"] == "AVX2"
    by_hand = _workload({**PINNED_BY_HAND, "MKL_CBWR": "COMPATIBLE",
                         "NPY_DISABLE_CPU_FEATURES": numpy_avx512_targets()}, import_nla=False)
    assert {k: portable[k] for k in ("aten", "mkl", "numpy", "openblas")} == \
        {k: by_hand[k] for k in ("aten", "mkl", "numpy", "openblas")}
