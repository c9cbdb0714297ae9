"""Where an activation vector comes from: the output of decoder block K at a token (docs/design.md §2).

Notation: B texts per batch, T padded length, d the model width, K the layer index.

Datagen's extract stage, the AV warm-start's smoke check, the world's probe and recall slots, the
suite's causal edits and the explorer all read vectors here, so a vector means one thing everywhere:

1. The vector at (text, position) is the output of decoder block K, i.e. HF ``hidden_states[K+1]``
   for K < L-1. For the last block HF applies the final norm to ``hidden_states[-1]``; the raw block
   output is kept there too, which is what the reconstructor (final norm = identity) predicts.
2. It is captured with a forward hook on block K that stops the forward pass (blocks after K are
   never computed).
3. Positions come from ``np.random.default_rng([seed, doc_id])``: they depend only on the seed, the
   document and its length, so any shard or rerun draws the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nla.core.arch import decoder_layers

__all__ = ["block_outputs", "pad_right", "sample_positions", "tokenize_text"]


class _StopForward(Exception):
    """Raised by the capture hook once block K has run: later blocks are wasted work."""


def sample_positions(
    seed: int, doc_id: int, n_tokens: int, positions_per_doc: int, skip_first: int
) -> np.ndarray:
    """Sorted token positions for one document; depends only on (seed, doc_id, n_tokens)."""
    candidates = np.arange(skip_first, n_tokens)
    if len(candidates) == 0:
        return candidates
    rng = np.random.default_rng([seed, doc_id])
    k = min(positions_per_doc, len(candidates))
    return np.sort(rng.choice(candidates, size=k, replace=False))


def tokenize_text(tokenizer: Any, text: str, max_len: int) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of ``text`` as extraction sees them (special tokens added, truncated to ``max_len``).

    Also returns the character span of each token when the tokenizer is fast (None otherwise).
    """
    fast = getattr(tokenizer, "is_fast", False)
    enc = tokenizer(text, truncation=True, max_length=max_len, return_offsets_mapping=fast)
    offsets = [tuple(o) for o in enc["offset_mapping"]] if fast else None
    return list(enc["input_ids"]), offsets


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one right-padded batch: (input_ids [B, T], attention_mask [B, T])."""
    T = max(len(x) for x in seqs)
    input_ids = torch.full((len(seqs), T), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, x in enumerate(seqs):
        input_ids[i, : len(x)] = torch.as_tensor(x, dtype=torch.long)
        mask[i, : len(x)] = 1
    return input_ids, mask


def block_outputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_index: int) -> torch.Tensor:
    """Output of decoder block ``layer_index`` [B, T, d] (model dtype, model device); later blocks never run."""
    return blocks_outputs(model, input_ids, attention_mask, [layer_index])[layer_index]


def blocks_outputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{K: output of decoder block K [B, T, d]}`` for every K of ``layers``, from one forward pass
    that stops after the deepest (what ``block_outputs`` gives for each K alone)."""
    captured: dict[int, torch.Tensor] = {}
    deepest = max(layers)
    blocks = decoder_layers(model)

    def hook_for(k: int):
        def hook(_module, _inputs, output):
            captured[k] = output[0] if isinstance(output, tuple) else output
            if k == deepest:
                raise _StopForward
        return hook

    handles = [blocks[k].register_forward_hook(hook_for(k)) for k in sorted(set(layers))]
    try:
        with torch.inference_mode():
            try:
                model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
    finally:
        for h in handles:
            h.remove()
    missing = [k for k in layers if k not in captured]
    if missing:
        raise RuntimeError(f"the hooks on decoder blocks {missing} did not fire; report this model family")
    return {k: captured[k] for k in layers}
