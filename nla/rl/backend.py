"""Backends build the worker groups the controller drives; the loop never forks on them.

``local``: every role in this process, on one device (CPU or one GPU). The rollout role
shares the policy module, so a weight sync is free.
"""

from __future__ import annotations

from pathlib import Path

from nla.reconstructor import Reconstructor
from nla.rl.config import RLConfig
from nla.rl.setup import BACKENDS, RLSetupError, load_av, load_pair_sidecars
from nla.rl.workers import (
    PolicyLossSettings,
    PolicyWorker,
    ReconstructorWorker,
    ReferenceWorker,
    RolloutWorker,
    ValueWorker,
    WorkerGroups,
)
from nla.sidecar import verify_tokenizer
from nla.train.common import resolve_device, resolve_dtype


def build_local_groups(cfg: RLConfig, policy_dir: str | Path | None = None, ar_dir: str | Path | None = None
                       ) -> WorkerGroups:
    """All roles in-process. ``policy_dir`` / ``ar_dir`` override the starting weights (resume)."""
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    av_side, ar_side = load_pair_sidecars(cfg.av, cfg.ar)
    policy_model, tok = load_av(policy_dir or cfg.av, device, dtype)
    ref_model, _ = load_av(cfg.av, device, dtype)  # the reference is always the warm-started AV
    verify_tokenizer(av_side, tok)
    ar = Reconstructor.from_pretrained(ar_dir or cfg.ar, dtype=dtype).to(device)
    ar_tok = ar.tokenizer if ar.tokenizer is not None else tok
    verify_tokenizer(ar_side, ar_tok)
    settings = PolicyLossSettings.from_config(cfg)
    policy = PolicyWorker(policy_model, av_side, cfg.lr, cfg.weight_decay, cfg.warmup_steps, cfg.steps,
                          cfg.max_grad_norm, settings)
    value = None
    if cfg.advantage == "gae":
        value = ValueWorker(policy_model, av_side, cfg.value_lr_value, cfg.weight_decay, cfg.warmup_steps,
                            cfg.steps, cfg.max_grad_norm, cfg.micro_batch_size, clip_eps=None)
        value.model.to(device)
    return WorkerGroups(
        rollout=RolloutWorker(policy_model, tok, av_side, device),
        policy=policy,
        reference=ReferenceWorker(ref_model, av_side, cfg.micro_batch_size),
        reconstructor=ReconstructorWorker(
            ar, ar_tok, ar_side, cfg.ar_lr_value, cfg.weight_decay, cfg.warmup_steps, cfg.steps, cfg.max_grad_norm,
            cfg.ar_max_length, cfg.micro_batch_size, device),
        value=value, tokenizer=tok, av_sidecar=av_side, ar_sidecar=ar_side,
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
        builder = BACKEND_BUILDERS[cfg.backend]
    except KeyError:
        raise RLSetupError(
            f"backend: {cfg.backend!r} is not available in this build; valid: {sorted(BACKENDS)}"
        ) from None
    return builder(cfg, policy_dir, ar_dir)
