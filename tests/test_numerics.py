"""nla.util.numerics: the CPU kernels torch runs are pinned, so a seed gives the same bits on AVX2 and AVX-512 machines."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from nla.util.numerics import ENV_VAR, _cpu_flags, cpu_kernels, pinned_capability

HAS_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and "avx2" in _cpu_flags()


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
    assert _cpu_flags(str(info)) == {"fpu", "sse2", "avx2", "fma"}
    assert _cpu_flags(str(tmp_path / "absent")) == set()


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
