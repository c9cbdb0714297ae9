"""Frozen configs for the two warm-start stages, loaded from YAML with ``key=value`` overrides.

One dataclass per stage; YAML keys map one to one onto fields. Every field is validated in
``__post_init__`` with an error that names it, so bad values fail before any model loads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

from nla.util.configcheck import check_config_types
from nla.util.confighelp import option, with_help
from nla.util.overrides import parse_overrides
from nla.util.threads import check_threads
from nla.util.validation import load_yaml

_DEVICES_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA (``nla.core.lora``, needs peft), the ``lora`` block of the AV's and AR's warm-start and of
    RL. On (``r`` > 0), only the adapters train (and, in a warm-start, the parts that start new: the
    AR's head, the AV's injection adapter); every checkpoint is the merged model (a plain HF dir with
    its sidecar) with the adapter beside it in peft's format. Each field's help: ``nla config
    describe av lora``."""

    r: int = option(0, help="LoRA rank: the adapters' inner width; 0 = off (full fine-tuning). Range: an "
                            "integer >= 0.")
    alpha: float = option(16.0, help="LoRA scale numerator: the adapters' output is multiplied by alpha / r. "
                                     "Range: a positive finite number.")
    dropout: float = option(0.0, help="dropout probability on the adapters' input while training. Range: [0, 1).")
    target_modules: list[str] | None = option(None, help="names of the linear modules that get adapters (e.g. "
                                                         "[q_proj, v_proj]); null = the attention and MLP projections "
                                                         "(nla.core.lora.DEFAULT_TARGETS). Range: a non-empty list "
                                                         "of names, or null.")

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
    raise ValueError(with_help(f"lora.{name}: expected {expected}, found {found!r}; fix the config's lora block or "
                               f"--set lora.{name}=...", ARTrainConfig, f"lora.{name}"))


@dataclass(frozen=True)
class RunConfig:
    """The fields every training run has, the warm-starts' and RL's (``nla.rl.config.RLConfig``):
    its data, where it writes, how often it logs and evaluates, its seed, device, precision and
    threads. Each stage validates them in its own ``__post_init__`` (its errors name the stage);
    a stage whose default differs (RL logs every step) declares the field again."""

    dataset: str = option("", help="the training parquet, with its sidecar beside it (ar_sft.parquet or "
                                   "av_sft.parquet for a warm-start, rl.parquet for RL). Required: a path.")
    eval_dataset: str | None = option(None, help="a separate held-out parquet scored every eval_every steps; "
                                                 "null = a warm-start holds out eval_fraction of the training "
                                                 "documents, RL evaluates nothing. Range: a path or null.")
    out_dir: str = option("runs/train", help="the run directory: checkpoints under checkpoints/step_*, metrics "
                                             "({name}.jsonl, curves PNG, TensorBoard) and the resolved config "
                                             "beside them. Required: a path.")
    stop_after_steps: int | None = option(None, help="end this invocation after this global step, keeping the "
                                                     "schedule of the whole run (to split a run into resumable "
                                                     "chunks with --resume); null = run to the end. Range: an "
                                                     "integer >= 1, or null.")
    log_every: int = option(10, help="log metrics every this many optimiser steps; the last step always logs. "
                                     "Range: an integer >= 1.")
    eval_every: int = option(50, help="evaluate on the held-out rows every this many optimiser steps; the last "
                                      "step always evaluates. Range: an integer >= 1.")
    eval_max_rows: int = option(256, help="at most this many held-out rows scored at each evaluation. Range: an "
                                          "integer >= 1.")
    seed: int = option(0, help="seeds every random draw of the run (data order, sampling, dropout, held-out "
                              "split): the same seed and config give the same run on the same machine. Range: "
                              "an integer in 0..2**32-1.")
    device: str = option("auto", help="where the models run: auto (cuda when available, else cpu), cpu, "
                                      "cuda or cuda:i.")
    dtype: str = option("float32", help="the models' parameter dtype: float32, bfloat16 or float16.")
    autocast: str | None = option(None, help="mixed precision: the training forwards' matmuls in this dtype under "
                                             "torch.autocast, the weights, optimiser state, heads and losses in "
                                             "fp32 (nla.util.precision). On a CPU it needs bf16 instructions "
                                             "(AVX512_BF16 or AMX) and gives that CPU kind's own numbers; "
                                             "evaluation stays fp32. null = fp32 throughout. Range: null or "
                                             "bfloat16 (with dtype float32).")
    adamw: str = option("default", help="how torch runs AdamW: default (torch's own choice: a loop over the "
                                        "parameters on a CPU) or fused (one kernel, transformers' and TRL's "
                                        "default: 3-5x faster a step on a CPU, its numbers its own in the last "
                                        "bits). Range: default or fused.")
    threads: int | str | None = option(None, help="torch CPU threads of this process, fixed for the run "
                                                  "(nla.util.threads); on Ray each actor gets a share of half "
                                                  "the cores; null = $OMP_NUM_THREADS, else every core; "
                                                  "\"auto\" follows the machine's load and gives up "
                                                  "reproducibility. Range: an integer >= 1, \"auto\" or null.")
    tensorboard: bool = option(True, help="also write the metrics as TensorBoard events under "
                                          "{out_dir}/tensorboard (skipped when tensorboard is not installed: "
                                          "the JSONL is the record).")
    progress: bool = option(True, help="show a progress bar; changes nothing the run computes.")


@dataclass(frozen=True)
class _TrainBase(RunConfig):
    """Fields shared by both warm-starts (their run fields: :class:`RunConfig`).

    Every field's meaning, unit and range is its help (``nla config describe ar``).
    """

    base_model: str | None = option(None, help="the Hugging Face model directory (or hub id) the model starts "
                                               "from; null = the dataset sidecar's base_model (the subject).")
    sidecar: str | None = option(None, help="an explicit sidecar path, overriding the dataset's "
                                            "(docs/design.md §3.1 precedence); null = the dataset's own.")
    eval_fraction: float = option(0.1, help="share of the training documents held out for evaluation (by "
                                            "doc_id; by row without a doc_id column) when eval_dataset is "
                                            "null. Range: [0, 1).")
    max_steps: int = option(100, help="optimiser steps in the whole run; the LR schedule spans them. Range: an "
                                      "integer >= 1.")
    batch_size: int = option(32, help="rows per optimiser step. Range: an integer >= 1.")
    micro_batch_size: int | None = option(None, help="rows per forward; gradients accumulate over the "
                                                     "micro-batches of a step (the same step for any split); "
                                                     "null = batch_size. Range: 1..batch_size, or null.")
    lr: float = option(1e-4, help="peak learning rate of AdamW, reached after warmup_steps. Range: a positive "
                                  "finite number.")
    weight_decay: float = option(0.0, help="AdamW's decoupled weight decay per step. Range: a number >= 0.")
    betas: tuple[float, float] = option((0.9, 0.999), help="AdamW's two moment decay rates. Range: two numbers "
                                                           "in [0, 1).")
    warmup_steps: int = option(10, help="optimiser steps of linear LR warmup from 0, then cosine decay to "
                                        "min_lr_ratio * lr at max_steps. Range: an integer in [0, max_steps].")
    min_lr_ratio: float = option(0.1, help="the cosine schedule's final LR as a share of lr. Range: [0, 1].")
    max_grad_norm: float = option(1.0, help="clip the gradient's global L2 norm to this; <= 0 disables "
                                            "clipping; a step with a non-finite norm is skipped and counted. "
                                            "Range: a finite number.")
    save_every: int = option(100, help="save a checkpoint every this many optimiser steps; the last step always "
                                       "saves. Range: an integer >= 1.")
    keep_last: int = option(2, help="checkpoints kept (older step_* dirs are pruned); 0 = keep all. Range: an "
                                    "integer >= 0.")
    max_length: int = option(256, help="token cap per training row: the AR truncates its text on the left so "
                                       "the template's tail survives; the AV cuts the response to fit after the "
                                       "prompt. Range: an integer >= 1.")
    lora: LoRAConfig = option(default_factory=LoRAConfig, help="LoRA (lora: {r: 8} in YAML, --set lora.r=8); "
                                                               "r = 0, full fine-tuning, is the default.")
    gradient_checkpointing: bool = option(False, help="recompute each block's activations in backward instead "
                                                      "of keeping them: activation memory of one block instead "
                                                      "of all, for one more forward per step; the same "
                                                      "gradients.")

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
        from nla.util.precision import AUTOCAST_DTYPES

        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            _bad("autocast", f"null or one of {list(AUTOCAST_DTYPES)}", self.autocast)
        if self.autocast is not None and self.dtype != "float32":
            _bad("autocast", f"null with dtype {self.dtype!r} (autocast runs bf16 matmuls over fp32 weights: set "
                 "dtype: float32 or autocast: null)", self.autocast)
        if not isinstance(self.seed, int):
            _bad("seed", "an integer", self.seed)
        from nla.train.optim import ADAMW_IMPLS

        if self.adamw not in ADAMW_IMPLS:
            _bad("adamw", f"one of {list(ADAMW_IMPLS)}", self.adamw)
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

    Every field's meaning, unit and range is its help (``nla config describe ar``).
    """

    out_dir: str = option("runs/train_ar", help="the run directory: checkpoints under checkpoints/step_*, "
                                                "metrics (ar.jsonl, curves PNG, TensorBoard) and the resolved "
                                                "config beside them. Required: a path.")
    layer_index: int | None = option(None, help="K, the extraction layer the AR is cut at (it keeps blocks "
                                                "0..K); null = the dataset sidecar's. Set it only to override a "
                                                "sidecar that lacks it. Range: an integer >= 0, or null.")
    shuffle_sentences: bool = option(False, help="read each training row's explanation with its sentences in a "
                                                 "random order of its own (nla.core.graders.shuffle_sentences, "
                                                 "keyed on the seed and the row, so a resumed run reads the same "
                                                 "texts), so the AR learns what the claims say, not where they "
                                                 "stand; evaluation reads the texts as written.")
    exits: bool = option(False, help="a pair of several blocks (extraction.layers) only: read each row at its own "
                                     "block, a row of block k after block max(k, 1) through a head of block k's "
                                     "own (nla.core.reconstructor.Reconstructor.set_exits; its rows skip the "
                                     "blocks past their exit), not every row after the deepest block through one "
                                     "head. The checkpoint holds the heads (exit_heads.safetensors) and RL, the "
                                     "client and nla eval read them.")
    exit_min_block: int | None = option(None, help="with exits: a row of a block shallower than this is read after "
                                                   "this block (at most the deepest), still through its own block's "
                                                   "head; null = block 1 (nla.core.reconstructor.EXIT_MIN_BLOCK, "
                                                   "measured on the world). The deepest block reads every row after "
                                                   "it, each block through a head of its own. Range: an integer >= 0, "
                                                   "or null.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.exits, bool):
            _bad("exits", "true or false", self.exits)
        if self.exit_min_block is not None:
            if isinstance(self.exit_min_block, bool) or not isinstance(self.exit_min_block, int) \
                    or self.exit_min_block < 0:
                _bad("exit_min_block", "an integer >= 0, or null", self.exit_min_block)
            if not self.exits:
                _bad("exit_min_block", "null unless exits: true (it sets where exits read a shallow block)",
                     self.exit_min_block)
        if self.layer_index is not None and (not isinstance(self.layer_index, int) or self.layer_index < 0):
            _bad("layer_index", "an integer >= 0 or null (take it from the sidecar)", self.layer_index)
        if not isinstance(self.shuffle_sentences, bool):
            _bad("shuffle_sentences", "true or false", self.shuffle_sentences)


@dataclass(frozen=True)
class AVTrainConfig(_TrainBase):
    """Verbalizer warm-start (next-token loss on the explanation, vector injected).

    Every field's meaning, unit and range is its help (``nla config describe av``).
    """

    out_dir: str = option("runs/train_av", help="the run directory: checkpoints under checkpoints/step_*, "
                                                "metrics (av.jsonl, curves PNG, TensorBoard) and the resolved "
                                                "config beside them. Required: a path.")
    injection_scale: float | str | None = option(None, help="the norm each vector is rescaled to before it is "
                                                           "injected, overriding the sidecar's: a positive number "
                                                           "or \"sqrt_d_model\"; null = the sidecar's (training "
                                                           "refuses to start when both are null).")
    padding_side: str = option("right", help="how training batches are padded: right or left; positions come "
                                             "from the attention mask, so both give the same loss.")
    share_prompt_head: bool = option(False, help="run the tokens every row's prompt begins with (the chat "
                                                 "template's head and the prompt's words before the marker) once "
                                                 "per batch, their KV cache shared by the rows, and the LM head on "
                                                 "the response tokens only: the same loss to float rounding, "
                                                 "fewer FLOPs where the template's head is long (SmolLM2's: 28 of "
                                                 "43 prompt tokens). Needs padding_side right, no "
                                                 "gradient_checkpointing, and a llama or qwen2 model; others "
                                                 "train the plain way (logged). Off by default: a run's figures "
                                                 "move in the last digits with it.")
    smoke_num: int = option(3, help="held-out vectors decoded greedily at every save by the injection smoke "
                                    "check (it flags empty output, the marker or CJK text); 0 = off. Range: an "
                                    "integer >= 0.")
    smoke_max_new_tokens: int = option(40, help="token cap of each smoke-check decode. Range: an integer >= 1.")
    injection_adapter: str = option("none", help="none (inject the rescaled vector as it is, the published way) "
                                                 "or affine: a learned W v + b from the subject's width to the "
                                                 "AV's (nla.core.injection.InjectionAdapter), trained with the "
                                                 "AV; a base_model of another width than the subject needs "
                                                 "affine.")
    mean_shift_augment: float = option(0.0, help="m: each training row's vector gets a * mean added, a drawn "
                                                 "uniformly from [-m, m] per row and step (mean: the training "
                                                 "vectors' mean), its response unchanged, so the AV names the "
                                                 "same facts when a vector's offset differs (m = 1 spans the "
                                                 "centred vector to twice the offset); 0 = off, the published "
                                                 "recipe. Range: a number >= 0.")
    injection_adapter_lr_scale: float = option(1.0, help="the injection adapter's learning rate is lr times "
                                                         "this (a new layer learning faster than the model it "
                                                         "feeds); 1 = the model's. Range: a positive number.")
    injection_adapter_mean_invariant: bool = option(False, help="the adapter reads each vector with its "
                                                               "component along the training vectors' mean "
                                                               "replaced by the training data's typical one "
                                                               "(InjectionAdapter.canonical), so a vector "
                                                               "shifted along that mean reads like the training "
                                                               "data; needs injection_adapter: affine.")
    injection_adapter_conformal: bool = option(False, help="the adapter's W is a learned gain times a learned "
                                                          "rotation (nla.core.injection.ScaledRotation): it "
                                                          "scales every direction alike; needs "
                                                          "injection_adapter: affine and a base of the "
                                                          "subject's width.")

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
    message = f"config field '{name}': expected {expected}, found {found!r}; fix it in the YAML or with --set {name}=..."
    cls = AVTrainConfig if name in {f.name for f in fields(AVTrainConfig)} else ARTrainConfig
    raise ValueError(with_help(message, cls, name))


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


__all__ = ["ARTrainConfig", "AVTrainConfig", "LoRAConfig", "PATH_FIELDS", "RunConfig", "config_from_dict", "load_config",
           "normalise_paths", "read_config_file", "save_config"]
