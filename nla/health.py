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
non-finite *gradient* under a finite loss is still skipped and counted (DESIGN §4).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

logger = logging.getLogger(__name__)

__all__ = ["ZERO_GRAD_NORM", "StuckRunMonitor", "TrainingDivergedError", "check_finite_loss"]

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
