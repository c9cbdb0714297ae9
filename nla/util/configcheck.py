"""Type-check a stage config's fields from the dataclass annotations, before ``__post_init__`` compares them.

Every stage config (train, datagen, RL, world) is a frozen dataclass built from YAML and
``--set`` overrides. A string where a number belongs used to reach a comparison in
``__post_init__`` and die with ``TypeError: '<' not supported``; :func:`check_config_types`
runs first, with the expected type read from the field's annotation, so there is one rule
and no per-field list to keep in sync.

Conventions, in order of surprise:

1. ``float`` accepts an ``int`` (YAML writes ``1`` for ``1.0``) and a numeric string such as
   ``"1e-4"``, which YAML 1.1 reads as a string when it has no dot; the string is converted.
   ``"nan"``/``"inf"`` strings are not converted (range checks would let them through).
2. ``bool`` is never accepted as an ``int`` or a ``float`` (``True`` is a Python int).
3. ``tuple[X, Y]`` and ``tuple[X, ...]`` accept YAML lists; the length of a fixed tuple is checked.
4. A nested dataclass field accepts a mapping, checked recursively (``provider.max_tokens``),
   or an instance; unknown keys of a mapping are left to the config's own check.
5. Annotations the checker does not model (``Any``, callables) accept anything finite.
6. No field anywhere holds NaN or an infinity (YAML's ``.nan``, ``.inf``, ``-.inf``; inside lists and
   mappings too): a NaN ``loss.kl_coef`` made every RL step non-finite and the run still exited 0.
7. A field named ``seed`` or ``*_seed`` holds an integer in ``0..SEED_MAX`` (2**32 - 1: numpy's
   legacy seeds need less than 2**32, torch's less than 2**63); -1 used to fail deep in numpy
   after the run directory was written.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from nla.util.confighelp import with_help

__all__ = ["SEED_MAX", "ConfigTypeError", "check_config_types", "find_non_finite"]

SEED_MAX = 2**32 - 1  # the largest seed every RNG nla seeds accepts (numpy's np.random.seed: < 2**32)
NON_FINITE = "a finite number (NaN and infinities are refused)"

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigTypeError(ValueError):
    """A config field holds a value of the wrong type; the message names the field and the fix."""


class _Mismatch(Exception):
    pass


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error line quotes what was found, never megabytes."""
    import reprlib

    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlist, short.maxdict, short.maxlevel = limit, limit, 8, 8, 3
    r = short.repr(value)
    return r if len(r) <= limit else r[:limit] + "..."


def check_config_types(cls: type, data: Mapping[str, Any], *, prefix: str = "") -> dict[str, Any]:
    """``data`` with every known field checked against ``cls``'s annotation (numeric strings made floats).

    Raises :class:`ConfigTypeError` naming ``Class.field``, the expected type and the value found.
    Keys that are not fields are passed through untouched (the caller reports them).
    """
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for f in dataclasses.fields(cls):
        if f.name not in out:
            continue
        path = f"{prefix}{f.name}"
        try:
            out[f.name] = _check(hints.get(f.name, Any), out[f.name], path, cls)
            if f.name == "seed" or f.name.endswith("_seed"):
                _check_seed(out[f.name])
        except _Mismatch as err:
            expected = str(err)
            value = out[f.name]
            raise ConfigTypeError(with_help(
                f"{cls.__name__}.{f.name}: expected {expected}, found {_short(value)} ({type(value).__name__}); "
                f"fix it in the YAML or with --set {path}=...", cls, f.name, label=path)) from None
    return out


def find_non_finite(value: Any, where: str = "") -> str | None:
    """The place of the first NaN or infinity in ``value`` (a number, or lists and mappings of them):
    ``""`` for the value itself, ``"[2]"`` or ``".key"`` inside it; None when every number is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = find_non_finite(v, f"{where}.{k}")
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = find_non_finite(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _check_seed(value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= SEED_MAX:
        raise _Mismatch(f"an integer seed in 0..{SEED_MAX} (the range numpy's and torch's seeds share)")


def _check(tp: Any, value: Any, path: str, owner: type) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(value, float) and not math.isfinite(value):
        raise _Mismatch(NON_FINITE)
    if tp is Any or tp is object or origin in (dict, Mapping) or tp in (dict, Mapping):
        inner = None if isinstance(value, str) else find_non_finite(value)
        if inner:
            raise _Mismatch(f"finite numbers only (NaN and infinities are refused; at {inner.lstrip('.')})")
        if tp is Any or tp is object:
            return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(option, value, path, owner)
            except _Mismatch:
                continue
        raise _Mismatch(" or ".join(_describe(o) for o in options))
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):  # True is not 1 here
            return value
        raise _Mismatch(_describe(tp))
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch("null")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch("an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
        raise _Mismatch("a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch("a string")
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(_describe(tp))
        args = typing.get_args(tp)
        if not args:
            return value
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise _Mismatch(_describe(tp))
            item_types = list(args)
        else:
            item_types = [args[0]] * len(value)
        items = []
        for i, (a, v) in enumerate(zip(item_types, value, strict=True)):
            try:
                items.append(_check(a, v, path, owner))
            except _Mismatch as err:
                raise _Mismatch(f"{_describe(tp)} (item {i}: {err}, found {_short(v)})") from None
        return type(value)(items)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _Mismatch("a mapping")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return check_config_types(tp, value, prefix=f"{path}.")
        raise _Mismatch(f"a mapping of {tp.__name__} fields")
    return value  # an annotation we do not model


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])}"
        return f"a list of {len(args)} ({', '.join(_describe(a) for a in args)})"
    if origin is list:
        args = typing.get_args(tp)
        return f"a list of {_describe(args[0])}" if args else "a list"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )
