"""Log-prob kernels of the RL roles and the KV-cache handling they need.

The policy, reference and value roles (``nla.rl.roles``) all read the AV on a rollout the same
way: the shared AV prompt with the vector injected, then the sampled response. The functions
here compute that once, exactly (tests hold each saving to the plain per-row forward): the
shared-prefix forward with its cache repeated to a group's rows, length buckets, the LM head on
real positions only, and the micro-batching every rank runs in step.

Notation as in ``nla.rl.types``: N samples, P prompt tokens, L response tokens, d width.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from nla.core.arch import cache_kwargs, output_cache
from nla.core.injection import InjectionHook
from nla.core.logprobs import LOGPROB_CHUNK_ELEMENTS, entropy_from_logp
from nla.core.logprobs import token_logprobs as _token_logprobs
from nla.core.prefix import cache_rows, lm_head_on, supports_cache_reuse, take_rows
from nla.rl.distributed import DataParallel
from nla.rl.types import Rollout, prompt_batch

__all__ = [
    "LENGTH_BUCKETS", "LOGPROB_CHUNK_ELEMENTS", "MIN_BUCKET_ROWS", "by_group_length", "cache_rows", "entropy_from_logp",
    "length_buckets", "lm_head_on", "rank_micro_batches", "response_logprobs", "rollout_logprobs", "take_rows",
    "token_logprobs",
]

# Length buckets per shared-prefix log-prob forward (``length_buckets``), and their least size.
LENGTH_BUCKETS = 3
MIN_BUCKET_ROWS = 16


def response_logprobs(
    model: nn.Module, hook: InjectionHook, prompt_ids: Tensor, response_ids: Tensor, response_mask: Tensor,
    vectors: Tensor, *, with_entropy: bool = False, share_prefix: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [n, L] of the sampled response tokens (and entropies [n, L], detached).

    The input is ``prompt + response`` (right-padded after EOS); logits at ``P-1 .. P+L-2``
    predict the response tokens. Two savings, both exact (tests hold them to the plain path,
    ``share_prefix=False``, losses and gradients):

    - columns after the last real response token of every row are not computed (causal
      attention: they cannot change earlier positions); their log-probs are 0;
    - (shared-prefix path) the LM head, the log-softmax and the entropy run only at real
      response positions (``lm_head_on``); padding positions inside the kept columns get
      log-prob and entropy 0, which every loss masks out;
    - (shared-prefix path) the responses run in up to ``LENGTH_BUCKETS`` buckets of similar
      length (``length_buckets``), each to its own longest row, on the prefix run once;
    - ``share_prefix``: consecutive rows with the same vector (the samples of one group) have
      the same prompt prefix, so it runs once per run of rows (k rows), its KV cache and its
      last logits are repeated to the rows, and the responses run on top of that cache.
      Gradients reach the prefix through the repeated cache and logits (a sum over the
      group's rows, as in the per-row forward). Only for ``CACHE_REUSE_MODEL_TYPES``; other
      models take the per-row forward.
    """
    n, L = response_ids.shape
    P = prompt_ids.shape[-1]
    device = next(model.parameters()).device
    Lc = max(int(response_mask.sum(1).max()), 1) if n else L  # columns holding any real token
    resp, rmask = response_ids[:, :Lc].to(device), response_mask[:, :Lc].to(device).long()
    vectors = vectors.to(device)
    if share_prefix and supports_cache_reuse(model):
        starts = torch.ones(n, dtype=torch.bool, device=device)
        starts[1:] = (vectors[1:] != vectors[:-1]).any(1)
        owner = starts.long().cumsum(0) - 1  # [n] index of each row's run
        with hook.vectors(vectors[starts]):
            pre = model(input_ids=prompt_batch(prompt_ids.to(device), int(starts.sum()), starts), use_cache=True,
                        logits_to_keep=1)
        # response token 0: the run's last prompt logits [runs, V], read at each row's first token
        last = pre.logits[:, -1]
        if last.numel() <= _chunk():  # normalised once per run, then repeated to its rows
            first = take_rows(torch.log_softmax(last.float(), -1), owner)  # [n, V]
            logp = first.gather(-1, resp[:, :1])  # [n, 1]
            ent = entropy_from_logp(first.detach())[:, None] if with_entropy else None
        else:  # a large vocabulary: per row, a chunk at a time (token_logprobs)
            lp0, ent0 = token_logprobs(take_rows(last, owner), resp[:, 0], with_entropy=with_entropy)
            logp, ent = lp0[:, None], (ent0[:, None] if with_entropy else None)
        if Lc > 1:
            lengths = rmask.sum(1)
            rows_at, cols_at, picked, ents = [], [], [], []
            for idx in length_buckets(lengths, LENGTH_BUCKETS):
                Lb = int(lengths[idx].max())  # this bucket's columns (its longest row)
                if Lb < 2:  # nothing after response token 0
                    continue
                cache = cache_rows(output_cache(pre), owner[idx])
                attn = torch.cat([torch.ones(len(idx), P, dtype=torch.long, device=device), rmask[idx, : Lb - 1]], 1)
                real = rmask[idx, 1:Lb].bool()  # [nb, Lb-1]: position j predicts response token j+1
                with lm_head_on(model, real):
                    rest = model(input_ids=resp[idx, : Lb - 1], attention_mask=attn, **cache_kwargs(cache),
                                 use_cache=True).logits
                # [T_b, V]: the real positions only
                lp_b, ent_b = token_logprobs(rest, resp[idx, 1:Lb][real], with_entropy=with_entropy)
                picked.append(lp_b)
                if with_entropy:
                    ents.append(ent_b)
                at = real.nonzero(as_tuple=True)  # row-major, the order of ``h[real]``
                rows_at.append(idx[at[0]])
                cols_at.append(at[1])
            at = (torch.cat(rows_at), torch.cat(cols_at)) if picked else None
            zeros = torch.zeros(n, Lc - 1, dtype=logp.dtype, device=device)
            logp = torch.cat([logp, zeros.index_put(at, torch.cat(picked)) if at else zeros], 1)
            if with_entropy:
                ent = torch.cat([ent, zeros.index_put(at, torch.cat(ents)) if at else zeros], 1)
    else:
        ids = torch.cat([prompt_batch(prompt_ids.to(device), n), resp], 1)
        attn = torch.cat([torch.ones(n, P, dtype=torch.long, device=device), rmask], 1)
        with hook.vectors(vectors):
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, P - 1 : P + Lc - 1]
        lp, ent = token_logprobs(logits.reshape(n * Lc, -1), resp.reshape(-1), with_entropy=with_entropy)
        logp, ent = lp.view(n, Lc), (ent.view(n, Lc) if ent is not None else None)
    if Lc < L:
        logp = torch.nn.functional.pad(logp, (0, L - Lc))
        ent = torch.nn.functional.pad(ent, (0, L - Lc)) if ent is not None else None
    return logp, ent


def _chunk() -> int:
    return LOGPROB_CHUNK_ELEMENTS  # this module's: a bench or test may set it here


def token_logprobs(logits: Tensor, targets: Tensor, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """``nla.core.logprobs.token_logprobs`` in chunks of this module's ``LOGPROB_CHUNK_ELEMENTS``."""
    return _token_logprobs(logits, targets, with_entropy=with_entropy, chunk_elements=_chunk())


def length_buckets(lengths: Tensor, k: int) -> list[Tensor]:
    """Row indices in at most ``k`` buckets of consecutive lengths, longest first (``lengths`` [n]).

    ``response_logprobs`` runs each bucket to its own longest row, so a micro-batch of mixed
    lengths computes fewer padding columns: on the default world a 64-row micro-batch was 20%
    padding as one batch, 12% in 2 buckets, 7% in 3. Buckets hold at least
    ``MIN_BUCKET_ROWS`` rows (smaller matmuls cost more per row than the padding they save).
    """
    n = len(lengths)
    k = max(1, min(k, n // MIN_BUCKET_ROWS))
    order = torch.sort(lengths, descending=True, stable=True).indices
    return [b for b in torch.tensor_split(order, k) if len(b)]


def rank_micro_batches(dp: DataParallel, mine: Tensor, n: int, micro_batch_size: int
                       ) -> Iterator[tuple[Tensor, bool]]:
    """``(rows, real)`` per micro-batch of this rank's rows ``mine`` (of a batch of ``n``).

    Every rank runs the same number of micro-batches (FSDP forwards are collective); where a
    rank has no rows left its micro-batch is a one-row dummy (``real`` False) that the caller
    runs with weight 0.
    """
    for chunk in dp.micro_chunks(mine, n, micro_batch_size):
        yield (chunk, True) if len(chunk) else (torch.zeros(1, dtype=torch.long), False)


def by_group_length(rollout: Rollout, rows: Tensor) -> Tensor:
    """A permutation ``perm`` of ``range(len(rows))``: ``rows[perm]`` puts the longest groups first.

    A group here is a run of consecutive rows of ``rows`` with the same vector (they share the
    prompt prefix, so they stay together); groups are ordered by their longest response,
    longest first, ties in their original order. Micro-batches cut from that order hold
    responses of similar length, so ``response_logprobs`` trims more padding columns.
    """
    if len(rows) == 0:
        return torch.arange(0)
    vec = rollout.vectors[rows]
    starts = torch.ones(len(rows), dtype=torch.bool)
    starts[1:] = (vec[1:] != vec[:-1]).any(1)
    run = starts.long().cumsum(0) - 1  # [n] run index of each row
    longest = torch.zeros(int(run[-1]) + 1, dtype=torch.long).scatter_reduce(
        0, run, rollout.lengths[rows].long(), "amax")
    run_order = torch.sort(-longest, stable=True).indices  # runs, longest first
    rank_of_run = torch.empty_like(run_order)
    rank_of_run[run_order] = torch.arange(len(run_order))
    return torch.sort(rank_of_run[run], stable=True).indices


@torch.no_grad()
def rollout_logprobs(model: nn.Module, hook: InjectionHook, rollout: Rollout, mine: Tensor, n: int,
                     dp: DataParallel, micro_batch_size: int) -> Tensor:
    """Log-probs [len(mine), L] of the rows ``mine`` (this rank's share of a batch of ``n``), in that order.

    Micro-batches are cut from ``mine`` ordered by ``by_group_length``; the result is put back
    in the order of ``mine``.
    """
    perm = by_group_length(rollout, mine)
    out = []
    for idx, real in rank_micro_batches(dp, mine[perm], n, micro_batch_size):
        lp, _ = response_logprobs(model, hook, rollout.prompts_at(idx), rollout.response_ids[idx],
                                  rollout.response_mask[idx], rollout.vectors[idx])
        if real:
            out.append(lp.cpu())
    result = torch.zeros(len(mine), rollout.response_ids.shape[1])
    if out:
        result[perm] = torch.cat(out)
    return result


