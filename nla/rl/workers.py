"""Worker roles of the RL step, each written once for every backend.

The controller (``nla.rl.loop``) talks to five roles through these methods only:

- ``RolloutWorker.generate(vectors, n_samples, ...) -> Rollout`` and ``sync_weights(policy)``
- ``PolicyWorker.update(rollout, advantages, ref_logp) -> metrics`` (the AV, trained)
- ``ReferenceWorker.logprobs(rollout) -> [N, L]`` (the frozen warm-started AV)
- ``ReconstructorWorker.mse_batch(items) -> mse_nrm`` (live weights; never a reward) and ``update(...)``
- ``ValueWorker.values(rollout)`` / ``update(...)`` (PPO only)

Each role's update, scoring and optimiser code is here, once. What data parallelism adds
(which rows a rank takes, cross-rank sums, which rank answers, gathered state dicts) comes
from the role's ``DataParallel`` object (``nla.rl.distributed``): the local backend passes
one rank that owns every row, the Ray backend one ``RankGroup`` per actor.

Notation as in ``nla.rl.types``: N samples, P prompt tokens, L response tokens, d width.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nla import arch
from nla.injection import InjectionHook
from nla.reconstructor import Reconstructor, reconstruction_loss, tokenize_ar_texts
from nla.reward import extract_explanation
from nla.rl import algorithms as A
from nla.rl.config import RLConfig
from nla.rl.distributed import DataParallel, load_full_into
from nla.rl.sampling import sample_responses, supports_cache_reuse
from nla.rl.types import COMPLETED, FAILED_EXTRACTION, TRUNCATED, Rollout
from nla.sidecar import SIDECAR_NAME, NLAConfig, canonical_av_prompt_ids, write_sidecar
from nla.train.common import build_optimizer, optimizer_step_guarded, warmup_cosine
from nla.vectors import mse_nrm

logger = logging.getLogger(__name__)

LOCAL = DataParallel()
# Rows per padded AR forward of a reward call (rows ordered longest first). On the default
# world (2 cores, fp32) 64 rows in one batch: 0.252 s forward+backward, sorted sub-batches of
# 32: 0.212 s, 16: 0.210 s, 8: 0.223 s.
REWARD_SUB_BATCH = 32
# Length buckets per shared-prefix log-prob forward (``length_buckets``), and their least size.
LENGTH_BUCKETS = 3
MIN_BUCKET_ROWS = 16


# ----------------------------------------------------------------------------- shared math
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
    P = prompt_ids.shape[0]
    device = next(model.parameters()).device
    Lc = max(int(response_mask.sum(1).max()), 1) if n else L  # columns holding any real token
    resp, rmask = response_ids[:, :Lc].to(device), response_mask[:, :Lc].to(device).long()
    vectors = vectors.to(device)
    if share_prefix and supports_cache_reuse(model):
        starts = torch.ones(n, dtype=torch.bool, device=device)
        starts[1:] = (vectors[1:] != vectors[:-1]).any(1)
        owner = starts.long().cumsum(0) - 1  # [n] index of each row's run
        with hook.vectors(vectors[starts]):
            pre = model(input_ids=prompt_ids.to(device).expand(int(starts.sum()), P), use_cache=True,
                        logits_to_keep=1)
        # response token 0: the run's last prompt logits, normalised once per run
        first = take_rows(torch.log_softmax(pre.logits[:, -1].float(), -1), owner)  # [n, V]
        logp = first.gather(-1, resp[:, :1])  # [n, 1]
        ent = _entropy(first.detach())[:, None] if with_entropy else None
        if Lc > 1:
            lengths = rmask.sum(1)
            rows_at, cols_at, picked, ents = [], [], [], []
            for idx in length_buckets(lengths, LENGTH_BUCKETS):
                Lb = int(lengths[idx].max())  # this bucket's columns (its longest row)
                if Lb < 2:  # nothing after response token 0
                    continue
                cache = _cache_rows(pre.cache, owner[idx])
                attn = torch.cat([torch.ones(len(idx), P, dtype=torch.long, device=device), rmask[idx, : Lb - 1]], 1)
                real = rmask[idx, 1:Lb].bool()  # [nb, Lb-1]: position j predicts response token j+1
                with lm_head_on(model, real):
                    rest = model(input_ids=resp[idx, : Lb - 1], attention_mask=attn, cache=cache, use_cache=True).logits
                rest = torch.log_softmax(rest.float(), -1)  # [T_b, V]: the real positions only
                picked.append(rest.gather(-1, resp[idx, 1:Lb][real][:, None]).squeeze(-1))
                if with_entropy:
                    ents.append(_entropy(rest.detach()))
                at = real.nonzero(as_tuple=True)  # row-major, the order of ``h[real]``
                rows_at.append(idx[at[0]])
                cols_at.append(at[1])
            at = (torch.cat(rows_at), torch.cat(cols_at)) if picked else None
            zeros = torch.zeros(n, Lc - 1, dtype=first.dtype, device=device)
            logp = torch.cat([logp, zeros.index_put(at, torch.cat(picked)) if at else zeros], 1)
            if with_entropy:
                ent = torch.cat([ent, zeros.index_put(at, torch.cat(ents)) if at else zeros], 1)
    else:
        ids = torch.cat([prompt_ids.to(device).expand(n, P), resp], 1)
        attn = torch.cat([torch.ones(n, P, dtype=torch.long, device=device), rmask], 1)
        with hook.vectors(vectors):
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, P - 1 : P + Lc - 1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, resp[:, :, None]).squeeze(-1)
        ent = A.entropy_from_logits(logits.detach()) if with_entropy else None
    if Lc < L:
        logp = torch.nn.functional.pad(logp, (0, L - Lc))
        ent = torch.nn.functional.pad(ent, (0, L - Lc)) if ent is not None else None
    return logp, ent


DROPOUT_CONFIG_KEYS = ("attention_dropout", "hidden_dropout", "activation_dropout", "dropout", "attn_pdrop",
                       "resid_pdrop", "embd_pdrop")


def has_dropout(module: nn.Module) -> bool:
    """Whether training mode may compute something else than eval mode: a dropout module or a
    dropout config value (``DROPOUT_CONFIG_KEYS``) above 0 (HF passes attention dropout to the
    attention kernel as a number)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()):
        return True
    cfg = getattr(module, "config", None)
    return any(isinstance(v := getattr(cfg, k, 0), (int, float)) and v > 0 for k in DROPOUT_CONFIG_KEYS)


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
    sel = torch.nn.functional.one_hot(rows, x.shape[0]).to(x.dtype)  # [r, n]
    return (sel @ x.reshape(x.shape[0], -1)).reshape(len(rows), *x.shape[1:])


def _cache_rows(cache: Any, rows: Tensor) -> Any:
    """A copy of a KV cache holding the batch rows ``rows`` (the original is left as it is)."""
    import copy

    sub = copy.copy(cache)
    sub.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in sub.layers:  # what DynamicLayer.batch_select_indices does, with take_rows
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = take_rows(layer.keys, rows), take_rows(layer.values, rows)
    return sub


def _entropy(logp: Tensor) -> Tensor:
    """Entropy [...] of the distributions whose log-probs are ``logp`` [..., V]."""
    return -(logp.exp() * logp).sum(-1)


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
        lp, _ = response_logprobs(model, hook, rollout.prompt_ids, rollout.response_ids[idx],
                                  rollout.response_mask[idx], rollout.vectors[idx])
        if real:
            out.append(lp.cpu())
    result = torch.zeros(len(mine), rollout.response_ids.shape[1])
    if out:
        result[perm] = torch.cat(out)
    return result


def _parse_responses(tokenizer: Any, response_ids: Tensor, eos_id: int) -> tuple[Tensor, list[str], Tensor]:
    """Mask [N, L] up to and including the first EOS, decoded texts, and truncation flags [N]."""
    N, L = response_ids.shape
    is_eos = response_ids == eos_id
    has_eos = is_eos.any(1)
    first = torch.where(has_eos, is_eos.float().argmax(1), torch.full((N,), L))
    pos = torch.arange(L).expand(N, L)
    mask = (pos <= first[:, None]).long() if L else torch.zeros(N, 0, dtype=torch.long)
    mask = torch.where(has_eos[:, None], mask, torch.ones_like(mask))
    texts = []
    for i in range(N):
        n_text = int(first[i]) if has_eos[i] else L
        # special tokens are kept: the <explanation> tags may be added tokens.
        texts.append(tokenizer.decode(response_ids[i, :n_text].tolist(), skip_special_tokens=False))
    return mask, texts, ~has_eos


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class OptimSettings:
    """One trained role's optimiser and schedule (AdamW, warmup then constant LR)."""

    lr: float
    weight_decay: float
    warmup_steps: int
    total_steps: int
    max_grad_norm: float

    @classmethod
    def _of(cls, cfg: RLConfig, lr: float, total_steps: int) -> OptimSettings:
        o = cfg.optimiser
        return cls(lr, o.weight_decay, o.warmup_steps, total_steps, o.max_grad_norm)

    @classmethod
    def for_policy(cls, cfg: RLConfig) -> OptimSettings:
        return cls._of(cfg, cfg.optimiser.lr, cfg.steps * cfg.updates_per_rollout)

    @classmethod
    def for_reconstructor(cls, cfg: RLConfig) -> OptimSettings:
        return cls._of(cfg, cfg.ar_lr_value, cfg.steps)

    @classmethod
    def for_value(cls, cfg: RLConfig) -> OptimSettings:
        return cls._of(cfg, cfg.optimiser.value_lr_value, cfg.steps)


@dataclass(frozen=True)
class PolicyLossSettings:
    """What the policy loss of every backend reads from the RL config."""

    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    kl_coef: float
    kl_estimator: str
    loss_agg: str
    micro_batch_size: int
    updates_per_rollout: int
    norm_len: int  # the generation cap: the constant of seq-mean-token-sum-norm (Dr.GRPO)

    @classmethod
    def from_config(cls, cfg: RLConfig) -> PolicyLossSettings:
        lo = cfg.loss
        return cls(eps_low=lo.eps_low, eps_high=lo.eps_high, dual_clip_c=lo.dual_clip_c, kl_coef=lo.kl_coef,
                   kl_estimator=lo.kl_estimator, loss_agg=lo.loss_agg, micro_batch_size=cfg.optimiser.micro_batch_size,
                   updates_per_rollout=cfg.updates_per_rollout, norm_len=cfg.rollout.max_response_len)


# ----------------------------------------------------------------------------- roles
class RolloutWorker:
    """Samples explanations from the current AV weights (the local backend shares the policy module)."""

    def __init__(self, model: nn.Module, tokenizer: Any, sidecar: NLAConfig, device: torch.device) -> None:
        self.model, self.tokenizer, self.sidecar, self.device = model, tokenizer, sidecar, device
        self.hook = InjectionHook.from_config(model, sidecar)
        self.prompt_ids = torch.tensor(canonical_av_prompt_ids(tokenizer, sidecar.av_messages()), dtype=torch.long)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def sync_weights(self, policy: PolicyWorker) -> None:
        """Make the next rollout use the policy's weights. Local: the module is shared, nothing to copy."""
        if policy.model is not self.model:
            self.load_weights(policy.model.state_dict())

    def load_weights(self, state: dict[str, Tensor]) -> None:
        """Copy a full state dict (e.g. gathered from the policy's shards) into this unsharded copy."""
        load_full_into(self.model, state)

    @torch.no_grad()
    def generate(self, vectors: Tensor, prompt_rows: Tensor, n_samples: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False) -> Rollout:
        """``n_samples`` responses per vector [B, d] -> a Rollout of N = B * n_samples (groups contiguous)."""
        B = vectors.shape[0]
        vec = vectors.repeat_interleave(n_samples, 0)
        rows = prompt_rows.repeat_interleave(n_samples, 0)
        N = vec.shape[0]
        was_training = self.model.training
        self.model.eval()
        try:
            # Finished rows leave the batch; greedy gives HF generate's tokens (nla.rl.sampling).
            resp = sample_responses(
                self.model, self.hook, self.prompt_ids, vectors, n_samples, max_new_tokens, self.eos_id,
                self.pad_id, temperature=temperature, top_p=top_p, greedy=greedy,
                # The AV must never write the marker: a second site in prompt+response would
                # shift the injection in the log-prob forward (and it is the failure smell).
                suppress_ids=[self.sidecar.injection_token_id],
            ).cpu()
        finally:
            self.model.train(was_training)
        mask, texts, truncated = _parse_responses(self.tokenizer, resp, self.eos_id)
        resp = torch.where(mask.bool(), resp, torch.full_like(resp, self.pad_id))
        explanations: list[str | None] = []
        status = torch.full((N,), COMPLETED, dtype=torch.long)
        for i, text in enumerate(texts):
            exp = None if truncated[i] else extract_explanation(text)
            explanations.append(exp)
            if truncated[i]:
                status[i] = TRUNCATED
            elif exp is None:
                status[i] = FAILED_EXTRACTION
        return Rollout(
            prompt_rows=rows.cpu(), group=torch.arange(B).repeat_interleave(n_samples), vectors=vec.float().cpu(),
            prompt_ids=self.prompt_ids, response_ids=resp, response_mask=mask, texts=texts,
            explanations=explanations, status=status,
        )


class _Trainable:
    """Optimiser + schedule + guarded step + optimiser state, shared by the trained roles."""

    def _setup_optim(self, module: nn.Module, optim: OptimSettings, dp: DataParallel) -> None:
        self._module, self.dp = module, dp
        self.opt = build_optimizer(module, optim.lr, optim.weight_decay)
        total = optim.total_steps
        self.sched = warmup_cosine(self.opt, optim.warmup_steps, total, min_lr_ratio=1.0) if total > 0 else None
        self.max_grad_norm = optim.max_grad_norm
        self.skipped_steps = 0

    def _step(self) -> dict[str, float]:
        """Clip and step (the norm is global on sharded gradients); a non-finite gradient skips the step."""
        lr = self.opt.param_groups[0]["lr"]
        stepped, grad_norm = optimizer_step_guarded(self._module, self.opt, self.sched, self.max_grad_norm)
        self.skipped_steps += 0 if stepped else 1
        return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": float(self.skipped_steps)}

    def optim_state(self) -> dict[str, Any]:
        return {"format": self.dp.optim_format, "optimizer": self.dp.optim_state_dict(self._module, self.opt),
                "scheduler": self.sched.state_dict() if self.sched else None, "skipped_steps": self.skipped_steps}

    def load_optim_state(self, state: dict[str, Any]) -> None:
        found = state.get("format", "local")  # checkpoints written before the key existed are local
        if found != self.dp.optim_format:
            raise ValueError(
                f"optimizer state: expected the {self.dp.optim_format!r} format of this backend, found {found!r}; "
                "resume a run with the backend that wrote it"
            )
        self.dp.load_optim_state_dict(self._module, self.opt, state["optimizer"])
        if self.sched is not None and state.get("scheduler") is not None:
            self.sched.load_state_dict(state["scheduler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def policy_micro_loss(model: nn.Module, hook: InjectionHook, rollout: Rollout, idx: Tensor, advantages: Tensor,
                      ref_logp: Tensor, old_all: Tensor | None, s: PolicyLossSettings
                      ) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Clipped surrogate + ``kl_coef`` x KL on the rows ``idx``, aggregated by ``s.loss_agg``.

    Returns (loss, response mask [n, L], detached metrics). ``old_all`` None means on-policy:
    ``old_logp`` is this forward's detached log-prob.
    """
    logp, ent = response_logprobs(model, hook, rollout.prompt_ids, rollout.response_ids[idx],
                                  rollout.response_mask[idx], rollout.vectors[idx], with_entropy=True)
    m = rollout.response_mask[idx].float().to(logp.device)
    old = old_all[idx].to(logp.device) if old_all is not None else logp.detach()
    pg, pm = A.policy_loss(logp, old, advantages[idx].to(logp.device), m, eps_low=s.eps_low,
                           eps_high=s.eps_high, dual_clip_c=s.dual_clip_c, agg=s.loss_agg, norm_len=s.norm_len)
    kl_tok = A.kl_penalty(logp, ref_logp[idx].to(logp.device), s.kl_estimator, mask=m)
    loss = pg + s.kl_coef * A.aggregate_loss(kl_tok, m, s.loss_agg, norm_len=s.norm_len)
    pm.update(pg_loss=float(pg.detach()), kl=float(A.masked_mean(kl_tok.detach(), m)),
              entropy=float(A.masked_mean(ent, m)), policy_loss=float(loss.detach()))
    return loss, m, pm


def update_batches(n: int, updates: int) -> list[Tensor]:
    """The rows of each of ``updates`` optimiser steps on an ``n``-row rollout: consecutive, sizes
    differing by at most one, every row in exactly one batch (a dynamic-sampling rollout short of
    a full batch need not divide evenly); fewer batches when ``n < updates`` (none empty)."""
    return [b for b in torch.tensor_split(torch.arange(n), max(1, updates)) if b.numel()]


class PolicyWorker(_Trainable):
    """The AV under RL: clipped surrogate + KL-to-reference loss, aggregated by ``loss_agg``."""

    def __init__(self, model: nn.Module, tokenizer: Any, sidecar: NLAConfig, settings: PolicyLossSettings,
                 optim: OptimSettings, dp: DataParallel = LOCAL) -> None:
        self.model, self.tokenizer, self.sidecar, self.settings = model, tokenizer, sidecar, settings
        self.hook = InjectionHook.from_config(model, sidecar)
        self._setup_optim(model, optim, dp)

    def update(self, rollout: Rollout, advantages: Tensor, ref_logp: Tensor) -> dict[str, float]:
        """Policy step(s) on one rollout; returns averaged detached metrics.

        advantages, ref_logp: [N, L] for the whole rollout (each rank reads its rows). With one
        update per rollout (the on-policy default) ``old_logp`` is the detached log-prob of this
        very forward, so ``ratio == 1`` in value and the gradient is the exact policy gradient;
        several updates per rollout compute ``old_logp`` once up front. Each micro-batch's loss
        is weighted by its share of the update's batch (``micro_batch_weight`` of the mode), so
        the accumulated gradient is that of the whole batch on any split and any number of ranks.
        """
        s, dp = self.settings, self.dp
        agg = A.get_loss_agg(s.loss_agg)
        self.model.train()
        mask = rollout.response_mask.float()
        batches = update_batches(rollout.n, s.updates_per_rollout)
        old_all = None
        if len(batches) > 1:
            old_all = torch.zeros(rollout.n, rollout.response_ids.shape[1])
            for rows in batches:
                mine = dp.my_rows(rows)
                old_all[mine] = rollout_logprobs(self.model, self.hook, rollout, mine, len(rows), dp,
                                                 s.micro_batch_size)
        sums: dict[str, float] = {}
        step_sums: dict[str, float] = {}
        for rows in batches:
            mine = dp.my_rows(rows)
            mine = mine[by_group_length(rollout, mine)]  # similar lengths per micro-batch: less padding
            for idx, real in rank_micro_batches(dp, mine, len(rows), s.micro_batch_size):
                loss, m, pm = policy_micro_loss(self.model, self.hook, rollout, idx, advantages, ref_logp, old_all, s)
                w = agg.micro_batch_weight(m.cpu(), mask[rows]) if real else 0.0
                (loss * (w * dp.grad_scale)).backward()
                if real:
                    for k, v in pm.items():
                        if math.isfinite(v):
                            sums[k] = sums.get(k, 0.0) + v * w
            for k, v in self._step().items():
                step_sums[k] = step_sums.get(k, 0.0) + v
        total = dp.sum(sums)
        total.update(step_sums)  # the same on every rank: the gradient norm is global
        return {k: v / max(1, len(batches)) for k, v in total.items()}

    def full_weights(self) -> dict[str, Tensor] | None:
        """The full AV weights on the answering rank (collective when sharded); None locally."""
        return self.dp.full_state_dict(self.model)

    def save_model(self, directory: str | Path, **provenance: Any) -> None:
        """HF dir + tokenizer + AV sidecar (role av) with provenance, written by the answering rank."""
        state = self.full_weights()
        if self.dp.answers:
            directory = Path(directory)
            self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
            write_sidecar(directory / SIDECAR_NAME, self.sidecar.replace(kind="nla_model", role="av"), **provenance)


class ReferenceWorker:
    """The frozen warm-started AV: log-probs for the KL term."""

    def __init__(self, model: nn.Module, sidecar: NLAConfig, micro_batch_size: int, dp: DataParallel = LOCAL
                 ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.hook = InjectionHook.from_config(model, sidecar)
        self.micro_batch_size, self.dp = micro_batch_size, dp

    def logprobs(self, rollout: Rollout) -> Tensor:
        """Reference log-probs [n_r, L] of this rank's rows (every row locally)."""
        mine = self.dp.my_rows(torch.arange(rollout.n))
        return rollout_logprobs(self.model, self.hook, rollout, mine, rollout.n, self.dp, self.micro_batch_size)


class ReconstructorWorker(_Trainable):
    """The AR: ``mse_nrm`` from its *live* weights, and supervised MSE updates on the same rollouts.

    ``mse_batch`` is handed to a ``RewardBatcher`` as a bound method, so every reward is
    computed from this very module: no copy, no reload. It returns MSEs; the loop alone turns
    them into rewards (``nla.rl.loop.shape_rewards``). Sharded, every rank scores the same
    items (the forward is collective) and the caller reads rank 0's answer.
    """

    def __init__(self, ar: Reconstructor, tokenizer: Any, sidecar: NLAConfig, optim: OptimSettings,
                 max_length: int, micro_batch_size: int, device: torch.device, dp: DataParallel = LOCAL) -> None:
        self.ar, self.tokenizer, self.sidecar = ar, tokenizer, sidecar
        self.scale = sidecar.mse_scale_value()
        self.max_length, self.micro_batch_size, self.device = max_length, micro_batch_size, device
        self._setup_optim(ar, optim, dp)
        # The reward forward doubles as the AR update's forward (``begin_rollout``): exact only
        # when training mode computes what eval mode does (no dropout) and one unsharded AR
        # answers (sharded ranks each score every item, so their backward would repeat it;
        # a one-rank FSDP group is left on the plain path too: untested there).
        sharded = any(arch.is_sharded(m) for m in ar.modules())
        self.fuse_reward = dp.world == 1 and not sharded and not has_dropout(ar)
        self._window: list[tuple[str, Tensor]] | None = None
        self._window_mse_sum = 0.0

    def _encode(self, explanations: list[str], padding_side: str = "right") -> dict[str, Tensor]:
        texts = [self.sidecar.ar_text(e) for e in explanations]
        return tokenize_ar_texts(self.tokenizer, texts, self.max_length, padding_side)

    @torch.no_grad()
    def predict(self, explanations: list[str], padding_side: str = "left") -> Tensor:
        """AR predictions [n, d] (fp32, CPU) for explanation texts, in one padded batch.

        The reward path pads on the left like a batched inference server; the training path
        pads on the right. ``layout_check`` asserts both give the same numbers.
        """
        was = self.ar.training
        self.ar.eval()
        try:
            enc = self._encode(explanations, padding_side)
            pred = self.ar.predict(enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device))
        finally:
            self.ar.train(was)
        return pred.float().cpu()

    def begin_rollout(self) -> None:
        """Open the reward window of one RL step: the rollout's rewards become its AR gradients.

        The reward of a sample is the live AR's prediction on its explanation, made with the
        very weights the step's AR update starts from (nothing changes the AR in between), and
        the update trains on exactly those samples. So, with ``fuse_reward``, every
        ``mse_batch`` call until the next ``update`` runs its forward with autograd on and
        backpropagates the sum of its rows' ``mse_nrm`` at once (no graph is kept); the update
        then computes only the rows it has not seen (replay rows), scales the sum to the mean
        and steps. The reward values are those of the plain path (the same forward, read the
        same way); the gradient is the plain update's to float tolerance (the reward layout
        is left-padded, the training layout right-padded: the step-0 guard holds them equal).
        Calls outside a window (evaluation, tests, the Ray backend's sharded AR) take the
        plain no-grad path.
        """
        self._window = [] if self.fuse_reward else None
        self._window_mse_sum = 0.0
        if self._window is not None:
            self.opt.zero_grad(set_to_none=True)

    def mse_batch(self, items: list[tuple[str, Tensor]]) -> Tensor:
        """``mse_nrm`` [n] for (explanation, RAW gold [d]) pairs with the live AR weights.

        The rows run longest first in sub-batches of ``REWARD_SUB_BATCH`` (left-padded): a
        batch in rollout order was ~25% padding on the default world, sorted sub-batches ~10%.
        Each row's prediction does not depend on its neighbours (float rounding aside).
        """
        exps = [e for e, _ in items]
        gold = torch.stack([g for _, g in items]).float()
        order = sorted(range(len(exps)), key=lambda i: -len(exps[i]))
        out = torch.empty(len(exps))
        for start in range(0, len(order), REWARD_SUB_BATCH):
            rows = order[start : start + REWARD_SUB_BATCH]
            out[rows] = self._mse_rows([exps[i] for i in rows], gold[rows])
        if self._window is not None:
            self._window.extend(items)
        return out

    def _mse_rows(self, explanations: list[str], gold: Tensor) -> Tensor:
        """``mse_nrm`` [n] of one padded batch; inside a reward window also its gradient (summed)."""
        if self._window is None:
            return mse_nrm(self.predict(explanations), gold, self.scale)
        # In the window: the same forward (reward layout), with autograd on, in training mode
        # (which computes what eval mode does: ``fuse_reward`` requires no dropout).
        was = self.ar.training
        self.ar.train()
        try:
            enc = self._encode(explanations, "left")
            with torch.enable_grad():
                pred = self.ar.predict(enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device))
                per_row = mse_nrm(pred, gold.to(pred.device), self.scale)  # reconstruction_loss's terms
                per_row.sum().backward()
        finally:
            self.ar.train(was)
        self._window_mse_sum += float(per_row.detach().sum())
        return mse_nrm(pred.detach().float().cpu(), gold, self.scale)  # exactly the plain path's value

    def layout_check(self, explanations: list[str], golds: Tensor) -> float:
        """Max relative difference of per-sample MSE between the reward and training layouts."""
        reward_mse = mse_nrm(self.predict(explanations, "left"), golds, self.scale)
        train_mse = mse_nrm(self.predict(explanations, "right"), golds, self.scale)
        return float(((reward_mse / train_mse.clamp_min(1e-12)) - 1).abs().max())

    def save_model(self, directory: str | Path, **provenance: Any) -> None:
        state = self.dp.full_state_dict(self.ar)
        if self.dp.answers:
            self.ar.save_pretrained(directory, self.sidecar, state_dict=state, **provenance)

    def _window_rows(self, explanations: list[str], golds: Tensor) -> int:
        """How many leading rows of the update the closing reward window already backpropagated
        (0 when there was no window, or when its items are not the update's first rows)."""
        window, self._window = self._window, None
        if not window:
            return 0
        k = len(window)
        same = k <= len(explanations) and all(
            e == explanations[i] and torch.equal(g.float(), golds[i].float()) for i, (e, g) in enumerate(window))
        if not same:
            logger.warning("AR update: the %d samples scored since begin_rollout are not the update's first rows; "
                           "their gradients are dropped and every row is recomputed", k)
            self.opt.zero_grad(set_to_none=True)
            return 0
        return k

    def update(self, explanations: list[str], golds: Tensor) -> dict[str, float]:
        """One supervised step: mean ``mse_nrm`` over all rows (right-padded layout, this rank's share).

        Rows whose gradients the reward window already holds (``begin_rollout``) are not run
        again: their summed gradient is scaled to their share of the mean, and only the other
        rows (replay rows) run here.
        """
        n = len(explanations)
        done = self._window_rows(explanations, golds)
        if n == 0:
            return {"ar_loss": float("nan"), "ar_rows": 0.0}
        dp = self.dp
        self.ar.train()
        total = 0.0
        if done:
            for p in self.ar.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / n)
            total = self._window_mse_sum / n
        mine = dp.my_rows(torch.arange(done, n))
        # Micro-batches of texts of similar length pad less; the loss is a mean over rows, so
        # each micro-batch's weight (its share of rows) keeps the step the same on any order.
        mine = mine[torch.sort(torch.tensor([-len(explanations[i]) for i in mine.tolist()]), stable=True).indices]
        # (A window covering every row leaves nothing to run: it exists on one rank only.)
        chunks = rank_micro_batches(dp, mine, n - done, self.micro_batch_size) if done < n else ()
        for idx, real in chunks:
            enc = self._encode([explanations[i] for i in idx.tolist()], "right")
            loss, _ = reconstruction_loss(self.ar, enc["input_ids"].to(self.device),
                                          enc["attention_mask"].to(self.device), golds[idx], self.scale)
            w = len(idx) / n if real else 0.0
            (loss * (w * dp.grad_scale)).backward()
            total += float(loss.detach()) * w
        stats = {f"ar_{k}": v for k, v in self._step().items()}
        stats.update(ar_loss=dp.sum({"ar_loss": total})["ar_loss"], ar_rows=float(n))
        return stats


class ValueModel(nn.Module):
    """PPO's scalar value model: the AV's transformer body + ``Linear(d, 1)`` (zero-initialised)."""

    def __init__(self, policy_model: nn.Module) -> None:
        super().__init__()
        import copy

        self.body = copy.deepcopy(arch.base_model(policy_model))
        d = arch.hidden_size(self.body.config)
        self.head = nn.Linear(d, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1)


class ValueWorker(_Trainable):
    """Values [N, L] for the states before each response token (the vector is injected too). Local only."""

    def __init__(self, policy_model: nn.Module, sidecar: NLAConfig, optim: OptimSettings, micro_batch_size: int,
                 clip_eps: float | None) -> None:
        self.model = ValueModel(policy_model)
        self.hook = InjectionHook(self.model.body, sidecar.injection_token_id, sidecar.injection_left_neighbor_id,
                                  sidecar.injection_right_neighbor_id, sidecar.injection_scale_value())
        self.micro_batch_size, self.clip_eps = micro_batch_size, clip_eps
        self._setup_optim(self.model, optim, LOCAL)

    def _values(self, rollout: Rollout, idx: Tensor) -> Tensor:
        P, L = rollout.prompt_ids.shape[0], rollout.response_ids.shape[1]
        n = len(idx)
        device = next(self.model.parameters()).device
        ids = torch.cat([rollout.prompt_ids.to(device).expand(n, P), rollout.response_ids[idx].to(device)], 1)
        attn = torch.cat([torch.ones(n, P, dtype=torch.long, device=device),
                          rollout.response_mask[idx].to(device).long()], 1)
        with self.hook.vectors(rollout.vectors[idx].to(device)):
            v = self.model(ids, attn)
        return v[:, P - 1 : P + L - 1]

    def save_model(self, path: Path) -> None:
        torch.save(self.model.state_dict(), path)

    def load_model(self, path: Path) -> None:
        self.model.load_state_dict(torch.load(path, weights_only=True))

    @torch.no_grad()
    def values(self, rollout: Rollout) -> Tensor:
        self.model.eval()
        rows = torch.arange(rollout.n)
        return torch.cat([self._values(rollout, idx).cpu()
                          for idx, _ in rank_micro_batches(self.dp, rows, rollout.n, self.micro_batch_size)])

    def update(self, rollout: Rollout, old_values: Tensor, returns: Tensor) -> dict[str, float]:
        self.model.train()
        mask = rollout.response_mask.float()
        agg = A.get_loss_agg("token-mean")
        sums: dict[str, float] = {}
        for idx, _ in rank_micro_batches(self.dp, torch.arange(rollout.n), rollout.n, self.micro_batch_size):
            v = self._values(rollout, idx)
            m = mask[idx].to(v.device)
            loss, vm = A.value_loss(v, old_values[idx].to(v.device), returns[idx].to(v.device), m,
                                    clip_eps=self.clip_eps, agg=agg.name)
            w = agg.micro_batch_weight(mask[idx], mask)
            (loss * w).backward()
            sums["value_loss"] = sums.get("value_loss", 0.0) + float(loss.detach()) * w
            for k, val in vm.items():
                sums[f"value_{k}"] = sums.get(f"value_{k}", 0.0) + float(val) * w
        sums.update({f"value_{k}": v for k, v in self._step().items()})
        return sums


@dataclass
class WorkerGroups:
    """The roles one controller drives. ``value`` is None unless the estimator needs values."""

    rollout: RolloutWorker
    policy: PolicyWorker
    reference: ReferenceWorker
    reconstructor: ReconstructorWorker
    value: ValueWorker | None = None
    tokenizer: Any = None
    av_sidecar: NLAConfig | None = None
    ar_sidecar: NLAConfig | None = None

    def close(self) -> None:
        """Release resources (remote backends stop their actors here)."""


__all__ = [
    "OptimSettings", "by_group_length", "has_dropout", "lm_head_on", "PolicyLossSettings", "PolicyWorker",
    "REWARD_SUB_BATCH", "ReconstructorWorker", "ReferenceWorker", "RolloutWorker", "ValueModel", "ValueWorker",
    "WorkerGroups", "policy_micro_loss", "rank_micro_batches", "response_logprobs", "rollout_logprobs",
    "update_batches",
]
