"""What every trained role shares: its optimiser settings and the optimiser it holds.

``OptimSettings`` is read from the RL config once per role; ``Trainable`` holds the AdamW
optimiser, the schedule, the guarded step (a non-finite gradient skips the step) and the
optimiser state a checkpoint saves, in the format of the role's ``DataParallel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from nla.rl.config import RLConfig
from nla.rl.distributed import DataParallel
from nla.train.optim import build_optimizer, optimizer_step_guarded, warmup_cosine

__all__ = ["LOCAL", "OptimSettings", "Trainable"]

# The data parallelism of a local role: one rank owning every row.
LOCAL = DataParallel()


@dataclass(frozen=True)
class OptimSettings:
    """One trained role's optimiser and schedule (AdamW, warmup then constant LR)."""

    lr: float
    weight_decay: float
    warmup_steps: int
    total_steps: int
    max_grad_norm: float
    impl: str = "default"  # how torch runs AdamW (nla.train.optim.ADAMW_IMPLS; the run's ``adamw``)

    @classmethod
    def _of(cls, cfg: RLConfig, lr: float, total_steps: int) -> OptimSettings:
        o = cfg.optimiser
        return cls(lr, o.weight_decay, o.warmup_steps, total_steps, o.max_grad_norm, cfg.adamw)

    @classmethod
    def for_policy(cls, cfg: RLConfig) -> OptimSettings:
        return cls._of(cfg, cfg.optimiser.lr, cfg.steps * cfg.updates_per_rollout)

    @classmethod
    def for_reconstructor(cls, cfg: RLConfig) -> OptimSettings:
        return cls._of(cfg, cfg.ar_lr_value, cfg.steps)

    @classmethod
    def for_value(cls, cfg: RLConfig) -> OptimSettings:
        return cls._of(cfg, cfg.optimiser.value_lr_value, cfg.steps)



class Trainable:
    """Optimiser + schedule + guarded step + optimiser state, shared by the trained roles."""

    def _setup_optim(self, module: nn.Module, optim: OptimSettings, dp: DataParallel) -> None:
        self._module, self.dp = module, dp
        self.opt = build_optimizer(module, optim.lr, optim.weight_decay, impl=optim.impl)
        total = optim.total_steps
        self.sched = warmup_cosine(self.opt, optim.warmup_steps, total, min_lr_ratio=1.0) if total > 0 else None
        self.max_grad_norm = optim.max_grad_norm
        self.skipped_steps = 0

    def _step(self) -> dict[str, float]:
        """Clip and step (the norm is global on sharded gradients); a non-finite gradient skips the step."""
        lr = self.opt.param_groups[0]["lr"]
        self.dp.reduce_gradients(self._module)  # replicated ranks: one all-reduce of the accumulated gradients
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

