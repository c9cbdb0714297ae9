"""Loud warnings for a run that makes no progress while looking healthy.

A run can go to its last step with nothing learned: ``lr=1e6`` drives the AR into a dead
state where the loss sits at 1.0 and every gradient is exactly zero (finite, so no step is
"skipped"), or non-finite (every step skipped, counted but easy to miss). In RL, a policy that stops closing its explanation tag gets
the failure reward on every sample. :class:`StuckRunMonitor` watches the two signals:

1. the gradient norm is zero (below ``ZERO_GRAD_NORM``) or non-finite (the step is skipped)
   for ``patience`` steps in a row;
2. every sample of the rollout failed (``failure_rate == 1``) for ``patience`` steps in a row.

Each streak warns once, when it reaches ``patience``, at WARNING level with what to check;
the messages are kept in ``warnings`` so callers can put them in their summary and report.

A non-finite *loss* is not a streak to wait for: :func:`check_finite_loss` stops the run at
the first one (:class:`TrainingDivergedError`, naming the step and the setting to look at),
before that step is logged or saved, so every checkpoint on disk predates the divergence. A
non-finite *gradient* under a finite loss is still skipped and counted (docs/design.md §4).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

logger = logging.getLogger(__name__)

__all__ = ["ZERO_GRAD_NORM", "StuckRunMonitor", "TrainingDivergedError", "available_memory", "check_finite_loss",
           "check_micro_batch_memory", "micro_batch_lower_bound"]

ZERO_GRAD_NORM = 1e-12


class TrainingDivergedError(RuntimeError):
    """A training loss became NaN or infinite: the run stopped at that step."""


def check_finite_loss(name: str, step: int, figures: Mapping[str, float], setting: str,
                      last_checkpoint: object = None) -> None:
    """Raise :class:`TrainingDivergedError` when any of ``figures`` (the step's loss and its other
    training figures, e.g. the AR's ``pred_norm``) is not finite; the first one is named.

    name: the run ("ar", "av", "rl (AR update)"); step: the step that produced it; setting: what
    to look at, e.g. ``"lr=1e+06"``; last_checkpoint: the newest checkpoint on disk (None: none).
    """
    bad = [(k, v) for k, v in figures.items() if not math.isfinite(v)]
    if not bad:
        return
    key, value = bad[0]
    where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
    raise TrainingDivergedError(
        f"{name}: the training {key} is {value} at step {step}: the run diverged and was stopped ({where}); "
        f"lower {setting} (or max_grad_norm), then rerun with --overwrite"
    )


class StuckRunMonitor:
    """Count zero-gradient and all-failed streaks; warn once per streak of ``patience`` steps."""

    def __init__(self, name: str, patience: int = 10) -> None:
        if patience < 1:
            raise ValueError(f"patience: expected an integer >= 1, found {patience}")
        self.name, self.patience = name, patience
        self.warnings: list[str] = []
        self._zero_grad = 0
        self._all_failed = 0

    def observe(self, step: int, *, grad_norm: float | None = None, failure_rate: float | None = None) -> list[str]:
        """Record one step's signals (None = not measured); returns the warnings raised at this step."""
        new: list[str] = []
        if grad_norm is not None:
            dead = not math.isfinite(grad_norm) or abs(grad_norm) < ZERO_GRAD_NORM
            self._zero_grad = self._zero_grad + 1 if dead else 0
            if self._zero_grad == self.patience:
                new.append(
                    f"{self.name} looks stuck: the gradient norm has been zero or non-finite for {self.patience} steps "
                    f"in a row (step {step}, last {grad_norm}); the model no longer learns (lr far too high, or a "
                    "dead/collapsed output). "
                    "Check lr and the loss curve; the checkpoints after this point are not worth keeping"
                )
        if failure_rate is not None:
            self._all_failed = self._all_failed + 1 if failure_rate >= 1.0 else 0
            if self._all_failed == self.patience:
                new.append(
                    f"{self.name} looks stuck: every sample has failed for {self.patience} steps in a row (step {step}); "
                    "no explanation is extracted, so every reward is the failure value and the policy gets no "
                    "signal. Check max_response_len and the AV's outputs"
                )
        for message in new:
            logger.warning("!!! %s", message)
        self.warnings.extend(new)
        return new


# ------------------------------------------------------------------ memory before the first step
def available_memory(device: object) -> int | None:
    """Bytes a new allocation can use now: the GPU's free memory, or the kernel's MemAvailable
    for the CPU (None where neither can be read)."""
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def micro_batch_lower_bound(rows: int, max_length: int, hidden: int, layers: int, vocab: int | None,
                            dtype_bytes: int) -> int:
    """Bytes a training forward + backward of ``rows`` x ``max_length`` tokens cannot do without: the
    token ids and mask (int64), one hidden state per layer kept for the backward (and its
    gradient), and, with an LM head (``vocab``), the fp32 logits and their log-softmax. Attention
    scores, MLP intermediates and optimiser state come on top, so this only ever under-counts."""
    tokens = rows * max_length
    need = tokens * 16 + tokens * hidden * dtype_bytes * 2 * (layers + 1)
    if vocab:
        need += tokens * vocab * 4 * 2
    return need


def check_micro_batch_memory(name: str, model: object, rows: int, max_length: int, device: object,
                             setting: str = "micro_batch_size") -> None:
    """Refuse, before the first step, a micro-batch whose lower bound (``micro_batch_lower_bound``)
    is more than the memory available now: the kernel would kill the run with no message."""
    from nla.core import arch

    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    try:
        hidden, layers = arch.hidden_size(cfg), arch.num_layers(cfg)
    except (AttributeError, ValueError, TypeError):
        return
    head = getattr(model, "get_output_embeddings", lambda: None)()
    vocab = getattr(cfg, "vocab_size", None) if head is not None else None
    param = next(iter(model.parameters()), None)
    dtype_bytes = param.element_size() if param is not None else 4
    need = micro_batch_lower_bound(rows, max_length, hidden, layers, vocab, dtype_bytes)
    have = available_memory(device)
    if have is not None and need > have:
        raise ValueError(
            f"{name}: a micro-batch of {rows} rows x {max_length} tokens needs at least {need / 2**30:.1f} GiB "
            f"(ids, one hidden state per layer{', logits' if vocab else ''}) but {have / 2**30:.1f} GiB is available "
            f"on {device}; lower {setting} (gradients accumulate over micro-batches: batch_size can stay)"
        )
