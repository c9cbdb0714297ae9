"""The policy role: the AV under RL (clipped surrogate + KL to the reference).

``PolicyWorker.update(rollout, advantages, ref_logp) -> metrics``; the loss math is
``nla.rl.algorithms`` (pure tensor functions), the log-probs ``nla.rl.kernels``. What data
parallelism adds (which rows a rank takes, cross-rank sums) comes from the role's
``DataParallel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nla.core.injection import InjectionHook, save_av_checkpoint
from nla.core.sidecar import NLAConfig
from nla.rl import algorithms as A
from nla.rl.config import RLConfig
from nla.rl.distributed import DataParallel
from nla.rl.kernels import by_group_length, rank_micro_batches, response_logprobs, rollout_logprobs
from nla.rl.roles.trainable import LOCAL, OptimSettings, Trainable
from nla.rl.types import Rollout

__all__ = ["PolicyLossSettings", "PolicyWorker", "policy_micro_loss", "update_batches"]


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
    share_prefix: bool = True  # off under gradient checkpointing (it drops the prefix's cache)

    @classmethod
    def from_config(cls, cfg: RLConfig) -> PolicyLossSettings:
        lo = cfg.loss
        return cls(eps_low=lo.eps_low, eps_high=lo.eps_high, dual_clip_c=lo.dual_clip_c, kl_coef=lo.kl_coef,
                   kl_estimator=lo.kl_estimator, loss_agg=lo.loss_agg, micro_batch_size=cfg.optimiser.micro_batch_size,
                   updates_per_rollout=cfg.updates_per_rollout, norm_len=cfg.rollout.max_response_len,
                   share_prefix=not cfg.optimiser.gradient_checkpointing)


def policy_micro_loss(model: nn.Module, hook: InjectionHook, rollout: Rollout, idx: Tensor, advantages: Tensor,
                      ref_logp: Tensor, old_all: Tensor | None, s: PolicyLossSettings
                      ) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Clipped surrogate + ``kl_coef`` x KL on the rows ``idx``, aggregated by ``s.loss_agg``.

    Returns (loss, response mask [n, L], detached metrics). ``old_all`` None means on-policy:
    ``old_logp`` is this forward's detached log-prob.
    """
    logp, ent = response_logprobs(model, hook, rollout.prompts_at(idx), rollout.response_ids[idx],
                                  rollout.response_mask[idx], rollout.vectors[idx], with_entropy=True,
                                  share_prefix=s.share_prefix)
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


class PolicyWorker(Trainable):
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
        """HF dir + tokenizer + AV sidecar (role av) with provenance, written by the answering rank.
        With LoRA the dir holds the merged AV, and ``<dir>_adapter`` the adapter (``nla.core.lora``)."""
        from nla.core.lora import adapter_dir_for, has_lora, merged_state_dict, save_adapter

        lora = has_lora(self.model)
        full = self.full_weights()  # None locally: the module's own
        state = merged_state_dict(self.model, full) if lora else full
        if self.dp.answers:
            directory = Path(directory)
            # the injection adapter's file too, when the AV has one
            save_av_checkpoint(self.model, self.tokenizer, self.sidecar, directory, state, **provenance)
            if lora:  # the adapter alone too: RL resumes from it on the warm-started base
                save_adapter(self.model, adapter_dir_for(directory), provenance.get("parent_av", ""), state=full)

