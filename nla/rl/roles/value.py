"""The value role (PPO only): a scalar value model on the AV's body, trained on GAE returns."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from nla import arch
from nla.injection import InjectionHook
from nla.rl import algorithms as A
from nla.rl.kernels import rank_micro_batches
from nla.rl.roles.trainable import LOCAL, OptimSettings, Trainable
from nla.rl.types import Rollout
from nla.sidecar import NLAConfig

__all__ = ["ValueModel", "ValueWorker"]


class ValueModel(nn.Module):
    """PPO's scalar value model: the AV's transformer body + ``Linear(d, 1)`` (zero-initialised)."""

    def __init__(self, policy_model: nn.Module) -> None:
        super().__init__()
        self.body = copy.deepcopy(arch.base_model(policy_model))
        d = arch.hidden_size(self.body.config)
        self.head = nn.Linear(d, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1)


class ValueWorker(Trainable):
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
        from nla.train.common import load_state_file

        self.model.load_state_dict(load_state_file(path, "value model"))

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

