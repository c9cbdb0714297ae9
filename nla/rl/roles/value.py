"""The value role (PPO only): a scalar value model on the AV's body, trained on GAE returns, on any backend."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from nla.core import arch
from nla.core.injection import InjectionHook, get_adapter
from nla.core.sidecar import NLAConfig
from nla.rl import algorithms as A
from nla.rl.distributed import DataParallel
from nla.rl.kernels import rank_micro_batches
from nla.rl.roles.trainable import LOCAL, OptimSettings, Trainable
from nla.rl.types import Rollout, prompt_batch

__all__ = ["ValueModel", "ValueWorker"]


class ValueModel(nn.Module):
    """PPO's scalar value model: the AV's transformer body + ``Linear(d, 1)`` (zero-initialised)."""

    def __init__(self, policy_model: nn.Module) -> None:
        super().__init__()
        self.body = copy.deepcopy(arch.base_model(policy_model))
        adapter = get_adapter(policy_model)  # a cross-model AV's injection map, trained with the values
        self.adapter = copy.deepcopy(adapter) if adapter is not None else None
        d = arch.hidden_size(self.body.config)
        self.head = nn.Linear(d, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1)


class ValueWorker(Trainable):
    """Values [N, L] for the states before each response token (the vector is injected too).

    ``model`` is the role's ``ValueModel``, already sharded by ``dp`` where there is more than
    one rank (``nla.rl.setup.build_policy_roles`` builds it from the unsharded policy, then
    shards it); each rank computes the values of its rows and updates on them, as the policy does.
    """

    def __init__(self, model: ValueModel, sidecar: NLAConfig, optim: OptimSettings, micro_batch_size: int,
                 clip_eps: float | None, dp: DataParallel = LOCAL) -> None:
        self.model = model
        self.hook = InjectionHook(self.model.body, sidecar.injection_token_id, sidecar.injection_left_neighbor_id,
                                  sidecar.injection_right_neighbor_id, sidecar.injection_scale_value(),
                                  adapter=self.model.adapter)
        self.micro_batch_size, self.clip_eps = micro_batch_size, clip_eps
        self._setup_optim(self.model, optim, dp)

    def _values(self, rollout: Rollout, idx: Tensor) -> Tensor:
        P, L = rollout.prompt_ids.shape[-1], rollout.response_ids.shape[1]
        n = len(idx)
        device = next(self.model.parameters()).device
        ids = torch.cat([prompt_batch(rollout.prompts_at(idx).to(device), n), rollout.response_ids[idx].to(device)], 1)
        attn = torch.cat([torch.ones(n, P, dtype=torch.long, device=device),
                          rollout.response_mask[idx].to(device).long()], 1)
        with self.hook.vectors(rollout.vectors[idx].to(device)):
            v = self.model(ids, attn)
        return v[:, P - 1 : P + L - 1]

    def save_model(self, path: str | Path) -> None:
        """The full value model's state dict (``torch.save``), written by the answering rank."""
        state = self.dp.full_state_dict(self.model)
        if self.dp.answers:
            torch.save(self.model.state_dict() if state is None else state, path)

    def load_model(self, path: str | Path) -> None:
        from nla.train.checkpoint import load_state_file

        self.dp.load_full_state_dict(self.model, load_state_file(Path(path), "value model"))

    @torch.no_grad()
    def values(self, rollout: Rollout) -> Tensor:
        """Values [n_r, L] of this rank's rows (every row locally), in row order."""
        self.model.eval()
        mine = self.dp.my_rows(torch.arange(rollout.n))
        out = [torch.zeros(0, rollout.response_ids.shape[1])]
        for idx, real in rank_micro_batches(self.dp, mine, rollout.n, self.micro_batch_size):
            v = self._values(rollout, idx).cpu()  # a dummy micro-batch runs too: FSDP forwards are collective
            if real:
                out.append(v)
        return torch.cat(out)

    def update(self, rollout: Rollout, old_values: Tensor, returns: Tensor) -> dict[str, float]:
        """One value step on GAE returns: each rank its rows, each micro-batch weighted by its
        share of the batch's response tokens (times W: FSDP averages gradients over ranks)."""
        dp = self.dp
        self.model.train()
        mask = rollout.response_mask.float()
        agg = A.get_loss_agg("token-mean")
        sums: dict[str, float] = {}
        mine = dp.my_rows(torch.arange(rollout.n))
        for idx, real in rank_micro_batches(dp, mine, rollout.n, self.micro_batch_size):
            v = self._values(rollout, idx)
            m = mask[idx].to(v.device)
            loss, vm = A.value_loss(v, old_values[idx].to(v.device), returns[idx].to(v.device), m,
                                    clip_eps=self.clip_eps, agg=agg.name)
            w = agg.micro_batch_weight(mask[idx], mask) if real else 0.0
            (loss * (w * dp.grad_scale)).backward()
            if real:
                sums["value_loss"] = sums.get("value_loss", 0.0) + float(loss.detach()) * w
                for k, val in vm.items():
                    sums[f"value_{k}"] = sums.get(f"value_{k}", 0.0) + float(val) * w
        total = dp.sum(sums)
        total.update({f"value_{k}": v for k, v in self._step().items()})
        return total
