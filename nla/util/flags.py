"""argparse types of the commands' flags: each refuses a bad value with the range it expects, as a
usage error (``nla CMD: error: argument --x: expected ...``, exit 2)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from nla.util.validation import MAX_SAMPLES_PER_VECTOR, InputError, check_sampling

__all__ = ["non_negative_float", "non_negative_int", "positive_int", "sample_count_flag", "seed_flag",
           "temperature_flag"]


def temperature_flag(text: str) -> float:
    """argparse type of ``--temperature``: ``nla.util.validation.check_sampling``'s range, before any work."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r}") from None
    try:
        return check_sampling(value, what="temperature")[0]
    except InputError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("temperature: ")) from None


def _int_flag(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, found {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, found {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = _int_flag(1)
non_negative_int = _int_flag(0)


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, found {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, found {text}")
    return value


def _bounded_int_flag(text: str, lo: int, hi: int, not_int: str, out_of_range: str) -> int:
    """An argparse type's body: ``text`` as an integer in ``lo..hi``; the messages get ``{text}`` / ``{value}``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(not_int.format(text=repr(text))) from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(out_of_range.format(value=value))
    return value


def seed_flag(text: str) -> int:
    """argparse type of ``--seed``: an integer in the range every RNG nla seeds accepts
    (``nla.util.configcheck.SEED_MAX``: numpy's legacy seeds need < 2**32)."""
    from nla.util.configcheck import SEED_MAX

    return _bounded_int_flag(text, 0, SEED_MAX, f"expected an integer seed in 0..{SEED_MAX}, found {{text}}",
                             f"expected an integer seed in 0..{SEED_MAX} (the range numpy's and torch's seeds share), "
                             "found {value}; pick a seed in that range")


def sample_count_flag(text: str) -> int:
    """argparse type of a per-vector sample count (``--n-samples``): 1..MAX_SAMPLES_PER_VECTOR."""
    return _bounded_int_flag(text, 1, MAX_SAMPLES_PER_VECTOR,
                             f"expected an integer in 1..{MAX_SAMPLES_PER_VECTOR}, found {{text}}",
                             f"expected a sample count in 1..{MAX_SAMPLES_PER_VECTOR} per vector (every sample of a "
                             "vector is decoded in one batch), found {value}")
