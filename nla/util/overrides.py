"""``--set key=value``: every command's config overrides, values parsed as YAML.

The parsed mapping is applied by each stage's own config loader (``nla.train.config.load_config``,
``nla.rl.config.load_rl_config``, ``nla.datagen.config.DatagenConfig.from_yaml``), which knows its
sections; here only the text is read.
"""

from __future__ import annotations

from typing import Any

import yaml

from nla.util.validation import DuplicateKeyError, safe_load_unique

__all__ = ["parse_overrides"]


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["lr=1e-4", "betas=[0.9, 0.95]"]`` -> dict, values parsed as YAML scalars/lists (every
    command's ``--set``). A missing ``=``, an empty key or a value that is not YAML is a
    ``ValueError`` naming the override."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected key=value, e.g. --set lr=1e-4 or --set provider.model=gpt-4o")
        try:
            out[key.strip()] = safe_load_unique(raw) if raw.strip() else None
        except DuplicateKeyError as err:
            raise ValueError(f"--set {item!r}: {err}; give each key once") from None
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ValueError(f"--set {item!r}: the value {raw!r} is not valid YAML ({problem}); quote it to pass "
                             f"a string, e.g. --set '{key.strip()}=\"{raw}\"'") from None
    return out
