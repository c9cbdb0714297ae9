"""The reward's definition: explanation extraction, the failure charge, MSE -> reward.

The RL reward of a sample is ``-mse_nrm(AR(explanation), gold, scale)``
(docs/design.md §4 step 2), or ``-log(mse_nrm)`` under the log variant
(``reward_from_mse``). A sample whose explanation cannot be extracted
(missing/malformed tags, or a truncated response, which the caller knows
about) costs the MSE of an *orthogonal* prediction at the AR's own ``mse_scale``
(:func:`failed_mse`): ``2 s^2 / d`` at scale ``s`` (``FAILED_EXTRACTION_MSE`` = 2.0
at ``s = sqrt(d)``), never computed from the gold at a fixed scale, so a zero (or
overflowing) gold cannot turn a failure into a perfect score, and a failure is never
better than a useless answer nor worse than an anti-correlated one at any scale. RL,
evaluation and the client charge it the same way: :func:`charge_failures` is the one
definition, :func:`make_rewards` the one place a reward is made from MSEs.

RL's own settings and the batched scoring service live in ``nla.rl.reward``; this module is
what every caller (RL, evaluation, the client, the suite) shares.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from nla.core.graders import available_graders, get_grader
from nla.core.vectors import mse_nrm

__all__ = [
    "Status",
    "FAILED_EXTRACTION_MSE",
    "FAILED_EXTRACTION_REWARD",
    "FAILED_EXTRACTION_REWARD_LOG",
    "LOG_MSE_FLOOR",
    "OPEN_TAG",
    "CLOSE_TAG",
    "failed_mse",
    "charge_failures",
    "make_rewards",
    "extract_explanation",
    "failed_extraction_reward",
    "format_flags",
    "mse_to_reward",
    "reward_from_mse",
]


# What a sample without a usable explanation counts as: the mse_nrm of an orthogonal
# prediction (2 at scale sqrt(d)), whatever its gold; and its reward under each variant.
FAILED_EXTRACTION_MSE = 2.0
FAILED_EXTRACTION_REWARD = -FAILED_EXTRACTION_MSE
FAILED_EXTRACTION_REWARD_LOG = -math.log(FAILED_EXTRACTION_MSE)

# Floor on mse_nrm before the log so a perfect prediction gives a finite
# reward (-log 1e-6 ~ 13.8) instead of +inf. A floor (not ``+ eps``) keeps the
# orthogonal reward exactly -log 2, equal to FAILED_EXTRACTION_REWARD_LOG.
LOG_MSE_FLOOR = 1e-6

OPEN_TAG = "<explanation>"
CLOSE_TAG = "</explanation>"


def failed_mse(gold: Tensor, scale: float | None) -> Tensor:
    """MSE [B] charged to samples without a prediction: that of an orthogonal prediction of equal norm.

    gold: [B, d]. ``mean_d((p - g)^2) = (|p|^2 + |g|^2) / d = 2 s^2 / d`` for ``p ⟂ g`` with both
    normalised to ``s = scale``: a constant (``FAILED_EXTRACTION_MSE`` = 2.0 at ``s = sqrt(d)``) that never
    reads the gold. Raw comparison (``scale`` None) has no fixed norm: ``2 |g|^2 / d``, computed
    in float64 so large entries do not overflow.
    """
    b, d = gold.shape[0], gold.shape[-1]
    if scale is not None:
        return torch.full((b,), 2.0 * float(scale) ** 2 / d, dtype=torch.float32)
    return (2.0 * gold.double().pow(2).mean(dim=-1)).float()


def charge_failures(mse: Tensor, failed: Tensor, failed_cost: Tensor | float) -> Tensor:
    """[N] fp32: ``mse`` with every ``failed`` sample charged ``failed_cost`` (whatever ``mse``
    holds there, NaN included). failed_cost: [N] or a scalar, normally ``failed_mse(gold, scale)``
    at the AR's scale. The one definition behind RL rewards, RL's logged ``mse_nrm`` / ``fve_nrm``
    and ``nla eval``'s FVE."""
    cost = torch.as_tensor(failed_cost, dtype=torch.float32).expand(mse.shape)
    return torch.where(failed.bool(), cost, mse.float())


def make_rewards(mse: Tensor, failed: Tensor, failed_cost: Tensor | float, *, log_mse: bool = False,
                 shaping: Tensor | None = None, degenerate: Tensor | None = None,
                 format_penalty: float = 0.0) -> Tensor:
    """Rewards [N] (fp32) from the AR's ``mse_nrm`` [N]: the one place a reward is made.

    1. failed samples (``failed`` [N] bool) are charged ``failed_cost`` (:func:`charge_failures`);
    2. reward ``-mse`` or, with ``log_mse``, ``-log(max(mse, LOG_MSE_FLOOR))`` (``reward_from_mse``);
    3. ``shaping`` [N] is added (DAPO's soft overlong punishment, computed by the caller);
    4. a completed explanation flagged ``degenerate`` loses ``format_penalty``.
    """
    rewards = reward_from_mse(charge_failures(mse, failed, failed_cost), log_mse)
    if shaping is not None:
        rewards = rewards + shaping
    if degenerate is not None and format_penalty > 0:
        rewards = rewards - format_penalty * (degenerate.bool() & ~failed.bool()).float()
    return rewards


class Status(str, enum.Enum):
    """What became of one AV sample: the one status type of the rollout, the client and the reports.

    A ``str`` enum, so it compares, prints and serialises as its name (``"completed"``), while
    ``code`` is the small integer a rollout stores per sample in a tensor (``Rollout.status``).
    """

    COMPLETED = "completed"  # the explanation was extracted
    TRUNCATED = "truncated"  # no EOS within the generation cap
    FAILED = "failed"  # ended, but the explanation tags could not be parsed

    def __str__(self) -> str:
        return self.value

    @property
    def code(self) -> int:
        return _STATUS_CODES[self]

    @classmethod
    def from_code(cls, code: int) -> Status:
        try:
            return _STATUS_BY_CODE[int(code)]
        except KeyError:
            raise ValueError(f"status code: expected one of {sorted(_STATUS_BY_CODE)}, found {code}") from None

    @classmethod
    def of(cls, text: str, truncated: bool) -> tuple[Status, str | None]:
        """(status, explanation) of a decoded response: a truncated one is never parsed (its tags
        may be cut), an ended one is ``COMPLETED`` exactly when ``extract_explanation`` finds one."""
        if truncated:
            return cls.TRUNCATED, None
        exp = extract_explanation(text)
        return (cls.FAILED, None) if exp is None else (cls.COMPLETED, exp)


_STATUS_CODES = {Status.COMPLETED: 0, Status.TRUNCATED: 1, Status.FAILED: 2}
_STATUS_BY_CODE = {c: s for s, c in _STATUS_CODES.items()}


def failed_extraction_reward(log_mse: bool) -> float:
    """Reward for a sample with no usable explanation: -2.0, or -log 2 when ``log_mse``."""
    return FAILED_EXTRACTION_REWARD_LOG if log_mse else FAILED_EXTRACTION_REWARD


def extract_explanation(text: str) -> str | None:
    """The stripped text between the first ``<explanation>`` and the next ``</explanation>``.

    Rules (strict, case-sensitive tags):
    1. The first ``<explanation>`` opens; the first ``</explanation>`` after it
       closes. Text before the opening tag and after the closing tag is
       ignored (a later second pair is ignored too).
    2. None when either tag is missing (e.g. a truncated response).
    3. None when a ``</explanation>`` appears before the first opening tag, or
       a second ``<explanation>`` appears before the closing tag (malformed
       or nested: we cannot tell which span was meant).
    4. None when the content is empty after stripping whitespace.
    """
    start = text.find(OPEN_TAG)
    if start < 0:
        return None
    if CLOSE_TAG in text[:start]:
        return None
    body_start = start + len(OPEN_TAG)
    end = text.find(CLOSE_TAG, body_start)
    if end < 0:
        return None
    body = text[body_start:end]
    if OPEN_TAG in body:
        return None
    body = body.strip()
    return body or None


def mse_to_reward(pred: Tensor, gold: Tensor, scale: float | None, log_mse: bool = False) -> Tensor:
    """Reward per row from AR predictions. pred, gold: [B, d] -> [B] (fp32).

    ``-mse_nrm(pred, gold, scale)`` (0 perfect, -2 orthogonal at ``scale =
    sqrt(d)``), or with ``log_mse`` ``-log(max(mse_nrm, LOG_MSE_FLOOR))``
    (-log 2 orthogonal, about 13.8 perfect). Failed extractions use
    ``failed_extraction_reward(log_mse)``, the orthogonal value of the same
    variant.
    """
    return reward_from_mse(mse_nrm(pred, gold, scale), log_mse)


def reward_from_mse(mse: Tensor, log_mse: bool = False) -> Tensor:
    """Reward [B] from ``mse_nrm`` values [B]: ``-mse``, or ``-log(max(mse, LOG_MSE_FLOOR))``."""
    if log_mse:
        return -torch.log(mse.clamp_min(LOG_MSE_FLOOR))
    return -mse


# ------------------------------------------------------------------ format checks
def format_flags(explanations: Sequence[str | None], checks: str) -> Tensor:
    """[N] bool: which explanations the format checks of grader ``checks`` (``nla.core.graders``:
    ``generic``, ``world`` or a registered one) flag as degenerate (None: not flagged; a failed
    extraction is charged on its own). The checks read the text only, never ground truth."""
    if checks not in available_graders():
        raise ValueError(f"format_checks: expected one of {available_graders()}, found {checks!r}")
    grader = get_grader(checks)
    return torch.tensor([bool(e) and grader.degenerate(e) for e in explanations], dtype=torch.bool)
