"""Backends build the worker groups the controller drives; the loop never forks on them.

``local``: every role in this process, on one device (CPU or one GPU). The rollout role
shares the policy module, so a weight sync is free.
"""

from __future__ import annotations

from pathlib import Path

from nla.rl.config import BACKENDS, RLConfig
from nla.rl.distributed import DataParallel
from nla.rl.roles import WorkerGroups
from nla.rl.setup import RLSetupError, build_policy_roles, build_reconstructor_role, load_pair_sidecars
from nla.train.device import resolve_device


def build_local_groups(cfg: RLConfig, policy_dir: str | Path | None = None, ar_dir: str | Path | None = None
                       ) -> WorkerGroups:
    """All roles in-process. ``policy_dir`` / ``ar_dir`` override the starting weights (resume)."""
    device, dp = resolve_device(cfg.device), DataParallel()
    av_side, ar_side = load_pair_sidecars(cfg.av, cfg.ar)
    roles = build_policy_roles(cfg, policy_dir or cfg.av, dp, device)
    return WorkerGroups(
        rollout=roles["rollout"], policy=roles["policy"], reference=roles["reference"],
        reconstructor=build_reconstructor_role(cfg, ar_dir or cfg.ar, dp, device),
        value=roles.get("value"), tokenizer=roles["policy"].tokenizer, av_sidecar=av_side, ar_sidecar=ar_side,
    )


def _build_ray_groups(cfg: RLConfig, policy_dir: str | Path | None = None, ar_dir: str | Path | None = None
                      ) -> WorkerGroups:
    try:
        from nla.rl.ray_backend import build_ray_groups
    except ImportError as exc:
        raise RLSetupError(
            f"backend: 'ray' needs the ray extra ({exc}); install it with `pip install 'nla[ray]'`"
        ) from None
    return build_ray_groups(cfg, policy_dir, ar_dir)


BACKEND_BUILDERS = {"local": build_local_groups, "ray": _build_ray_groups}


def build_groups(cfg: RLConfig, policy_dir: str | Path | None = None, ar_dir: str | Path | None = None
                 ) -> WorkerGroups:
    try:
        builder = BACKEND_BUILDERS[cfg.backend.name]
    except KeyError:
        raise RLSetupError(
            f"backend: {cfg.backend.name!r} is not available in this build; valid: {sorted(BACKENDS)}"
        ) from None
    return builder(cfg, policy_dir, ar_dir)
