"""How every RL backend builds its roles: sidecar checks, loading the AV, the role builders.

A layer below the backends: ``nla.rl.backend`` (the dispatcher and the local backend) and
``nla.rl.ray_backend`` both build their roles here, with their own ``DataParallel`` (one
rank owning every row, or this actor's ``RankGroup``), and neither imports the other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from nla.core import arch
from nla.core.reconstructor import Reconstructor, check_ar_max_length
from nla.core.sidecar import SIDECAR_NAME, NLAConfig, load_sidecar
from nla.core.token_ids import verify_tokenizer
from nla.rl.algorithms import get_advantage_estimator
from nla.rl.config import RLConfig
from nla.rl.distributed import DataParallel
from nla.rl.roles import (
    OptimSettings,
    PolicyLossSettings,
    PolicyWorker,
    ReconstructorWorker,
    ReferenceWorker,
    RolloutWorker,
    ValueModel,
    ValueWorker,
)
from nla.train.device import resolve_dtype
from nla.util.checkpoint_files import check_checkpoint

logger = logging.getLogger(__name__)


class RLSetupError(ValueError):
    """A problem found before RL starts; the message names the input and the fix."""


def load_pair_sidecars(av_dir: str | Path, ar_dir: str | Path) -> tuple[NLAConfig, NLAConfig]:
    """Read and cross-check the AV and AR checkpoint sidecars (width and layer; subject and tokenizer
    are ``nla.rl.loop.check_run_provenance``'s, once per run, with the datasets)."""
    sides = []
    for role, d in (("av", av_dir), ("ar", ar_dir)):
        path = Path(d)
        if not (path / SIDECAR_NAME).is_file():
            raise RLSetupError(f"{role}: {path} has no {SIDECAR_NAME}; pass a checkpoint written by `nla train {role}`")
        sides.append(load_sidecar(path))
    av, ar = sides
    if (av.layers or None) != (ar.layers or None):
        raise RLSetupError(f"layers: the AV sidecar reads blocks {av.layers} but the AR sidecar {ar.layers} "
                           "(extraction.layers); the two checkpoints come from different datasets")
    for field in ("d_model", "layer_index"):
        # A published AV sidecar may record no layer (docs/design.md §3.1): compare only what both record.
        if None not in (getattr(av, field), getattr(ar, field)) and getattr(av, field) != getattr(ar, field):
            raise RLSetupError(
                f"{field}: the AV sidecar says {getattr(av, field)} but the AR sidecar says {getattr(ar, field)}; "
                "the two checkpoints come from different datasets or subject layers"
            )
    if av.injection_scale_value() is None and av.injection_scale is None:
        logger.info("AV injection_scale is null: vectors are injected raw")
    return av, ar


def load_av(path: str | Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from nla.core.injection import load_av_model

    check_checkpoint(path, "av")  # complete safetensors, recorded checksums
    side = load_sidecar(path) if (Path(path) / SIDECAR_NAME).is_file() else None
    model = load_av_model(path, side, dtype=dtype).to(device)  # with its injection adapter, if it has one
    tok = arch.load_tokenizer(path)
    return model, tok


def build_policy_roles(cfg: RLConfig, policy_dir: str | Path, dp: DataParallel, device: torch.device
                       ) -> dict[str, Any]:
    """The ``policy``, ``reference`` and ``rollout`` roles of this rank, and ``value`` when the
    advantage estimator needs values (PPO's GAE).

    ``policy_dir`` holds the starting weights (the warm-started AV, or a checkpoint on
    resume); the reference is always the warm-started AV (``cfg.av``). Where ``dp`` holds whole
    models (local, replicated ranks) the rollout role shares the policy module (a weight sync is
    free); where it shards them (``dp.shards``) every rank gets its own unsharded copy and
    generates its share of the prompts. Models are sharded by ``dp`` before any role (hooks,
    optimiser) is built on them.
    """
    torch.manual_seed(cfg.seed)  # any module init draws from the RNG: every rank builds the same
    dtype = resolve_dtype(cfg.dtype)
    av_side, _ = load_pair_sidecars(cfg.av, cfg.ar)
    lora = cfg.lora.settings()
    if lora.enabled:  # one module: the reference is it with the adapters off, the rollout shares it
        model, tok = _lora_policy(cfg, lora, policy_dir, av_side, dp, device, dtype)
        ref = model
    else:
        model, tok = load_av(policy_dir, device, dtype)
        verify_tokenizer(av_side, tok)
        ref, _ = load_av(cfg.av, device, dtype)
        ref.eval().requires_grad_(False)
    if cfg.optimiser.gradient_checkpointing:  # the update's backward; no_grad passes run as they are
        arch.enable_gradient_checkpointing(model)
    # The value model copies the policy's body: from the unsharded policy, before it is sharded.
    value_model = ValueModel(model).to(device) if get_advantage_estimator(cfg.loss.advantage).needs_values else None
    dp.shard(model, arch.decoder_layers(model))
    if ref is not model:
        dp.shard(ref, arch.decoder_layers(ref))
    roles: dict[str, Any] = {
        "policy": PolicyWorker(model, tok, av_side, PolicyLossSettings.from_config(cfg), OptimSettings.for_policy(cfg),
                               dp),
        "reference": ReferenceWorker(ref, av_side, cfg.optimiser.micro_batch_size, dp, adapters_off=ref is model),
    }
    rollout_model = load_av(policy_dir, device, dtype)[0] if dp.shards else model
    roles["rollout"] = RolloutWorker(rollout_model, tok, av_side, device, dp, decode=cfg.rollout.decode)
    if value_model is not None:
        dp.shard(value_model, arch.decoder_layers(value_model.body))
        roles["value"] = ValueWorker(value_model, av_side, OptimSettings.for_value(cfg), cfg.optimiser.micro_batch_size,
                                     clip_eps=cfg.loss.value_clip, dp=dp)
    return roles


def _lora_policy(cfg: RLConfig, lora: Any, policy_dir: str | Path, av_side: Any, dp: DataParallel,
                 device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """The LoRA policy (``nla.core.lora``): the warm-started AV with adapters (from ``policy_dir``'s
    ``_adapter`` dir on resume), and its tokenizer."""
    from nla.core.lora import adapter_dir_for, apply_lora

    if get_advantage_estimator(cfg.loss.advantage).needs_values:
        raise RLSetupError("lora.r > 0 with loss.advantage: gae: the value model would copy the whole AV body; "
                           "use lora.r: 0 for PPO, or a group estimator (grpo, drgrpo, reinforce_baseline)")
    model, tok = load_av(cfg.av, device, dtype)
    verify_tokenizer(av_side, tok)
    resume = Path(policy_dir).resolve() != Path(cfg.av).resolve()  # the policy is base + the saved adapter
    try:
        apply_lora(model, lora, adapter_dir=adapter_dir_for(policy_dir) if resume else None)
    except ValueError as err:
        raise RLSetupError(str(err)) from None
    return model, tok


def build_reconstructor_role(cfg: RLConfig, ar_dir: str | Path, dp: DataParallel, device: torch.device
                             ) -> ReconstructorWorker:
    """The ``reconstructor`` role from ``ar_dir`` (the warm-started AR, or a checkpoint on resume)."""
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype)
    _, ar_side = load_pair_sidecars(cfg.av, cfg.ar)
    ar = (_lora_reconstructor(cfg, ar_dir, dtype) if cfg.reconstructor.lora_r > 0
          else Reconstructor.from_pretrained(ar_dir, dtype=dtype)).to(device)
    tok = ar.tokenizer if ar.tokenizer is not None else arch.load_tokenizer(cfg.av)
    verify_tokenizer(ar_side, tok)
    if cfg.reconstructor.gradient_checkpointing:
        arch.enable_gradient_checkpointing(ar.base)
    dp.shard(ar, arch.decoder_layers(ar.base))
    try:
        check_ar_max_length(cfg.reconstructor.max_length, ar_side.critic_suffix_ids, "reconstructor.max_length")
    except ValueError as err:
        raise RLSetupError(str(err)) from None
    return ReconstructorWorker(ar, tok, ar_side, OptimSettings.for_reconstructor(cfg), cfg.reconstructor.max_length,
                               cfg.optimiser.micro_batch_size, device, dp)


def _lora_reconstructor(cfg: RLConfig, ar_dir: str | Path, dtype: torch.dtype) -> Reconstructor:
    """The LoRA AR (``reconstructor.lora_r``): the warm-started AR with adapters on its body and
    its head trained in full; on resume (``ar_dir`` a checkpoint), the base + the checkpoint's
    adapter (``<ar>_adapter``) and head, so the run continues exactly."""
    from dataclasses import replace

    from nla.core.lora import adapter_dir_for, apply_lora

    ar = Reconstructor.from_pretrained(cfg.ar, dtype=dtype)
    resume = Path(ar_dir).resolve() != Path(cfg.ar).resolve()
    try:
        heads = [ar.value_head, *([] if ar.exits is None else ar.exit_heads.values())]
        apply_lora(ar, replace(cfg.lora.settings(), r=cfg.reconstructor.lora_r), train=heads,
                   adapter_dir=adapter_dir_for(ar_dir) if resume else None)
    except ValueError as err:
        raise RLSetupError(str(err).replace("lora.target_modules", "lora.target_modules (the AR's)")) from None
    if resume:
        ar.load_head(ar_dir)
    return ar


__all__ = ["RLSetupError", "build_policy_roles", "build_reconstructor_role", "load_av", "load_pair_sidecars"]
