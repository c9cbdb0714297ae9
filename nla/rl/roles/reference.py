"""The reference role: the frozen warm-started AV, whose log-probs the KL term reads."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nla.core.injection import InjectionHook
from nla.core.sidecar import NLAConfig
from nla.rl.distributed import DataParallel
from nla.rl.kernels import rollout_logprobs
from nla.rl.roles.trainable import LOCAL
from nla.rl.types import Rollout

__all__ = ["ReferenceWorker"]


class ReferenceWorker:
    """The frozen warm-started AV: log-probs for the KL term.

    ``adapters_off``: ``model`` is the LoRA policy itself, and the reference is its base with
    the adapters off (``nla.core.lora.adapters_off``): no second copy of the weights.
    """

    def __init__(self, model: nn.Module, sidecar: NLAConfig, micro_batch_size: int, dp: DataParallel = LOCAL,
                 adapters_off: bool = False) -> None:
        self.model = model if adapters_off else model.eval().requires_grad_(False)
        self.adapters_off = adapters_off
        self.hook = InjectionHook.from_config(model, sidecar)
        self.micro_batch_size, self.dp = micro_batch_size, dp

    def logprobs(self, rollout: Rollout) -> Tensor:
        """Reference log-probs [n_r, L] of this rank's rows (every row locally)."""
        mine = self.dp.my_rows(torch.arange(rollout.n))
        if not self.adapters_off:
            return rollout_logprobs(self.model, self.hook, rollout, mine, rollout.n, self.dp, self.micro_batch_size)
        from nla.core.lora import adapters_off

        was = self.model.training
        self.model.eval()
        try:
            with adapters_off(self.model):
                return rollout_logprobs(self.model, self.hook, rollout, mine, rollout.n, self.dp,
                                        self.micro_batch_size)
        finally:
            self.model.train(was)

