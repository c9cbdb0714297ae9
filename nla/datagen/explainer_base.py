"""The explainer base layer: the ``Explainer`` interface, its name registry and tag helpers.

Below both ``nla.datagen.explain`` (the offline explainers and the explain stage) and
``nla.datagen.providers`` (the HTTP explainers), so each registers itself here and neither
imports the other to do so.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from typing import Any

from nla.datagen.config import DatagenConfig

__all__ = ["EXPLAINERS", "Explainer", "ExplainerFactory", "extract_tagged", "register_explainer", "row_key"]

_TAG_RE = re.compile(r"<explanation>(.*?)</explanation>", re.DOTALL)


def extract_tagged(text: str) -> str | None:
    """The text inside exactly one `<explanation>...</explanation>` pair, stripped; None otherwise.

    Strict on purpose: zero pairs, two pairs, an unclosed tag or an empty body
    all return None, so a malformed reply never becomes a training target.
    """
    if not isinstance(text, str):
        return None
    matches = _TAG_RE.findall(text)
    if len(matches) != 1 or text.count("<explanation>") != 1:
        return None
    body = matches[0].strip()
    return body or None


def row_key(doc_id: int, position: int) -> int:
    """Stable 63-bit key for a row (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{int(doc_id)}:{int(position)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class Explainer(ABC):
    """Turns rows (dicts with `context`, `token`, `doc_id`, `position`, maybe `facts`) into explanations."""

    name: str = "explainer"

    def __init__(self) -> None:
        self.drops: Counter = Counter()

    @abstractmethod
    def explain_batch(self, rows: list[dict[str, Any]]) -> list[str | None]:
        """One explanation (without tags) or None per row; record a reason in `self.drops` for each None."""

    def close(self) -> None:  # noqa: B027 - optional hook, most explainers hold nothing
        """Release resources (HTTP clients)."""


ExplainerFactory = Callable[[DatagenConfig], Explainer]
EXPLAINERS: dict[str, ExplainerFactory] = {}


def register_explainer(name: str) -> Callable[[ExplainerFactory], ExplainerFactory]:
    def deco(factory: ExplainerFactory) -> ExplainerFactory:
        EXPLAINERS[name] = factory
        return factory

    return deco
