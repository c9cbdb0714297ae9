"""nla: Natural Language Autoencoders.

A verbalizer (AV) turns an activation vector of a subject model into text; a
reconstructor (AR) maps the text back to a vector. docs/design.md is the map: §6 lists
the stable public surface, §8 the layout.

The names in ``__all__`` are the public import surface (``from nla import NLAClient``); they load
on first use, so ``import nla`` (and the CLI's start-up) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from nla.util.numerics import pin_cpu_kernels as _pin_cpu_kernels

# Before anything loads torch or NumPy: the same CPU code paths on every x86 machine (nla.util.numerics).
_pin_cpu_kernels()

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "NLAClient": "nla.client",
    "NLAClientError": "nla.client",
    "Verbalization": "nla.client",
    "ScoreResult": "nla.client",
    "Claim": "nla.eval.suite.claims",
    "load_vectors": "nla.client",
    "NLAConfig": "nla.core.sidecar",
    "load_sidecar": "nla.core.sidecar",
    "mse_nrm": "nla.core.vectors",
    "evaluate_pair": "nla.eval.evaluate",
    "EvalReport": "nla.eval.evaluate",
    "run_suite": "nla.eval.suite",
    "SuiteReport": "nla.eval.suite",
    "run_quickstart": "nla.quickstart",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nla' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
