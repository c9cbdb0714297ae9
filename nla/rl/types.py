"""Typed state passed between the RL controller and the worker groups.

Notation: B prompts, G samples per prompt, N = B*G samples, P prompt tokens (the AV prompt
is identical for every row), L response tokens (right-padded), d model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nla.core.reward import Status

# The per-sample status codes a rollout stores (``Status.code``; ``nla.core.reward.Status`` is the one type).
COMPLETED, TRUNCATED, FAILED_EXTRACTION = Status.COMPLETED.code, Status.TRUNCATED.code, Status.FAILED.code


@dataclass
class Rollout:
    """One rollout of N samples.

    prompt_rows: [N] index of each sample's prompt row in the RL dataset.
    group: [N] group id (0..B-1): samples of one prompt share it; groups are contiguous.
    vectors: [N, d] RAW gold activations (repeated G times per prompt).
    prompt_ids: [P] the canonical AV prompt (the same for every row), or [N, P] a prompt per row (a pair
        of several blocks names each row's block in it; every block's prompt has one length).
    response_ids: [N, L] sampled tokens, right-padded with pad_id after EOS.
    response_mask: [N, L] 1 on generated tokens up to and including EOS.
    texts: decoded responses; explanations: extracted text or None (miss or truncation).
    status: [N] the ``Status.code`` of each sample (COMPLETED | TRUNCATED | FAILED_EXTRACTION).
    """

    prompt_rows: Tensor
    group: Tensor
    vectors: Tensor
    prompt_ids: Tensor
    response_ids: Tensor
    response_mask: Tensor
    texts: list[str]
    explanations: list[str | None]
    status: Tensor
    rewards: Tensor | None = None  # [N] after scoring
    mse: Tensor | None = None  # [N] mse_nrm of scored samples; a failed one holds what it is charged
    predictions: Tensor | None = None  # [N, d] AR predictions (nan rows where extraction failed)
    degenerate: Tensor | None = None  # [N] bool: flagged by reward.format_checks (after scoring)

    @property
    def n(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def lengths(self) -> Tensor:
        return self.response_mask.sum(1)

    @property
    def ok(self) -> Tensor:
        """[N] bool: samples whose explanation was extracted (scored by the AR, used to train it)."""
        return self.status == COMPLETED

    def statuses(self) -> list[Status]:
        """[N] the status of each sample, as the one status type."""
        return [Status.from_code(c) for c in self.status.tolist()]

    def prompts_at(self, idx: Tensor) -> Tensor:
        """The prompt ids of the samples ``idx``: the one prompt [P], or their rows of [N, P]."""
        return self.prompt_ids if self.prompt_ids.dim() == 1 else self.prompt_ids[idx]

    def select(self, keep: Tensor) -> Rollout:
        """The samples where ``keep`` [N] is true (groups stay contiguous if whole groups are kept)."""
        idx = keep.nonzero(as_tuple=True)[0]
        pick = idx.tolist()
        return Rollout(
            prompt_rows=self.prompt_rows[idx], group=self.group[idx], vectors=self.vectors[idx],
            prompt_ids=self.prompts_at(idx), response_ids=self.response_ids[idx], response_mask=self.response_mask[idx],
            texts=[self.texts[i] for i in pick], explanations=[self.explanations[i] for i in pick],
            status=self.status[idx],
            rewards=None if self.rewards is None else self.rewards[idx],
            mse=None if self.mse is None else self.mse[idx],
            predictions=None if self.predictions is None else self.predictions[idx],
            degenerate=None if self.degenerate is None else self.degenerate[idx],
        )

    @staticmethod
    def concat(parts: list[Rollout], pad_id: int) -> Rollout:
        """Join rollouts (responses re-padded to the longest); group ids are renumbered."""
        L = max(p.response_ids.shape[1] for p in parts)

        def pad(t: Tensor, value: int) -> Tensor:
            return torch.nn.functional.pad(t, (0, L - t.shape[1]), value=value)

        groups, offset = [], 0
        for p in parts:
            g = p.group - p.group.min() if p.n else p.group
            groups.append(g + offset)
            offset += int(g.max()) + 1 if p.n else 0

        def cat_opt(name: str) -> Tensor | None:
            vals = [getattr(p, name) for p in parts]
            return None if any(v is None for v in vals) else torch.cat(vals)

        return Rollout(
            prompt_rows=torch.cat([p.prompt_rows for p in parts]), group=torch.cat(groups),
            vectors=torch.cat([p.vectors for p in parts]), prompt_ids=_cat_prompts(parts),
            response_ids=torch.cat([pad(p.response_ids, pad_id) for p in parts]),
            response_mask=torch.cat([pad(p.response_mask, 0) for p in parts]),
            texts=[t for p in parts for t in p.texts], explanations=[e for p in parts for e in p.explanations],
            status=torch.cat([p.status for p in parts]), rewards=cat_opt("rewards"), mse=cat_opt("mse"),
            predictions=cat_opt("predictions"), degenerate=cat_opt("degenerate"),
        )


def prompt_batch(prompt_ids: Tensor, n: int, rows: Tensor | None = None) -> Tensor:
    """[n, P] the prompts of ``n`` rows: the one canonical prompt [P] repeated (a view), or the rows
    ``rows`` (an index or a mask; all when None) of a prompt per row [M, P]."""
    if prompt_ids.dim() == 1:
        return prompt_ids.expand(n, prompt_ids.shape[0])
    return prompt_ids if rows is None else prompt_ids[rows]


def _cat_prompts(parts: list[Rollout]) -> Tensor:
    if all(p.prompt_ids.dim() == 1 for p in parts):
        return parts[0].prompt_ids
    return torch.cat([prompt_batch(p.prompt_ids, p.n) for p in parts])
