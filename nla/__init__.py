"""nla: Natural Language Autoencoders.

A verbalizer (AV) turns an activation vector of a subject model into text; a
reconstructor (AR) maps the text back to a vector. docs/design.md is the map: §6 lists
the stable public surface, §8 the layout.

The names in ``__all__`` are the public import surface (``from nla import NLAClient``); they load
on first use, so ``import nla`` (and the CLI's start-up) stays light.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
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
    "Claim": "nla.client",
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

# Modules that moved into the layers (docs/design.md §8): the old names still import, as the same
# module object, with a DeprecationWarning. (nla.reward and nla.train.common were split in two and
# five; their names are gone: nla.core.reward / nla.rl.reward, nla.train.{optim,checkpoint,data,
# device,loop}.)
_MOVED = {
    **{f"nla.{m}": f"nla.util.{m}" for m in ("validation", "configcheck", "threads", "numerics", "fsutil", "metrics")},
    **{f"nla.{m}": f"nla.train.{m}" for m in ("health", "rundir")},
    **{f"nla.{m}": f"nla.core.{m}" for m in ("sidecar", "templates", "arch", "injection", "reconstructor", "lora",
                                             "vectors", "provenance", "graders")},
    "nla.evaluation": "nla.eval.evaluate", "nla.probing": "nla.eval.probing", "nla.suite": "nla.eval.suite",
    "nla.report": "nla.eval.report",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import nla.suite`` gives ``nla.eval.suite`` (the same module object) and warns once."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec: Any) -> Any:
        import sys
        import warnings

        warnings.warn(f"{spec.name} moved to {_MOVED[spec.name]}; import it from there (the old name will go)",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(_MOVED[spec.name])
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: Any) -> None:  # the module is the new one, already executed
        pass


def _install_moved_modules() -> None:
    import sys

    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())


_install_moved_modules()


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nla' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
