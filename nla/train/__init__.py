"""Warm-start training of the reconstructor (AR) and the verbalizer (AV); shared training utilities.

``train_ar(cfg)`` / ``train_av(cfg)`` are imported lazily so ``import nla.train`` stays light.
"""

from __future__ import annotations

from typing import Any

from nla.train.config import ARTrainConfig, AVTrainConfig, load_config

__all__ = ["ARTrainConfig", "AVTrainConfig", "TrainResult", "load_config", "train_ar", "train_av"]


def __getattr__(name: str) -> Any:
    if name == "train_ar":
        from nla.train.ar import train_ar

        return train_ar
    if name == "train_av":
        from nla.train.av import train_av

        return train_av
    if name == "TrainResult":
        from nla.train.loop import TrainResult

        return TrainResult
    raise AttributeError(name)
