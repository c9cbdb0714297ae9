"""Log-probabilities of chosen tokens under a large vocabulary, a row chunk at a time.

Shared by the RL log-prob passes (``nla.rl.kernels``) and the AV warm-start's loss
(``nla.train.av``). Pure tensor functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LOGPROB_CHUNK_ELEMENTS", "entropy_from_logp", "token_logprobs"]


def entropy_from_logp(logp: Tensor) -> Tensor:
    """Entropy [...] of the distributions whose log-probs are ``logp`` [..., V]."""
    return -(logp.exp() * logp).sum(-1)


# fp32 elements of one log-softmax chunk (``token_logprobs``): 2**25 x 4 B = 128 MiB, 220 rows of
# Qwen2.5's 151,936 columns; a 512-token vocabulary fits 65,536 rows in one chunk.
LOGPROB_CHUNK_ELEMENTS = 2**25


def token_logprobs(logits: Tensor, targets: Tensor, *, with_entropy: bool = False,
                   chunk_elements: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs [T] of ``targets`` [T] under ``logits`` [T, V] (any dtype; computed in fp32), and
    entropies [T] (detached).

    The fp32 copy and the log-softmax of a [T, V] block are what an RL step's log-prob passes
    hold at a large vocabulary (three [T, V] tensors, two of them fp32, kept for backward). Here
    they exist for ``chunk_elements // V`` rows at a time: each row chunk runs under activation
    checkpointing, so backward recomputes its softmax instead of keeping it, and memory follows
    the micro-batch's tokens times the chunk, not times V. One chunk holding every row (a small
    vocabulary) is the plain computation, the same values bit for bit. ``chunk_elements``: None =
    ``LOGPROB_CHUNK_ELEMENTS``.
    """
    T, V = logits.shape
    rows = max(1, (chunk_elements or LOGPROB_CHUNK_ELEMENTS) // max(V, 1))

    def pick(block: Tensor, tgt: Tensor) -> Tensor:
        return torch.log_softmax(block.float(), -1).gather(-1, tgt[:, None]).squeeze(-1)

    if T <= rows:
        lp = torch.log_softmax(logits.float(), -1)
        return lp.gather(-1, targets[:, None]).squeeze(-1), (entropy_from_logp(lp.detach()) if with_entropy else None)
    from torch.utils.checkpoint import checkpoint

    picked, ents = [], []
    for s in range(0, T, rows):
        block, tgt = logits[s : s + rows], targets[s : s + rows]
        picked.append(checkpoint(pick, block, tgt, use_reentrant=False) if block.requires_grad else pick(block, tgt))
        if with_entropy:
            with torch.no_grad():
                ents.append(entropy_from_logp(torch.log_softmax(block.detach().float(), -1)))
    return torch.cat(picked), (torch.cat(ents) if with_entropy else None)
