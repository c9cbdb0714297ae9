"""What every RL backend needs before its workers exist: the backend names, sidecar checks, loading the AV.

A layer below the backends: ``nla.rl.backend`` (the dispatcher and the local backend) and
``nla.rl.ray_backend`` both import it, and neither imports the other's module for it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from nla import arch
from nla.sidecar import SIDECAR_NAME, NLAConfig, load_sidecar

logger = logging.getLogger(__name__)

# The one registry of backend names (config validation and the dispatcher both read it).
BACKENDS: dict[str, str] = {
    "local": "every role in this process, on one device (CPU or one GPU)",
    "ray": "each role a group of Ray actors with torch.distributed and FSDP2 (pip install 'nla[ray]')",
}


class RLSetupError(ValueError):
    """A problem found before RL starts; the message names the input and the fix."""


def load_pair_sidecars(av_dir: str | Path, ar_dir: str | Path) -> tuple[NLAConfig, NLAConfig]:
    """Read and cross-check the AV and AR checkpoint sidecars."""
    sides = []
    for role, d in (("av", av_dir), ("ar", ar_dir)):
        path = Path(d)
        if not (path / SIDECAR_NAME).is_file():
            raise RLSetupError(f"{role}: {path} has no {SIDECAR_NAME}; pass a checkpoint written by `nla train {role}`")
        sides.append(load_sidecar(path))
    av, ar = sides
    for field in ("d_model", "layer_index"):
        if getattr(av, field) != getattr(ar, field):
            raise RLSetupError(
                f"{field}: the AV sidecar says {getattr(av, field)} but the AR sidecar says {getattr(ar, field)}; "
                "the two checkpoints come from different datasets or subject layers"
            )
    if av.injection_scale_value() is None and av.injection_scale is None:
        logger.info("AV injection_scale is null: vectors are injected raw")
    return av, ar


def load_av(path: str | Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device)
    tok = arch.load_tokenizer(path)
    return model, tok


__all__ = ["BACKENDS", "RLSetupError", "load_av", "load_pair_sidecars"]
