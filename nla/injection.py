"""Activation injection: overwrite the marker token's input embedding with the vector (DESIGN §3.4).

Notation: B rows, S positions, d width, N vectors.

A site is a position p with ``ids[p] == inj_id``, ``ids[p-1] == left_id`` and
``ids[p+1] == right_id``. Requiring both neighbours means a marker character the model
writes in its own response (or one that appears in a document) is not mistaken for the
prompt's marker. Sites are filled in row-major order, so a packed ``[1, T]`` sequence
holding several prompts takes its vectors in prompt order, exactly like a padded ``[B, S]``
batch with one prompt per row.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from nla.vectors import normalize_activation

logger = logging.getLogger(__name__)


def find_injection_sites(input_ids: Tensor, inj_id: int, left_id: int, right_id: int) -> Tensor:
    """Boolean mask [B, S] of valid sites (marker with the expected left and right neighbours)."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids: expected [B, S] (or [1, T] packed), found shape {tuple(input_ids.shape)}")
    sites = torch.zeros_like(input_ids, dtype=torch.bool)
    if input_ids.shape[1] < 3:
        return sites  # decode steps and very short inputs cannot hold a marker with two neighbours
    mid = input_ids[:, 1:-1] == inj_id
    mid &= input_ids[:, :-2] == left_id
    mid &= input_ids[:, 2:] == right_id
    sites[:, 1:-1] = mid
    return sites


def inject_at_marked_positions(
    input_ids: Tensor,
    embeddings: Tensor,
    vectors: Tensor,
    inj_id: int,
    left_id: int,
    right_id: int,
) -> Tensor:
    """Return a copy of ``embeddings`` [B, S, d] with ``vectors`` [N, d] written at the N sites.

    Out of place, so gradients flow to both the untouched embeddings and the vectors.
    ``vectors`` are written as given (cast to the embedding dtype): rescale them first.
    """
    if embeddings.shape[:2] != input_ids.shape:
        raise ValueError(
            f"embeddings {tuple(embeddings.shape)} do not match input_ids {tuple(input_ids.shape)} in [B, S]"
        )
    if vectors.ndim != 2 or vectors.shape[1] != embeddings.shape[-1]:
        raise ValueError(
            f"vectors: expected [N, d] with d = {embeddings.shape[-1]} (the embedding width), found "
            f"{tuple(vectors.shape)}; check that the vectors come from the same model family/layer as the sidecar"
        )
    sites = find_injection_sites(input_ids, inj_id, left_id, right_id)
    n_sites = int(sites.sum())
    if n_sites != vectors.shape[0]:
        markers = int((input_ids == inj_id).sum())
        raise ValueError(
            f"injection: found {n_sites} valid marker sites (token {inj_id} between {left_id} and {right_id}; "
            f"{markers} marker tokens in all) for {vectors.shape[0]} vectors in a batch of shape "
            f"{tuple(input_ids.shape)}. Likely causes: the prompt was not built from the sidecar's AV template "
            "with the chat template; the tokenizer is not the one the sidecar was written for; truncation cut "
            "the marker; or the number of vectors does not match the batch (repeat each vector once per sample "
            "when generating several samples per prompt)"
        )
    if n_sites == 0:
        return embeddings
    # index_put on a fresh tensor (not an in-place write into the embedding output) keeps autograd intact.
    rows, cols = sites.nonzero(as_tuple=True)  # row-major order
    return embeddings.index_put((rows, cols), vectors.to(dtype=embeddings.dtype, device=embeddings.device))


class InjectionHook:
    """Forward hook on a model's input-embedding module that injects vectors at marker sites.

    Rule for which forwards are injected: while ``with hook.vectors(v):`` is active, every
    forward whose ``input_ids`` contain at least one valid site gets the vectors (and the site
    count must equal ``len(v)``); forwards without any site pass unchanged. Under
    ``model.generate`` with a KV cache only the prefill holds the marker, so the decode steps
    pass through; without a cache every step re-reads the prompt and is injected again, which
    is also correct. If the block ends without any forward having held a site although some
    forward ran, that is an error (the marker was truncated away or the prompt is wrong).
    Outside a ``vectors`` block the hook does nothing.
    """

    def __init__(self, model: nn.Module, inj_id: int, left_id: int, right_id: int, scale: float | None) -> None:
        self.inj_id, self.left_id, self.right_id, self.scale = inj_id, left_id, right_id, scale
        self._vectors: Tensor | None = None
        self._forwards = 0
        self._applied = 0
        self._handle = model.get_input_embeddings().register_forward_hook(self._hook)

    @classmethod
    def from_config(cls, model: nn.Module, cfg: Any) -> InjectionHook:
        """Hook configured from an :class:`nla.sidecar.NLAConfig`."""
        cfg.need_av("injection")
        return cls(
            model,
            cfg.injection_token_id,
            cfg.injection_left_neighbor_id,
            cfg.injection_right_neighbor_id,
            cfg.injection_scale_value(),
        )

    @contextlib.contextmanager
    def vectors(self, v: Tensor) -> Iterator[InjectionHook]:
        """Inject ``v`` [N, d] (rescaled to ``scale``; raw if None) in the forwards inside the block."""
        if self._vectors is not None:
            raise RuntimeError("InjectionHook.vectors: blocks cannot be nested; leave the current block first")
        if v.ndim == 1:
            v = v.unsqueeze(0)
        self._vectors = normalize_activation(v, self.scale)
        self._forwards = self._applied = 0
        ok = False
        try:
            yield self
            ok = True
        finally:
            forwards, applied = self._forwards, self._applied
            self._vectors = None
        if ok and forwards > 0 and applied == 0:
            raise ValueError(
                f"InjectionHook: {forwards} forward(s) ran inside the vectors block but none contained a marker "
                f"site (token {self.inj_id} between {self.left_id} and {self.right_id}); the prompt was not built "
                "from the sidecar template, the tokenizer differs, or truncation cut the marker"
            )

    def _hook(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if self._vectors is None:
            return None
        self._forwards += 1
        input_ids = args[0] if args else None
        if not isinstance(input_ids, Tensor):
            return None
        ids = input_ids if input_ids.ndim == 2 else input_ids.unsqueeze(0)
        if not bool(find_injection_sites(ids, self.inj_id, self.left_id, self.right_id).any()):
            return None
        self._applied += 1
        out = output if output.ndim == 3 else output.unsqueeze(0)
        injected = inject_at_marked_positions(ids, out, self._vectors, self.inj_id, self.left_id, self.right_id)
        return injected if output.ndim == 3 else injected.squeeze(0)

    @property
    def applied_forwards(self) -> int:
        """How many forwards in the current (or last) block were injected."""
        return self._applied

    def remove(self) -> None:
        self._handle.remove()
