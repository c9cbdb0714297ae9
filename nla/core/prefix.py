"""The shared prompt prefix: what every fast path over one AV prompt needs.

Every AV row begins with the same tokens (the chat template's head and the AV prompt up to the
injection site), so a forward can run them once and hand their KV cache to every row. The RL
roles (``nla.rl.kernels``, ``nla.rl.sampling``) and the AV warm-start (``nla.train.av``) do so;
these helpers are theirs: which models may reuse a cache, a repeated-row gather with a
deterministic backward, a cache cut to some rows, and an LM head on chosen positions only.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["CACHE_REUSE_MODEL_TYPES", "cache_rows", "lm_head_on", "supports_cache_reuse", "take_rows"]

# Model types whose KV cache the fast paths (``nla.rl.sampling``'s decode loop, the shared prefix
# of ``nla.rl.kernels.response_logprobs`` and of ``nla.train.av.token_losses``) are tested against
# the plain paths. Others (Gemma 3's sliding-window layers, GPT-2) gave different numbers in
# those tests and take the plain paths: HF ``generate``, the per-row forward.
CACHE_REUSE_MODEL_TYPES = frozenset({"llama", "qwen2"})


def supports_cache_reuse(model: nn.Module) -> bool:
    """Whether the fast paths may reuse this model's KV cache (``CACHE_REUSE_MODEL_TYPES``)."""
    return getattr(getattr(model, "config", None), "model_type", None) in CACHE_REUSE_MODEL_TYPES


def take_rows(x: Tensor, rows: Tensor) -> Tensor:
    """``x[rows]`` along dim 0 where ``rows`` repeats entries, with a backward whose sums over the
    repeats are the same bits on every run.

    Why not ``x[rows]``: on the CPU at 2 threads, the backward of a repeated-row gather (the
    shared prompt prefix's KV cache and last logits handed to each sample of a group) summed the
    repeats in an order that changed from call to call: the same policy update gave other
    weights in the last bits on every run, and RL runs of one seed drifted apart from step 2
    (issue 25; 1 thread, or unique rows, were stable). A one-hot matmul gives exactly the same
    forward values (each output is one row times 1 plus zeros) and a matmul backward, whose
    order the kernel fixes.
    """
    if x.shape[0] == 0 or len(rows) == 0:
        return x[rows]
    # a selection, exact in x's dtype: never the lower precision of an autocast region (rl.autocast)
    with torch.autocast(x.device.type, enabled=False):
        sel = torch.nn.functional.one_hot(rows, x.shape[0]).to(x.dtype)  # [r, n]
        return (sel @ x.reshape(x.shape[0], -1)).reshape(len(rows), *x.shape[1:])


def cache_rows(cache: Any, rows: Tensor) -> Any:
    """A copy of a KV cache holding the batch rows ``rows`` (the original is left as it is)."""
    sub = copy.copy(cache)
    sub.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in sub.layers:  # what DynamicLayer.batch_select_indices does, with take_rows
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = take_rows(layer.keys, rows), take_rows(layer.values, rows)
    return sub


@contextmanager
def lm_head_on(model: nn.Module, rows: Tensor) -> Iterator[None]:
    """Within the block, ``model``'s LM head reads only the positions where ``rows`` [n, l] is true:
    the forward's ``logits`` come back as [T, V], T = ``rows.sum()``, in row-major order.

    Logits at padding positions are never read (their log-probs are masked out of every loss),
    so this only skips work. A pre-hook on the head module, so that the head still runs inside
    the model's own forward (a sharded model gathers its root weights there).
    """
    head = model.get_output_embeddings()

    def select(_module: nn.Module, args: tuple) -> tuple:
        return (args[0][rows], *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()
