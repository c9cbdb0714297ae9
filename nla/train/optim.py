"""Optimiser, LR schedule, micro-batching with gradient accumulation, and the non-finite guard.

Shared by the warm-start stages and the RL loop; nothing here knows about NLA models.

Departure from the usual recipe: a step whose gradient norm is non-finite is skipped (no
optimiser update, gradients dropped) but the LR schedule still advances, so the schedule stays
a function of the global step and a resumed run lines up with an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- optimiser & schedule
# How torch's AdamW runs (``build_optimizer(impl=...)``, the runs' ``adamw`` setting): its keyword arguments.
ADAMW_IMPLS: dict[str, dict[str, Any]] = {"default": {}, "fused": {"fused": True}}


def build_optimizer(
    params: Iterable[nn.Parameter] | nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    lr_scales: dict[str, float] | None = None,
    impl: str = "default",
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (``requires_grad``) of ``params``.

    impl: how torch runs the update (``ADAMW_IMPLS``). ``default`` is torch's own choice for the
        device (a per-parameter loop on a CPU, the multi-tensor path on a GPU); ``fused`` is one
        kernel per group (transformers' and TRL's default), 3-5x faster on a CPU step of the
        models nla trains (BENCHMARKS, "AdamW on the CPU"), and differs from the loop in the last
        bits, so a run's numbers are its own.

    lr_scales: (``params`` a module) ``{submodule name: factor}``: that submodule's parameters
        form their own group at ``lr * factor`` (the schedule scales every group alike); the
        rest stay in the first group, at ``lr``."""
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"build_optimizer: lr must be a positive finite number, found {lr!r}")
    if impl not in ADAMW_IMPLS:
        raise ValueError(f"build_optimizer: impl must be one of {list(ADAMW_IMPLS)}, found {impl!r}")
    scales = {k: v for k, v in (lr_scales or {}).items() if v != 1.0}
    if scales and not isinstance(params, nn.Module):
        raise ValueError("build_optimizer: lr_scales names submodules, so params must be a module")
    if isinstance(params, nn.Module):
        named = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    else:
        named = [("", p) for p in params if p.requires_grad]
    if not named:
        raise ValueError("build_optimizer: no trainable parameters (all have requires_grad=False)")
    for name, factor in scales.items():
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"build_optimizer: lr_scales[{name!r}] must be a positive finite number, found {factor!r}")
    groups: list[dict[str, Any]] = [{"params": []}]
    extra = {name: {"params": [], "lr": lr * factor} for name, factor in scales.items()}
    for n, p in named:
        owner = next((name for name in extra if n == name or n.startswith(name + ".")), None)
        (groups[0] if owner is None else extra[owner])["params"].append(p)
    for name, group in extra.items():
        if not group["params"]:
            raise ValueError(f"build_optimizer: lr_scales names {name!r}, which holds no trainable parameter")
    groups += list(extra.values())
    if not groups[0]["params"]:
        groups.pop(0)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=tuple(betas), **ADAMW_IMPLS[impl])


def warmup_cosine(
    opt: torch.optim.Optimizer, warmup: int, total: int, min_lr_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr`` at ``total``."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    if total <= 0 or warmup < 0 or warmup > total:
        raise ValueError(f"warmup_cosine: need 0 <= warmup <= total and total > 0, found warmup={warmup}, total={total}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"warmup_cosine: min_lr_ratio must be in [0, 1], found {min_lr_ratio}")
    return get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=min_lr_ratio
    )


def sqrt_lr(batch: int, base_lr: float = 2e-5, base_batch: int = 256) -> float:
    """LR scaled with the square root of the batch: ``base_lr * sqrt(batch / base_batch)`` (docs/design.md §7)."""
    if batch <= 0 or base_batch <= 0:
        raise ValueError(f"sqrt_lr: batch sizes must be positive, found batch={batch}, base_batch={base_batch}")
    return base_lr * math.sqrt(batch / base_batch)


def warn_if_lr_far(lr: float, batch: int, base_lr: float = 2e-5, base_batch: int = 256, factor: float = 2.0) -> bool:
    """Warn (and return True) when ``lr`` is more than ``factor`` x away from :func:`sqrt_lr`.

    Only a hint: tiny models train well at much larger LRs than the published 7B recipe.
    """
    ref = sqrt_lr(batch, base_lr, base_batch)
    far = lr > factor * ref or lr < ref / factor
    if far:
        logger.warning(
            "lr=%.3g is more than %gx away from the sqrt-scaled reference %.3g for batch %d "
            "(%.1e at batch %d); fine for tiny models, check it for real ones",
            lr, factor, ref, batch, base_lr, base_batch,
        )
    return far


# ---------------------------------------------------------------- micro-batching
def micro_batches(n_rows: int, micro_batch_size: int) -> list[tuple[slice, float]]:
    """Split ``n_rows`` into micro-batch slices with their loss weights.

    Each weight is ``rows_in_micro / n_rows``: summing ``weight * mean_loss(micro)`` over the
    micro-batches equals the mean loss of the whole batch, so an accumulated 4 x 2 step
    gives the gradient of one batch of 8.
    """
    if n_rows <= 0 or micro_batch_size <= 0:
        raise ValueError(f"micro_batches: need positive sizes, found n_rows={n_rows}, micro={micro_batch_size}")
    out = []
    for start in range(0, n_rows, micro_batch_size):
        stop = min(start + micro_batch_size, n_rows)
        out.append((slice(start, stop), (stop - start) / n_rows))
    return out


def optimizer_step_guarded(
    model: nn.Module | Iterable[nn.Parameter],
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    max_grad_norm: float | None,
) -> tuple[bool, float]:
    """Clip, then step unless the gradient is non-finite.  Returns ``(stepped, grad_norm)``.

    ``max_grad_norm`` None or <= 0 disables clipping (the norm is still measured). A skipped
    step drops the gradients; the scheduler advances either way (see module docstring).
    The caller counts skipped steps (``stepped == False``).
    """
    params = list(model.parameters()) if isinstance(model, nn.Module) else list(model)
    params = [p for p in params if p.grad is not None]
    clip = max_grad_norm if (max_grad_norm is not None and max_grad_norm > 0) else float("inf")
    if params:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        # FSDP2 gradients are DTensors: the norm is a sharded DTensor; its full value is the
        # global norm, the same on every rank.
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    else:
        grad_norm = 0.0
    stepped = math.isfinite(grad_norm)
    if stepped:
        opt.step()
    else:
        logger.warning("non-finite gradient norm (%s): optimizer step skipped", grad_norm)
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        with warnings.catch_warnings():
            # torch warns when the scheduler steps without an optimiser step; here that is intended.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
            sched.step()
    return stepped, grad_norm
