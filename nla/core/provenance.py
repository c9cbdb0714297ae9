"""Do an AV, an AR and a dataset come from the same subject? Checked wherever they meet.

Each sidecar records where its vectors come from: the subject model (``extraction.base_model``),
its layer, its width, and the tokenizer's id for the injection marker (the width is checked by
every loader on its own: a wrong one cannot run). Two parts that disagree on
any of these explain or score vectors of different models, and every number after that is wrong
without an error: so a pair and its data are compared when they meet (``NLAClient`` with both
checkpoints, ``nla eval`` / ``nla rl`` / ``nla score`` with a dataset, the explorer with a
``--subject``). A field a part does not record (the published AV sidecars have no layer) is not
compared.

Subjects are the same when their names are equal, when both are local directories that resolve to
one path, or when both hold the same ``config.json`` and tokenizer files (a copy). Users who know
better pass ``--allow-mixed-provenance`` (``allow_mixed_provenance=True``): the mismatch is then
logged as a warning, not raised.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["OVERRIDE", "Provenance", "ProvenanceError", "check_provenance", "same_subject"]

OVERRIDE = "--allow-mixed-provenance"
_FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class ProvenanceError(ValueError):
    """Parts that meet (AV, AR, dataset, subject) come from different subjects."""


@dataclass(frozen=True)
class Provenance:
    """What one part records of its subject; None: not recorded."""

    label: str
    subject: str | None = None
    layer: int | None = None
    width: int | None = None
    marker: tuple[str, int] | None = None  # (injection_char, its token id): the tokenizer, fingerprinted

    @classmethod
    def of(cls, label: str, side: Any) -> Provenance:
        """From an ``NLAConfig``."""
        marker = None
        # A part that is another model than the subject (model.base_model, a cross-model pair) records
        # its own tokenizer's marker id: not the subject's tokenizer, so not compared.
        own = getattr(side, "model_base", None) is not None
        if not own and getattr(side, "injection_char", None) is not None and getattr(side, "injection_token_id", None) is not None:
            marker = (side.injection_char, int(side.injection_token_id))
        return cls(label, side.base_model, side.layer_index, side.d_model, marker)


def _fingerprint(path: Path) -> str | None:
    files = [path / f for f in _FINGERPRINT_FILES if (path / f).is_file()]
    if not any(f.name == "config.json" for f in files):
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def same_subject(a: str, b: str) -> bool:
    """Equal names, one local directory spelled two ways, or two copies of one model (module docstring)."""
    if a == b:
        return True
    pa, pb = Path(os.path.expanduser(a)), Path(os.path.expanduser(b))
    if pa.is_dir() and pb.is_dir():
        if pa.resolve() == pb.resolve():
            return True
        fa = _fingerprint(pa)
        return fa is not None and fa == _fingerprint(pb)
    return False


def check_provenance(parts: list[Provenance], *, allow: bool = False, context: str = "") -> list[str]:
    """Compare every recorded field across ``parts``; raise :class:`ProvenanceError` naming each
    mismatch (unless ``allow``: then warn). Returns the mismatches found."""
    problems = []
    # (The width is not compared here: a pair and data of other widths cannot run at all, and each
    # loader refuses them with its own message naming the vectors' and the model's d.)
    for field, what in (("subject", "subject model"), ("layer", "layer"),
                        ("marker", "tokenizer (the marker's token id)")):
        seen = [(p.label, getattr(p, field)) for p in parts if getattr(p, field) is not None]
        for label, value in seen[1:]:
            first_label, first = seen[0]
            same = same_subject(first, value) if field == "subject" else first == value
            if not same:
                shown = (lambda v: f"{v[0]!r} = id {v[1]}") if field == "marker" else repr
                problems.append(f"{what}: {first_label} has {shown(first)}, {label} has {shown(value)}")
    if not problems:
        return []
    where = f"{context}: " if context else ""
    message = (f"{where}these come from different subjects: " + "; ".join(problems)
               + f". Use the checkpoints and data made from one subject model, or pass {OVERRIDE} if you know "
               "they belong together")
    if not allow:
        raise ProvenanceError(message)
    logger.warning("%s (allowed by %s)", message, OVERRIDE)
    return problems
