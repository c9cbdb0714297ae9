"""The sidecar's errors: a file that is unusable (:class:`SidecarError`) and a live tokenizer that
disagrees with the token ids a sidecar records (:class:`SidecarMismatchError` and one subclass per
field). ``nla.core.sidecar`` (schema, reading, writing) and ``nla.core.token_ids`` (derivation and
checks) both raise them; both are ``ValueError``, so the CLI prints them as one line and exits 2.
"""

from __future__ import annotations

__all__ = ["ARSuffixMismatchError", "MarkerCountError", "MarkerIdMismatchError", "MarkerIsUnknownError",
           "MarkerNotSingleTokenError", "NeighborMismatchError", "SidecarError", "SidecarMismatchError"]


class SidecarError(ValueError):
    """A sidecar file is missing, malformed or lacks a required key."""


class SidecarMismatchError(ValueError):
    """The live tokenizer disagrees with what the sidecar recorded."""


class MarkerNotSingleTokenError(SidecarMismatchError):
    """The injection character encodes to more (or fewer) than one token."""


class MarkerIsUnknownError(SidecarMismatchError):
    """The injection character encodes to the tokenizer's UNK token."""


class MarkerIdMismatchError(SidecarMismatchError):
    """The injection character encodes to an id other than ``injection_token_id``."""


class MarkerCountError(SidecarMismatchError):
    """The canonical AV prompt contains the marker token other than exactly once."""


class NeighborMismatchError(SidecarMismatchError):
    """The tokens around the marker in the canonical AV prompt differ from the recorded neighbours."""


class ARSuffixMismatchError(SidecarMismatchError):
    """The tokenised tail of the AR template differs from ``critic_suffix_ids``."""
