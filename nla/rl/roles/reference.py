"""The reference role: the frozen warm-started AV, whose log-probs the KL term reads."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nla.injection import InjectionHook
from nla.rl.distributed import DataParallel
from nla.rl.kernels import rollout_logprobs
from nla.rl.roles.trainable import LOCAL
from nla.rl.types import Rollout
from nla.sidecar import NLAConfig

__all__ = ["ReferenceWorker"]


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

