"""The rollout role: samples explanations from the current AV weights.

``generate(vectors, prompt_rows, n_samples, ...) -> Rollout`` and ``sync_weights(policy)``. The
local backend shares the policy module (a sync is free). On the Ray backend every policy rank
hosts its own unsharded copy, generates its share of the prompts (``nla.rl.distributed.DISPATCH``)
and syncs it from the policy's shards (``DataParallel.copy_full_weights``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from nla.core.injection import InjectionHook
from nla.core.reward import Status
from nla.core.sidecar import NLAConfig
from nla.core.token_ids import canonical_av_prompt_ids
from nla.rl.distributed import DataParallel
from nla.rl.sampling import sample_responses
from nla.rl.types import Rollout

if TYPE_CHECKING:
    from nla.rl.roles.policy import PolicyWorker

__all__ = ["RolloutWorker", "parse_responses"]


def parse_responses(tokenizer: Any, response_ids: Tensor, eos_id: int) -> tuple[Tensor, list[str], Tensor]:
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


class RolloutWorker:
    """Samples explanations from the current AV weights (the local backend shares the policy module)."""

    def __init__(self, model: nn.Module, tokenizer: Any, sidecar: NLAConfig, device: torch.device,
                 dp: DataParallel | None = None, decode: str = "eager") -> None:
        self.model, self.tokenizer, self.sidecar, self.device = model, tokenizer, sidecar, device
        self.decode = decode  # nla.rl.sampling.DECODES
        self.dp = dp if dp is not None else DataParallel()
        self.hook = InjectionHook.from_config(model, sidecar)
        self.block_prompts: dict[int, Tensor] | None = None
        if sidecar.layers is None:
            self.prompt_ids = torch.tensor(canonical_av_prompt_ids(tokenizer, sidecar.av_messages()), dtype=torch.long)
        else:  # a pair of several blocks: each block's prompt names it
            self.block_prompts = {k: torch.tensor(canonical_av_prompt_ids(tokenizer, sidecar.av_messages(layer=k)),
                                                  dtype=torch.long) for k in sidecar.layers}
            lengths = {k: len(p) for k, p in self.block_prompts.items()}
            if len(set(lengths.values())) > 1:
                raise ValueError(
                    f"av_template: the prompts of blocks {list(lengths)} tokenize to {list(lengths.values())} tokens; "
                    "a rollout batch holds prompts of one length, so name the blocks in words or numbers this "
                    "tokenizer splits alike (e.g. zero-padded: 03 and 10 where digits are single tokens)")
            self.prompt_ids = self.block_prompts[sidecar.layers[0]]
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def prompts_for(self, blocks: Tensor | None, n: int) -> Tensor:
        """The prompt ids for ``n`` vectors: the one prompt [P], or [n, P] with each vector's block named
        (``blocks`` [n]; each checked against the blocks the pair reads)."""
        if self.block_prompts is None:
            if blocks is not None:
                for k in blocks.unique().tolist():
                    self.sidecar.check_layer(int(k), "the rollout")
            return self.prompt_ids
        if blocks is None or len(blocks) != n:
            raise ValueError(f"the rollout: a pair of several blocks ({list(self.block_prompts)}) needs a block for each "
                             f"of the {n} vectors; found {None if blocks is None else len(blocks)}")
        for k in blocks.unique().tolist():
            self.sidecar.check_layer(int(k), "the rollout")
        if not n:
            return self.prompt_ids.new_zeros((0, len(self.prompt_ids)))
        return torch.stack([self.block_prompts[int(k)] for k in blocks.tolist()])

    def sync_weights(self, policy: PolicyWorker) -> None:
        """Make the next rollout use the policy's weights: a shared module needs nothing; a copy gets
        the policy's full weights (from its shards, collective, on every rank of the group)."""
        self.dp.copy_full_weights(policy.model, self.model)

    @torch.no_grad()
    def generate(self, vectors: Tensor, prompt_rows: Tensor, n_samples: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 share: tuple[int, int] | None = None, blocks: Tensor | None = None) -> Rollout:
        """``n_samples`` responses per vector [B, d] -> a Rollout of N = B * n_samples (groups contiguous).

        Split over ranks, ``vectors`` are this rank's share of the prompts, ``share`` = (index of
        its first prompt, prompts of the whole batch), and every rank calls with the same RNG
        state: the ranks' rollouts joined in rank order are the rollout of the whole batch
        (``nla.rl.sampling``, item 5). ``blocks``: [B] the block of each vector, for a pair of several
        blocks (its prompts name the block); None for a pair of one."""
        B = vectors.shape[0]
        prompts = self.prompts_for(blocks, B)
        vec = vectors.repeat_interleave(n_samples, 0)
        rows = prompt_rows.repeat_interleave(n_samples, 0)
        N = vec.shape[0]
        was_training = self.model.training
        self.model.eval()
        try:
            # Finished rows leave the batch; greedy gives HF generate's tokens (nla.rl.sampling).
            resp = sample_responses(
                self.model, self.hook, prompts, vectors, n_samples, max_new_tokens, self.eos_id,
                self.pad_id, temperature=temperature, top_p=top_p, greedy=greedy,
                # The AV must never write the marker: a second site in prompt+response would
                # shift the injection in the log-prob forward (and it is the failure smell).
                suppress_ids=[self.sidecar.injection_token_id], share=share, decode=self.decode,
            ).cpu()
        finally:
            self.model.train(was_training)
        mask, texts, truncated = parse_responses(self.tokenizer, resp, self.eos_id)
        resp = torch.where(mask.bool(), resp, torch.full_like(resp, self.pad_id))
        parsed = [Status.of(text, bool(cut)) for text, cut in zip(texts, truncated.tolist(), strict=True)]
        explanations = [exp for _, exp in parsed]
        status = torch.tensor([st.code for st, _ in parsed], dtype=torch.long).reshape(N)
        return Rollout(
            prompt_rows=rows.cpu(), group=torch.arange(B).repeat_interleave(n_samples), vectors=vec.float().cpu(),
            prompt_ids=prompts if prompts.dim() == 1 else prompts.repeat_interleave(n_samples, 0), response_ids=resp,
            response_mask=mask, texts=texts,
            explanations=explanations, status=status,
        )

