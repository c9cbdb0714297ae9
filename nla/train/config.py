"""Frozen configs for the two warm-start stages, loaded from YAML with ``key=value`` overrides.

One dataclass per stage; YAML keys map one to one onto fields. Every field is validated in
``__post_init__`` with an error that names it, so bad values fail before any model loads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

from nla.util.configcheck import check_config_types
from nla.util.overrides import parse_overrides
from nla.util.threads import check_threads
from nla.util.validation import load_yaml

_DEVICES_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA (``nla.core.lora``, needs peft), the ``lora`` block of the AV's and AR's warm-start and of
    RL: ``r`` the rank (0: off, full fine-tuning), ``alpha`` (the adapters' scale is alpha / r),
    ``dropout``, ``target_modules`` (null: the attention and MLP projections,
    ``nla.core.lora.DEFAULT_TARGETS``). On, only the adapters train (and, in a warm-start, the parts
    that start new: the AR's head, the AV's injection adapter); every checkpoint is the merged
    model (a plain HF dir with its sidecar) with the adapter beside it in peft's format."""

    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 0:
            _lora_bad("r", "an integer >= 0 (0 = off)", self.r)
        if not (isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and self.alpha > 0
                and math.isfinite(self.alpha)):
            _lora_bad("alpha", "a positive finite number", self.alpha)
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            _lora_bad("dropout", "a probability in [0, 1)", self.dropout)
        if self.target_modules is not None and (
                not isinstance(self.target_modules, list) or not self.target_modules
                or not all(isinstance(t, str) and t for t in self.target_modules)):
            _lora_bad("target_modules", "a non-empty list of module names (e.g. [q_proj, v_proj]) or null",
                      self.target_modules)

    def settings(self) -> Any:
        from nla.core.lora import DEFAULT_TARGETS, LoRASettings

        return LoRASettings(self.r, float(self.alpha), float(self.dropout),
                            tuple(self.target_modules) if self.target_modules else DEFAULT_TARGETS)


def _lora_bad(name: str, expected: str, found: Any) -> None:
    raise ValueError(f"lora.{name}: expected {expected}, found {found!r}; fix the config's lora block or "
                     f"--set lora.{name}=...")


@dataclass(frozen=True)
class _TrainBase:
    """Fields shared by both stages.

    dataset: training parquet (``ar_sft.parquet`` / ``av_sft.parquet``) with its sidecar.
    out_dir: run directory; checkpoints go to ``{out_dir}/checkpoints/step_*``, metrics beside.
    base_model: HF directory to start from; null = the dataset sidecar's ``base_model``.
    sidecar: explicit sidecar path, overriding the dataset's (docs/design.md §3.1 precedence).
    eval_dataset: a separate held-out parquet; null = hold out ``eval_fraction`` of the
        training documents (by ``doc_id``; by row when there is no doc_id column).
    max_steps: optimiser steps in the whole run (the LR schedule spans it).
    stop_after_steps: end this invocation after this global step, keeping the schedule of
        ``max_steps`` (to split a run into resumable chunks); null = run to max_steps.
    batch_size / micro_batch_size: rows per optimiser step / per forward (gradient
        accumulation in between; micro_batch_size null = batch_size).
    lr, weight_decay, betas, warmup_steps, min_lr_ratio: AdamW with warmup + cosine.
    max_grad_norm: gradient clipping (<= 0 disables); non-finite steps are skipped.
    log_every / eval_every / save_every: in optimiser steps; the last step always logs,
        evaluates and saves. keep_last: checkpoints kept (0 = all).
    max_length: token cap per row (AR truncates on the left so the suffix survives).
    eval_max_rows: cap on held-out rows scored at each evaluation.
    threads: torch CPU threads (null: ``$OMP_NUM_THREADS``, else every core, fixed for the run;
        ``"auto"``: follows the machine's load and gives up reproducibility; ``nla.util.threads``).
    lora: :class:`LoRAConfig` (``lora: {r: 8}`` in YAML, ``--set lora.r=8``); r = 0, full
        fine-tuning, is the default.
    gradient_checkpointing: recompute each block's activations in backward instead of keeping
        them (``nla.core.arch.enable_gradient_checkpointing``): activation memory of one block
        instead of all, for one more forward per step; the same gradients.
    """

    dataset: str = ""
    out_dir: str = "runs/train"
    base_model: str | None = None
    sidecar: str | None = None
    eval_dataset: str | None = None
    eval_fraction: float = 0.1
    eval_max_rows: int = 256
    max_steps: int = 100
    stop_after_steps: int | None = None
    batch_size: int = 32
    micro_batch_size: int | None = None
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    log_every: int = 10
    eval_every: int = 50
    save_every: int = 100
    keep_last: int = 2
    max_length: int = 256
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    threads: int | str | None = None
    tensorboard: bool = True
    progress: bool = True
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if isinstance(self.lora, dict):
            valid = {f.name for f in fields(LoRAConfig)}
            unknown = sorted(set(self.lora) - valid)
            if unknown:
                raise ValueError(f"config field 'lora': unknown key(s) {unknown}; valid keys: {sorted(valid)}")
            object.__setattr__(self, "lora", LoRAConfig(**self.lora))
        elif not isinstance(self.lora, LoRAConfig):
            _bad("lora", "a mapping such as {r: 8} (or --set lora.r=8)", self.lora)
        if not self.dataset:
            _bad("dataset", "a path to the training parquet", self.dataset)
        if not self.out_dir:
            _bad("out_dir", "a run directory", self.out_dir)
        _positive_float("lr", self.lr)
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            _bad("weight_decay", "a number >= 0", self.weight_decay)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _bad("betas", "two numbers in [0, 1)", self.betas)
        for name in ("max_steps", "batch_size", "log_every", "eval_every", "save_every", "max_length",
                     "eval_max_rows"):
            _positive_int(name, getattr(self, name))
        if self.micro_batch_size is not None:
            _positive_int("micro_batch_size", self.micro_batch_size)
            if self.micro_batch_size > self.batch_size:
                _bad("micro_batch_size", f"<= batch_size ({self.batch_size})", self.micro_batch_size)
        if self.stop_after_steps is not None:
            _positive_int("stop_after_steps", self.stop_after_steps)
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= self.max_steps:
            hint = " (the warmup outlasts the run: lower it too, e.g. --set warmup_steps=0)" if (
                isinstance(self.warmup_steps, int) and self.warmup_steps > self.max_steps) else ""
            _bad("warmup_steps", f"an integer in [0, max_steps={self.max_steps}]{hint}", self.warmup_steps)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _bad("min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        if not math.isfinite(self.max_grad_norm):
            _bad("max_grad_norm", "a finite number (<= 0 disables clipping)", self.max_grad_norm)
        if not 0.0 <= self.eval_fraction < 1.0:
            _bad("eval_fraction", "a number in [0, 1)", self.eval_fraction)
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            _bad("keep_last", "an integer >= 0 (0 keeps all)", self.keep_last)
        if self.dtype not in _DEVICES_DTYPES:
            _bad("dtype", f"one of {list(_DEVICES_DTYPES)}", self.dtype)
        if not isinstance(self.seed, int):
            _bad("seed", "an integer", self.seed)
        check_threads("config field 'threads'", self.threads)

    @property
    def micro(self) -> int:
        return self.micro_batch_size or self.batch_size

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass(frozen=True)
class ARTrainConfig(_TrainBase):
    """Reconstructor warm-start (regression of the activation from the explanation text).

    layer_index: K, the extraction layer; null = the dataset sidecar's. Set it only to
        override a sidecar that lacks it.
    shuffle_sentences: each training row's explanation is read with its sentences in a random
        order of its own (``nla.core.graders.shuffle_sentences``, keyed on the seed and the row, so
        a resumed run reads the same texts; the dataset's ``explanation`` column re-wrapped in the
        AR template), so the AR learns what the claims say, not where they stand. Evaluation
        reads the texts as written.
    """

    out_dir: str = "runs/train_ar"
    layer_index: int | None = None
    shuffle_sentences: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_index is not None and (not isinstance(self.layer_index, int) or self.layer_index < 0):
            _bad("layer_index", "an integer >= 0 or null (take it from the sidecar)", self.layer_index)
        if not isinstance(self.shuffle_sentences, bool):
            _bad("shuffle_sentences", "true or false", self.shuffle_sentences)


@dataclass(frozen=True)
class AVTrainConfig(_TrainBase):
    """Verbalizer warm-start (next-token loss on the explanation, vector injected).

    injection_scale: overrides the sidecar's (a number or "sqrt_d_model"); when both are
        null training refuses to start.
    padding_side: how training batches are padded ("right" or "left"); positions are
        computed from the attention mask, so both give the same loss.
    smoke_num / smoke_max_new_tokens: the injection smoke check decodes this many held-out
        vectors greedily at every save.
    injection_adapter: "none" (inject the rescaled vector as it is, the published way) or
        "affine": a learned ``W v + b`` from the subject's width to the AV's
        (``nla.core.injection.InjectionAdapter``), trained with the AV. A ``base_model`` of another
        width than the subject (a cross-model pair) needs "affine".
    mean_shift_augment: m >= 0; each training row's vector gets ``a * mean`` added, ``a``
        drawn uniformly from [-m, m] per row and step (``mean``: the training vectors' mean),
        its response unchanged, so the AV learns to name the same facts when a vector's offset
        differs from the training data's (steering vectors, differences of means: m = 1 spans
        the centred vector, a = -1, and twice the offset, a = +1). 0: off, the published recipe.
    injection_adapter_lr_scale: the adapter's learning rate is ``lr`` times this (a new layer
        learning faster than the pretrained model it feeds); 1: the same as the model's.
    injection_adapter_mean_invariant: the adapter reads each vector with its component along the
        training vectors' mean replaced by the training data's typical one
        (``InjectionAdapter.canonical``), so a vector shifted along that mean (a difference of
        means, an offset) is read like the training data; needs ``injection_adapter: affine``.
    injection_adapter_conformal: the adapter's ``W`` is a learned gain times a learned rotation
        (``nla.core.injection.ScaledRotation``), so it scales every direction of the vector alike and
        cannot amplify the directions the AV already reads over the others; needs
        ``injection_adapter: affine`` and a base of the subject's width.
    """

    out_dir: str = "runs/train_av"
    injection_scale: float | str | None = None
    padding_side: str = "right"
    smoke_num: int = 3
    smoke_max_new_tokens: int = 40
    injection_adapter: str = "none"
    mean_shift_augment: float = 0.0
    injection_adapter_lr_scale: float = 1.0
    injection_adapter_mean_invariant: bool = False
    injection_adapter_conformal: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.padding_side not in ("left", "right"):
            _bad("padding_side", "'left' or 'right'", self.padding_side)
        if self.injection_scale is not None:
            ok = self.injection_scale == "sqrt_d_model" or (
                isinstance(self.injection_scale, (int, float))
                and not isinstance(self.injection_scale, bool)
                and math.isfinite(self.injection_scale)
                and self.injection_scale > 0
            )
            if not ok:
                _bad("injection_scale", "a positive number, 'sqrt_d_model' or null (use the sidecar's)",
                     self.injection_scale)
        if self.injection_adapter not in ("none", "affine"):
            _bad("injection_adapter", "'none' or 'affine'", self.injection_adapter)
        if not (isinstance(self.mean_shift_augment, (int, float)) and not isinstance(self.mean_shift_augment, bool)
                and math.isfinite(self.mean_shift_augment) and self.mean_shift_augment >= 0):
            _bad("mean_shift_augment", "a number >= 0 (0: off; 1: from the centred vector to twice the offset)",
                 self.mean_shift_augment)
        if not isinstance(self.injection_adapter_mean_invariant, bool):
            _bad("injection_adapter_mean_invariant", "true or false", self.injection_adapter_mean_invariant)
        if self.injection_adapter_mean_invariant and self.injection_adapter != "affine":
            _bad("injection_adapter_mean_invariant", "false unless injection_adapter is 'affine' (it is a view the "
                 "learned adapter takes; set injection_adapter: affine too)", self.injection_adapter_mean_invariant)
        if not isinstance(self.injection_adapter_conformal, bool):
            _bad("injection_adapter_conformal", "true or false", self.injection_adapter_conformal)
        if self.injection_adapter_conformal and self.injection_adapter != "affine":
            _bad("injection_adapter_conformal", "false unless injection_adapter is 'affine' (it constrains the "
                 "learned adapter; set injection_adapter: affine too)", self.injection_adapter_conformal)
        v = self.injection_adapter_lr_scale
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            _bad("injection_adapter_lr_scale", "a positive number (1: the model's lr)", v)
        if not isinstance(self.smoke_num, int) or self.smoke_num < 0:
            _bad("smoke_num", "an integer >= 0", self.smoke_num)
        _positive_int("smoke_max_new_tokens", self.smoke_max_new_tokens)


def _bad(name: str, expected: str, found: Any) -> None:
    raise ValueError(f"config field '{name}': expected {expected}, found {found!r}; fix it in the YAML or with --set {name}=...")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        _bad(name, "a positive integer", value)


def _positive_float(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        _bad(name, "a positive finite number", value)


C = TypeVar("C")


def config_from_dict(cls: type[C], data: dict[str, Any]) -> C:
    """Build ``cls`` from a dict, rejecting unknown keys with the list of valid ones."""
    valid = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown config key(s) {unknown}; valid keys: {sorted(valid)}")
    # Types first (YAML 1.1's "1e-4" strings become floats there), so __post_init__ compares numbers.
    return cls(**check_config_types(cls, data))


def read_config_file(path: str | os.PathLike, what: str = "config") -> dict[str, Any]:
    """The mapping a YAML config file holds (an empty file is an empty mapping).

    Every stage reads its file here: a syntax error names the file, line and column
    (``nla.util.validation.load_yaml``).
    """
    p = Path(path)
    loaded = load_yaml(p, what) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{p}: expected a mapping of config keys, found {type(loaded).__name__}")
    return dict(loaded)


def load_config(
    cls: type[C], path: str | os.PathLike | None = None, overrides: dict[str, Any] | list[str] | None = None
) -> C:
    """Read a YAML config (optional) and apply overrides on top."""
    data: dict[str, Any] = read_config_file(path, f"{cls.__name__} config") if path is not None else {}
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for key, value in (overrides or {}).items():
        block, dot, sub = key.partition(".")
        if dot and block == "lora":  # --set lora.r=8 updates only that key of the block
            inner = data.get("lora")
            data["lora"] = {**(dataclasses.asdict(inner) if isinstance(inner, LoRAConfig) else inner or {}),
                            sub: value}
        else:
            data[key] = value
    return config_from_dict(cls, data)


PATH_FIELDS = ("av", "ar", "dataset", "eval_dataset", "out_dir", "base_model")


def normalise_paths(cfg: C) -> C:
    """``cfg`` with its path fields spelled one way (``os.path.normpath``: ``runs/av/``, ``./runs/av``
    and ``runs//av`` are all ``runs/av``; a hub id such as ``org/name`` is unchanged).

    The commands that save a run's config (``nla train``, ``nla rl``) call it, so ``--resume`` compares
    one spelling with one spelling (``nla.train.rundir`` also matches two spellings of a path that
    exists; this covers the saved config and paths that are not there at the comparison)."""
    changes = {}
    for name in PATH_FIELDS:
        value = getattr(cfg, name, None)
        if isinstance(value, str) and value:
            norm = os.path.normpath(value)
            if norm != value:
                changes[name] = norm
    if not changes:
        return cfg
    if hasattr(cfg, "replace"):  # RLConfig: its sections are rebuilt from the dict
        return cfg.replace(**changes)
    return dataclasses.replace(cfg, **changes)


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (the file `load_config` reads back to the same object)."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")


__all__ = ["ARTrainConfig", "AVTrainConfig", "LoRAConfig", "PATH_FIELDS", "config_from_dict", "load_config",
           "normalise_paths", "read_config_file", "save_config"]
