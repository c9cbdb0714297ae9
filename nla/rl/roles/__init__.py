"""The roles of the RL step, one file each, written once for every backend.

The controller (``nla.rl.loop``) talks to five roles through these methods only:

| role | file | methods |
|---|---|---|
| rollout | ``rollout.py`` | ``generate(vectors, prompt_rows, n_samples, ...) -> Rollout``, ``sync_weights(policy)`` |
| policy (the AV, trained) | ``policy.py`` | ``update(rollout, advantages, ref_logp) -> metrics`` |
| reference (the frozen warm-started AV) | ``reference.py`` | ``logprobs(rollout) -> [N, L]`` |
| reconstructor (live weights) | ``reconstructor.py`` | ``mse_batch(items) -> mse_nrm``, ``update(...)`` |
| value (PPO only) | ``value.py`` | ``values(rollout)``, ``update(...)`` |

Below them: ``nla.rl.kernels`` (the log-prob kernels and KV-cache handling the AV roles
share), ``nla.rl.algorithms`` (the loss math, pure tensor functions) and ``trainable.py``
(optimiser settings and state). What data parallelism adds (which rows a rank takes,
cross-rank sums, which rank answers, gathered state dicts) comes from each role's
``DataParallel`` (``nla.rl.distributed``): the local backend passes one rank that owns every
row, the Ray backend one ``RankGroup`` per actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nla.core.sidecar import NLAConfig
from nla.rl.roles.policy import PolicyLossSettings, PolicyWorker, policy_micro_loss, update_batches
from nla.rl.roles.reconstructor import (
    REWARD_SUB_BATCH,
    FusedRewardWindow,
    PlainScoring,
    ReconstructorWorker,
    RewardWindow,
    default_window,
    has_dropout,
)
from nla.rl.roles.reference import ReferenceWorker
from nla.rl.roles.rollout import RolloutWorker, parse_responses
from nla.rl.roles.trainable import LOCAL, OptimSettings, Trainable
from nla.rl.roles.value import ValueModel, ValueWorker


@dataclass
class WorkerGroups:
    """The roles one controller drives. ``value`` is None unless the estimator needs values."""

    rollout: RolloutWorker
    policy: PolicyWorker
    reference: ReferenceWorker
    reconstructor: ReconstructorWorker
    value: ValueWorker | None = None
    tokenizer: Any = None
    av_sidecar: NLAConfig | None = None
    ar_sidecar: NLAConfig | None = None

    def close(self) -> None:
        """Release resources (remote backends stop their actors here)."""


__all__ = [
    "LOCAL", "REWARD_SUB_BATCH", "FusedRewardWindow", "OptimSettings", "PlainScoring", "PolicyLossSettings",
    "PolicyWorker", "ReconstructorWorker", "ReferenceWorker", "RewardWindow", "RolloutWorker", "Trainable",
    "ValueModel", "ValueWorker", "WorkerGroups", "default_window", "has_dropout", "parse_responses",
    "policy_micro_loss", "update_batches",
]
