"""The RL stage config: frozen sections, YAML mapping one to one onto them.

``RLConfig`` holds the run's inputs and length at the top level and one frozen section per
concern (``rollout``, ``loss``, ``optimiser``, ``reward``, ``reconstructor``,
``checkpointing``, ``backend``). The YAML file has the same shape: top-level keys, and one
mapping per section. Each section validates its own fields in ``__post_init__``;
``RLConfig`` checks what spans sections (batch sizes against the rollout, the overlong
buffer against the response cap, the estimator's needs against the group size). Variant
names are checked against their registries (``nla.rl.algorithms``; ``BACKENDS`` here).

Every construction from data goes through ``RLConfig.from_dict`` (nested mappings, or
dotted keys such as ``loss.kl_coef`` from ``--set``), which type-checks every field from the
annotations (``nla.util.configcheck``, sections included) before any ``__post_init__`` compares.

Defaults reproduce the published recipe (docs/design.md §7) where it makes sense at any scale:
GRPO with group std scaling, 8 samples per prompt, KL loss k3 at 0.01 to the warm-started
AV, 150-token response cap, one optimiser step per rollout, AV and AR learning rates at
parity. Sizes (prompts per step, steps, LR) are per-run choices set in the YAML.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from nla.core.graders import available_graders
from nla.rl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES
from nla.train.config import LoRAConfig, RunConfig, read_config_file, save_config
from nla.util.configcheck import check_config_types
from nla.util.confighelp import option, with_help
from nla.util.overrides import parse_overrides
from nla.util.threads import check_threads
from nla.util.validation import check_sampling

# The one registry of backend names: config validation reads it, and the dispatcher
# (``nla.rl.backend.BACKEND_BUILDERS``) has one builder per name.
BACKENDS: dict[str, str] = {
    "local": "every role in this process, on one device (CPU or one GPU)",
    "ray": "each role a group of Ray actors with torch.distributed and FSDP2 (pip install 'nla[ray]')",
}

# backend.sharding: how a Ray group of several ranks holds its model (``BackendConfig``).
SHARDINGS: dict[str, str] = {
    "fsdp": "FSDP2: each rank holds a shard; blocks all-gathered per forward and backward",
    "replicate": "each rank holds the whole model; one gradient all-reduce per optimiser step",
}

_DTYPES = ("float32", "bfloat16", "float16")


def _bad(name: str, expected: str, found: Any) -> None:
    raise ValueError(with_help(f"RLConfig.{name}: expected {expected}, found {found!r}", RLConfig, name))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_ints(where: str, obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not _is_int(v) or v <= 0:
            _bad(f"{where}{name}", "a positive integer", v)


def _optional_positive_int(where: str, name: str, v: Any) -> None:
    if v is not None and (not _is_int(v) or v <= 0):
        _bad(f"{where}{name}", "a positive integer or null", v)


def _positive_floats(where: str, obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
            _bad(f"{where}{name}", "a positive finite number", v)


def _one_of(name: str, registry: Any, v: Any) -> None:
    if v not in registry:
        _bad(name, f"one of {sorted(registry)}", v)


# How the rollout's decode steps run (nla.rl.sampling, item 6 of its docstring).
DECODES = ("eager", "captured")


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling: ``rollout_batch_size`` prompts x ``n_samples_per_prompt`` samples per step, the
    response cap, dynamic sampling and the decode loop. Each field's help: ``nla config describe rl
    rollout``."""

    rollout_batch_size: int = option(8, help="prompts (RL vectors) drawn per step. Range: an integer >= 1; the RL "
                                             "data must hold at least this many rows.")
    n_samples_per_prompt: int = option(8, help="explanations sampled per prompt: the group GRPO's baseline is "
                                               "taken over. Range: an integer >= 1 (>= 2 for a group baseline and "
                                               "for dynamic_sampling).")
    max_response_len: int = option(150, help="cap on each response, in tokens: a sample that reaches it is "
                                             "truncated (and charged as failed); also Dr.GRPO's constant and the "
                                             "end of the overlong ramp. Range: an integer >= 1.")
    temperature: float = option(1.0, help="sampling temperature of the rollouts (held-out evaluation decodes "
                                          "greedily). Range: a finite number in [1e-4, 100] "
                                          "(nla.util.validation.check_sampling).")
    top_p: float = option(1.0, help="nucleus sampling: keep the smallest set of tokens holding this much "
                                    "probability; 1 = off. Range: (0, 1].")
    generation_chunk_prompts: int | None = option(None, help="generate this many prompts at a time and score "
                                                             "each chunk while the next generates; null = the "
                                                             "whole rollout at once. Range: an integer >= 1, or "
                                                             "null.")
    dynamic_sampling: bool = option(False, help="DAPO's dynamic sampling: drop groups whose rewards have zero "
                                                "spread and generate again to refill, up to max_refill_rounds; "
                                                "the AR still trains on every scored sample.")
    max_refill_rounds: int = option(2, help="extra generations per step that dynamic sampling may run. Range: "
                                            "an integer >= 0.")
    decode: str = option("eager", help="how decode steps run: eager (the reference: finished rows leave the "
                                       "batch) or captured (a static KV cache, on a GPU one CUDA graph per step; "
                                       "greedy gives the same tokens, sampling the same draws up to the logits' "
                                       "last-bit rounding: nla.rl.sampling, item 6). Models outside "
                                       "CACHE_REUSE_MODEL_TYPES sample with HF generate either way.")

    def __post_init__(self) -> None:
        if self.decode not in DECODES:
            _bad("rollout.decode", f"one of {list(DECODES)}", self.decode)
        _positive_ints("rollout.", self, "rollout_batch_size", "n_samples_per_prompt", "max_response_len")
        _optional_positive_int("rollout.", "generation_chunk_prompts", self.generation_chunk_prompts)
        check_sampling(self.temperature, self.top_p, what="rollout.temperature", top_p_what="rollout.top_p")
        if not _is_int(self.max_refill_rounds) or self.max_refill_rounds < 0:
            _bad("rollout.max_refill_rounds", "an integer >= 0", self.max_refill_rounds)
        if self.dynamic_sampling and self.n_samples_per_prompt < 2:
            _bad("rollout.n_samples_per_prompt",
                 ">= 2 with dynamic_sampling: true (a group of one sample has no reward spread, so dynamic "
                 "sampling would drop every group and never update); raise n_samples_per_prompt or set "
                 "dynamic_sampling: false", self.n_samples_per_prompt)

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt


@dataclass(frozen=True)
class LossConfig:
    """Advantages and the policy loss (``nla.rl.algorithms``): the estimator, the clip range, the KL
    term, the aggregation, PPO's options. Each field's help: ``nla config describe rl loss``."""

    advantage: str = option("grpo", help="the advantage estimator (nla.rl.algorithms.ADVANTAGE_ESTIMATORS): grpo "
                                         "(group mean / group std), drgrpo (no std scaling), reinforce_baseline "
                                         "(batch mean), gae (PPO, over the value model).")
    gamma: float = option(1.0, help="GAE's discount per response token (advantage gae only). Range: [0, 1].")
    lam: float = option(1.0, help="GAE's lambda (advantage gae only). Range: [0, 1].")
    eps_low: float = option(0.2, help="lower clip of the policy ratio: the surrogate clips it at 1 - eps_low. "
                                      "Range: [0, 1).")
    eps_high: float = option(0.2, help="upper clip of the policy ratio: the surrogate clips it at 1 + eps_high; "
                                       "eps_high > eps_low is DAPO's clip-higher. Range: a number >= 0.")
    dual_clip_c: float | None = option(None, help="dual clip: for a negative advantage A the per-token loss is "
                                                  "bounded at c |A|; null = off. Range: a number > 1, or null.")
    kl_coef: float = option(0.01, help="weight of the KL to the reference AV (the warm-started one), added to "
                                       "the policy loss, never to the reward; 0 = no KL term. Range: a number "
                                       ">= 0.")
    kl_estimator: str = option("k3", help="the KL estimator per token, with d = ref_logp - logp: k1 = -d, "
                                          "k2 = d^2 / 2, k3 = e^d - d - 1.")
    loss_agg: str = option("token-mean", help="how per-token losses become one number: token-mean (DAPO's), "
                                              "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm "
                                              "(Dr.GRPO: divides by rollout.max_response_len).")
    whiten_advantages: bool = option(False, help="whiten the advantages over the rollout's response tokens "
                                                 "(verl's GAE and cleanrl do); off: advantages as estimated "
                                                 "(nla.rl.algorithms, departure 11).")
    value_clip: float | None = option(None, help="PPO2 value clipping: the value loss also scores the "
                                                 "prediction clipped to the old value +- this and takes the larger "
                                                 "squared error (verl's cliprange_value is 0.5, cleanrl's 0.2); "
                                                 "null = off. Range: a number > 0, or null.")

    def __post_init__(self) -> None:
        _one_of("loss.advantage", ADVANTAGE_ESTIMATORS, self.advantage)
        if self.value_clip is not None and not self.value_clip > 0:  # the type: check_config_types
            _bad("loss.value_clip", "a number > 0 or null", self.value_clip)
        _one_of("loss.kl_estimator", KL_ESTIMATORS, self.kl_estimator)
        _one_of("loss.loss_agg", LOSS_AGG_MODES, self.loss_agg)
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            _bad("loss.eps_low/eps_high", "0 <= eps_low < 1 and eps_high >= 0", (self.eps_low, self.eps_high))
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            _bad("loss.dual_clip_c", "a number > 1 or null", self.dual_clip_c)
        if self.kl_coef < 0:
            _bad("loss.kl_coef", "a number >= 0", self.kl_coef)
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            _bad("loss.gamma/lam", "numbers in [0, 1]", (self.gamma, self.lam))


@dataclass(frozen=True)
class OptimiserConfig:
    """The optimisers (AdamW, warmup then constant LR; the AV's learning rate here, the AR's in
    ``reconstructor``) and the update layout (micro-batches, steps per rollout). Each field's help:
    ``nla config describe rl optimiser``."""

    micro_batch_size: int = option(16, help="rows per forward, for every role's log-prob passes and updates; "
                                            "gradients accumulate in between (any split gives the same step). "
                                            "Range: an integer >= 1.")
    global_batch_size: int | None = option(None, help="samples per optimiser step; null = all of a rollout (one "
                                                      "step per rollout, on-policy); a smaller divisor needs "
                                                      "allow_multiple_updates. Range: a divisor of "
                                                      "rollout_batch_size x n_samples_per_prompt, or null.")
    allow_multiple_updates: bool = option(False, help="allow several optimiser steps per rollout (off-policy "
                                                      "after the first), when global_batch_size is smaller than "
                                                      "a rollout.")
    lr: float = option(1e-5, help="the AV's learning rate (AdamW), after warmup_steps of linear warmup, then "
                                  "constant; also the AR's when reconstructor.lr is null. Range: a positive "
                                  "finite number.")
    value_lr: float | None = option(None, help="the PPO value model's learning rate; null = lr. Range: a "
                                               "positive finite number, or null.")
    weight_decay: float = option(0.0, help="AdamW's decoupled weight decay per step, for every trained role (AV, "
                                           "AR, value model). Range: a number >= 0.")
    max_grad_norm: float = option(1.0, help="clip each trained role's gradient (global L2 norm) to this; <= 0 "
                                            "disables clipping; a step with a non-finite norm is skipped and "
                                            "counted (skipped_steps). Range: a finite number.")
    warmup_steps: int = option(0, help="optimiser steps of linear LR warmup from 0, for every trained role; the "
                                       "LR is constant after. Range: an integer in [0, steps].")
    gradient_checkpointing: bool = option(False, help="the AV's policy update recomputes each block's "
                                                      "activations in backward instead of keeping them "
                                                      "(activation memory of one block instead of all); its "
                                                      "forward then runs every row's whole prompt + response "
                                                      "(a shared-prefix cache cannot be checkpointed). The same "
                                                      "gradients.")

    def __post_init__(self) -> None:
        _positive_floats("optimiser.", self, "lr")
        if self.value_lr is not None:
            _positive_floats("optimiser.", self, "value_lr")
        _positive_ints("optimiser.", self, "micro_batch_size")
        _optional_positive_int("optimiser.", "global_batch_size", self.global_batch_size)
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            _bad("optimiser.warmup_steps", "an integer >= 0", self.warmup_steps)
        if self.weight_decay < 0:
            _bad("optimiser.weight_decay", "a number >= 0", self.weight_decay)

    @property
    def value_lr_value(self) -> float:
        return self.value_lr if self.value_lr is not None else self.lr


# The step-0 guard's tolerance per dtype (``RewardConfig.step0_guard_tol`` null): the default world's
# AR, left vs right padding, max relative MSE difference measured 4.8e-7 in float32, 5.0e-4 in float16
# and 2.3e-3 in bfloat16 (BENCHMARKS.md); a layout bug (last position instead of last real token)
# differs by O(1).
STEP0_GUARD_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


@dataclass(frozen=True)
class RewardConfig:
    """How a sample's reward is made and served (``nla.rl.reward.RewardSettings``, ``RewardService``):
    -MSE or -log MSE, DAPO's overlong punishment, the format penalty, the batcher and the step-0
    guard. Each field's help: ``nla config describe rl reward``."""

    log_mse: bool = option(False, help="reward = -log(max(mse_nrm, 1e-6)) instead of -mse_nrm (a failed sample: "
                                       "-log 2).")
    overlong_buffer_len: int = option(0, help="DAPO's soft overlong punishment: a response longer than "
                                              "rollout.max_response_len - this many tokens loses up to "
                                              "overlong_penalty_factor, linearly up to the cap; 0 = off. Range: "
                                              "an integer in [0, rollout.max_response_len).")
    overlong_penalty_factor: float = option(1.0, help="the reward lost by a response at the cap under the "
                                                      "overlong punishment. Range: a number >= 0.")
    reward_batch_size: int = option(64, help="samples per batched AR forward when scoring rewards. Range: an "
                                             "integer >= 1.")
    reward_flush_seconds: float = option(0.05, help="seconds the reward batcher waits after a batch's first "
                                                    "sample for it to fill before scoring it partly full. Range: "
                                                    "a positive finite number.")
    reward_timeout_seconds: float | None = option(600.0, help="seconds one reward forward may run before every "
                                                              "waiting sample fails with an error (no hang); null "
                                                              "= wait forever. Range: a positive finite number, "
                                                              "or null.")
    step0_guard_tol: float | None = option(None, help="at step 0, refuse to start when the AR's padded reward "
                                                      "path and its training layout disagree by more than this "
                                                      "relative MSE difference; null = STEP0_GUARD_TOL at the "
                                                      "run's dtype (1e-4 fp32, 1e-2 fp16, 5e-2 bf16; autocast's "
                                                      "where set). Range: a "
                                                      "positive finite number, or null.")
    format_penalty: float = option(0.0, help="subtracted from the reward of a completed explanation that the "
                                             "format_checks grader flags as degenerate; without it RL learns to "
                                             "repeat and to misuse templates, which the live AR learns to read "
                                             "(a private code); 0 = off. Range: a finite number >= 0.")
    format_checks: str = option("generic", help="the grader (nla.core.graders) whose format checks "
                                                "format_penalty applies: generic (a repeated sentence, an "
                                                "unbalanced quote) or world (also a sentence outside the world's "
                                                "explanation language), or a registered grader.")

    def __post_init__(self) -> None:
        _one_of("reward.format_checks", available_graders(), self.format_checks)
        if not (self.format_penalty >= 0 and math.isfinite(self.format_penalty)):
            _bad("reward.format_penalty", "a finite number >= 0 (0 = off)", self.format_penalty)
        _positive_ints("reward.", self, "reward_batch_size")
        _positive_floats("reward.", self, "reward_flush_seconds")
        if self.step0_guard_tol is not None:
            _positive_floats("reward.", self, "step0_guard_tol")
        if self.reward_timeout_seconds is not None and not (
                self.reward_timeout_seconds > 0 and math.isfinite(self.reward_timeout_seconds)):
            _bad("reward.reward_timeout_seconds", "a positive finite number of seconds or null (no timeout)",
                 self.reward_timeout_seconds)
        if not _is_int(self.overlong_buffer_len) or self.overlong_buffer_len < 0:
            _bad("reward.overlong_buffer_len", "an integer >= 0", self.overlong_buffer_len)
        if self.overlong_penalty_factor < 0:
            _bad("reward.overlong_penalty_factor", "a number >= 0", self.overlong_penalty_factor)


@dataclass(frozen=True)
class ReconstructorConfig:
    """The online AR: its learning rate (null = optimiser.lr: parity), token cap, replay of data
    explanations (so it keeps reading honest text instead of drifting toward whatever the AV
    writes), LoRA and checkpointing. Each field's help: ``nla config describe rl reconstructor``."""

    lr: float | None = option(None, help="the online AR's learning rate (its own AdamW, with the optimiser "
                                         "section's decay, warmup and clipping); null = optimiser.lr (parity "
                                         "with the AV). Range: a positive finite number, or null.")
    max_length: int = option(256, help="token cap per AR text; longer texts are truncated on the left so the "
                                       "template's tail (where the prediction is read) survives. Range: an "
                                       "integer >= 1, longer than the tail.")
    replay_dataset: str | None = option(None, help="a parquet of data explanations (explanation and "
                                                   "activation_vector columns, e.g. ar_sft.parquet) the AR also "
                                                   "trains on at each update, so it keeps reading honest text; "
                                                   "needed when replay_fraction > 0.")
    replay_fraction: float = option(0.0, help="share of each AR update's rows drawn from replay_dataset (keyed "
                                              "on the seed and the step); 0 = off. Range: [0, 1).")
    shuffle_sentences: bool = option(False, help="read each replay row with its sentences in a random order "
                                                 "(keyed on the seed, the step and the row), as an AR "
                                                 "warm-started with shuffle_sentences read them; the rollouts "
                                                 "are trained on as they were scored.")
    lora_r: int = option(0, help="LoRA rank for the AR's body; only the adapters and the linear head train; "
                                 "alpha, dropout and target modules are the lora section's; 0 = off (the AR "
                                 "trains in full). Range: an integer >= 0.")
    gradient_checkpointing: bool = option(False, help="the AR's update recomputes each block's activations in "
                                                      "backward instead of keeping them; the same gradients.")

    def __post_init__(self) -> None:
        if self.lr is not None:
            _positive_floats("reconstructor.", self, "lr")
        _positive_ints("reconstructor.", self, "max_length")
        if not _is_int(self.lora_r) or self.lora_r < 0:
            _bad("reconstructor.lora_r", "an integer >= 0 (0 = off: the AR trains in full)", self.lora_r)
        if not 0.0 <= self.replay_fraction < 1.0:
            _bad("reconstructor.replay_fraction", "a share in [0, 1) (0 = off)", self.replay_fraction)
        if not isinstance(self.shuffle_sentences, bool):
            _bad("reconstructor.shuffle_sentences", "true or false", self.shuffle_sentences)
        if self.replay_fraction > 0 and not self.replay_dataset:
            _bad("reconstructor.replay_dataset",
                 "a parquet of data explanations (e.g. ar_sft.parquet) when replay_fraction > 0", self.replay_dataset)


@dataclass(frozen=True)
class CheckpointingConfig:
    """Checkpoint every ``save_every`` steps (and at the end); keep the last ``keep_last`` (0 = all)."""

    save_every: int = option(25, help="save a checkpoint (av/, ar/, rl_state.pt) every this many RL steps; the "
                                      "last step always saves. Range: an integer >= 1.")
    keep_last: int = option(2, help="checkpoints kept (older step_* dirs are pruned); 0 = keep all. Range: an "
                                    "integer >= 0.")

    def __post_init__(self) -> None:
        _positive_ints("checkpointing.", self, "save_every")
        if not _is_int(self.keep_last) or self.keep_last < 0:
            _bad("checkpointing.keep_last", "an integer >= 0", self.keep_last)


@dataclass(frozen=True)
class BackendConfig:
    """Where the roles run: ``name`` from ``BACKENDS``; Ray's cluster address, group sizes and how a
    group of several ranks holds its model (``SHARDINGS``; either computes the same step). Each
    field's help: ``nla config describe rl backend``."""

    name: str = option("local", help="where the roles run (BACKENDS): local (every role in this process, on "
                                     "one device) or ray (each role a group of Ray actors; pip install "
                                     "'nla[ray]').")
    ray_address: str | None = option(None, help="the Ray cluster to join (ray.init(address=...)); null = start "
                                                "a local Ray instance.")
    num_policy_workers: int = option(1, help="ranks of the policy group on Ray (each generates its share of "
                                             "the prompts). Range: an integer >= 1.")
    num_reconstructor_workers: int = option(1, help="ranks of the AR group on Ray (each scores its share of "
                                                    "each reward call). Range: an integer >= 1.")
    sharding: str = option("fsdp", help="how a Ray group of several ranks holds its model (SHARDINGS): fsdp "
                                        "(FSDP2: each rank a shard) or replicate (each rank the whole model, one "
                                        "gradient all-reduce per optimiser step); the same step either way.")

    def __post_init__(self) -> None:
        _one_of("backend.name", BACKENDS, self.name)
        _one_of("backend.sharding", SHARDINGS, self.sharding)
        _positive_ints("backend.", self, "num_policy_workers", "num_reconstructor_workers")


SECTIONS: dict[str, type] = {
    "rollout": RolloutConfig, "loss": LossConfig, "optimiser": OptimiserConfig, "reward": RewardConfig,
    "reconstructor": ReconstructorConfig, "checkpointing": CheckpointingConfig, "backend": BackendConfig,
    "lora": LoRAConfig,
}


@dataclass(frozen=True)
class RLConfig(RunConfig):
    """RL stage settings: the run at the top level (its data, output, logging, seed, device: the
    fields of ``nla.train.config.RunConfig``, and the pair it starts from), one section per concern.

    Every field's meaning, unit and range is its help (``nla config describe rl [SECTION]``).
    """

    out_dir: str = option("runs/rl", help="the run directory: checkpoints/step_*/{av,ar}, rl.jsonl, "
                                          "rl_summary.json, the curves PNG and the resolved rl_config.yaml. "
                                          "Required: a path.")
    log_every: int = option(1, help="log metrics every this many RL steps; the last step always logs. Range: "
                                    "an integer >= 1.")
    eval_every: int = option(10, help="decode eval_dataset greedily and score it with the live AR every this "
                                      "many RL steps; the last step always evaluates. Range: an integer >= 1.")
    eval_max_rows: int = option(64, help="at most this many eval_dataset rows decoded at each evaluation. "
                                         "Range: an integer >= 1.")
    av: str = option("", help="the warm-started AV checkpoint dir (HF dir + nla_meta.yaml); also the frozen "
                              "reference of the KL term. Required: a path.")
    ar: str = option("", help="the warm-started AR checkpoint dir (HF dir + value_head.safetensors + "
                              "nla_meta.yaml); trained online. Required: a path.")
    steps: int = option(50, help="RL steps in the whole run (each one rollout); the LR schedule spans them. "
                                 "Range: an integer >= 1.")
    allow_mixed_provenance: bool = option(False, help="run even when the AV, the AR and the datasets record "
                                                      "different subjects, layers or tokenizers "
                                                      "(nla.core.provenance): a warning instead of the error.")
    rollout: RolloutConfig = option(default_factory=RolloutConfig, help="sampling: prompts and samples per "
                                                                        "step, the response cap, decoding.")
    loss: LossConfig = option(default_factory=LossConfig, help="advantages and the policy loss "
                                                               "(nla.rl.algorithms).")
    optimiser: OptimiserConfig = option(default_factory=OptimiserConfig, help="the optimisers (AdamW; decay, "
                                                                              "warmup and clipping for every "
                                                                              "trained role) and the update "
                                                                              "layout.")
    reward: RewardConfig = option(default_factory=RewardConfig, help="how a sample's reward is made and served.")
    reconstructor: ReconstructorConfig = option(default_factory=ReconstructorConfig, help="the online AR's "
                                                                                          "training.")
    checkpointing: CheckpointingConfig = option(default_factory=CheckpointingConfig, help="how often to save, "
                                                                                          "how many to keep.")
    backend: BackendConfig = option(default_factory=BackendConfig, help="where the roles run.")
    lora: LoRAConfig = option(default_factory=LoRAConfig, help="LoRA for the AV (and, with "
                                                               "reconstructor.lora_r, the AR's alpha, dropout "
                                                               "and targets).")

    def __post_init__(self) -> None:
        for name in ("av", "ar", "dataset", "out_dir"):
            if not getattr(self, name):
                _bad(name, "a path", getattr(self, name))
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                _bad(name, f"a {cls.__name__} (a mapping in YAML)", getattr(self, name))
        _positive_ints("", self, "steps", "eval_every", "eval_max_rows", "log_every")
        _optional_positive_int("", "stop_after_steps", self.stop_after_steps)
        check_threads("RLConfig.threads", self.threads)
        if self.dtype not in _DTYPES:
            _bad("dtype", " | ".join(_DTYPES), self.dtype)
        from nla.util.precision import AUTOCAST_DTYPES

        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            _bad("autocast", f"null or one of {list(AUTOCAST_DTYPES)}", self.autocast)
        if self.autocast is not None and self.dtype != "float32":
            _bad("autocast", f"null with dtype {self.dtype!r} (autocast runs bf16 matmuls over fp32 weights: set "
                 "dtype: float32 or autocast: null)", self.autocast)
        from nla.train.optim import ADAMW_IMPLS

        if self.adamw not in ADAMW_IMPLS:
            _bad("adamw", f"one of {list(ADAMW_IMPLS)}", self.adamw)
        if self.autocast is not None and self.backend.name != "local":
            _bad("autocast", f"null with backend.name {self.backend.name!r} (autocast runs the roles of this "
                 "process: set backend.name: local or autocast: null)", self.autocast)
        ro, opt = self.rollout, self.optimiser
        est = ADVANTAGE_ESTIMATORS[self.loss.advantage]
        if est.needs_groups and ro.n_samples_per_prompt < 2:
            _bad("rollout.n_samples_per_prompt", f">= 2 for the group baseline of loss.advantage {est.name!r}",
                 ro.n_samples_per_prompt)
        n = ro.samples_per_step
        if opt.global_batch_size is not None:
            if n % opt.global_batch_size:
                _bad("optimiser.global_batch_size",
                     f"a positive divisor of rollout_batch_size x n_samples_per_prompt = {n}", opt.global_batch_size)
            if opt.global_batch_size != n and not opt.allow_multiple_updates:
                _bad("optimiser.global_batch_size",
                     f"{n} (= rollout_batch_size x n_samples_per_prompt: one optimiser step per rollout, the "
                     "on-policy recipe); set optimiser.allow_multiple_updates: true to take several off-policy "
                     "steps per rollout", opt.global_batch_size)
        if not self.reward.overlong_buffer_len < ro.max_response_len:
            _bad("reward.overlong_buffer_len", f"an integer in [0, rollout.max_response_len={ro.max_response_len})",
                 self.reward.overlong_buffer_len)
        if opt.warmup_steps > self.steps:
            _bad("optimiser.warmup_steps", f"an integer in [0, steps={self.steps}]", opt.warmup_steps)

    @property
    def samples_per_step(self) -> int:
        return self.rollout.samples_per_step

    @property
    def updates_per_rollout(self) -> int:
        return self.samples_per_step // (self.optimiser.global_batch_size or self.samples_per_step)

    @property
    def ar_lr_value(self) -> float:
        """The AR's learning rate: ``reconstructor.lr``, or ``optimiser.lr`` when null."""
        return self.reconstructor.lr if self.reconstructor.lr is not None else self.optimiser.lr

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RLConfig:
        """Build from nested mappings (the YAML layout) and/or dotted keys (``loss.kl_coef``).

        Unknown keys are refused with the valid ones; a section key given at the top level
        (the flat layout of older configs) is refused with the section it belongs to.
        """
        data = _nest(data)
        valid = {f.name for f in dataclasses.fields(cls)}
        for key, value in list(data.items()):
            if key == "backend" and isinstance(value, str):  # the flat layout's `backend: ray`
                raise ValueError(f"RLConfig.backend is a section; write `backend: {{name: {value}}}` in YAML, or "
                                 f"--set backend.name={value} (or --backend {value})")
            if key in SECTIONS:
                if value is None:
                    del data[key]  # an empty section in YAML: its defaults
                else:
                    _check_section_keys(key, SECTIONS[key], value)
            elif key in _FLAT_KEYS and key not in valid:
                section, sub = _FLAT_KEYS[key].split(".")
                moved = f"belongs to section {section!r}" if sub == key else f"is now {section}.{sub}"
                raise ValueError(
                    f"RLConfig: key {key!r} {moved}; write it as `{section}: {{{sub}: ...}}` in YAML, "
                    f"or --set {section}.{sub}=..."
                )
            elif key == "scale_by_std":
                raise ValueError("RLConfig: key 'scale_by_std' is gone; GRPO without std scaling is "
                                 "`loss: {advantage: drgrpo}` (--set loss.advantage=drgrpo)")
            elif key not in valid:
                raise ValueError(f"RLConfig: unknown config key {key!r}; valid keys: {sorted(valid)}")
        # Types first, sections included (YAML 1.1's "1e-4" strings become floats there), so every
        # __post_init__ compares numbers.
        data = check_config_types(cls, data)
        sections = {key: value if isinstance(value, SECTIONS[key]) else SECTIONS[key](**value)
                    for key, value in data.items() if key in SECTIONS}
        return cls(**{k: v for k, v in data.items() if k not in SECTIONS}, **sections)

    def replace(self, **changes: Any) -> RLConfig:
        """A copy with top-level fields replaced; a section given as a mapping updates only the keys it names."""
        data = self.to_dict()
        for key, value in changes.items():
            if key in SECTIONS and isinstance(value, dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return RLConfig.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys of the flat layout (before sections) -> their dotted place now. The AV's ``lr`` is the
# optimiser's (the reconstructor's own ``lr`` was ``ar_lr``), hence the explicit renames.
_FLAT_KEYS = {
    **{f.name: f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)},
    "lr": "optimiser.lr", "ar_lr": "reconstructor.lr", "ar_max_length": "reconstructor.max_length",
}


def _nest(data: dict[str, Any]) -> dict[str, Any]:
    """``{"loss.kl_coef": 0.1, "loss": {"eps_low": 0.1}}`` -> ``{"loss": {"eps_low": 0.1, "kl_coef": 0.1}}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if "." in key:
            section, sub = key.split(".", 1)
            if section not in SECTIONS:
                raise ValueError(f"RLConfig: unknown section {section!r} in {key!r}; sections: {sorted(SECTIONS)}")
            inner = out.setdefault(section, {})
            if isinstance(inner, dict):
                inner = out[section] = dict(inner)  # never write into the caller's mapping
            else:
                raise ValueError(f"RLConfig.{section}: expected a mapping, found {inner!r}")
            inner[sub] = value
        elif key in SECTIONS and isinstance(value, dict):
            out[key] = {**value, **out.get(key, {})}
        else:
            out[key] = value
    return out


def _check_section_keys(name: str, cls: type, data: Any) -> None:
    if isinstance(data, cls):
        return
    if not isinstance(data, dict):
        raise ValueError(f"RLConfig.{name}: expected a mapping of {cls.__name__} keys, found {data!r}")
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"RLConfig.{name}: unknown config key(s) {unknown}; valid keys: {sorted(valid)}")


def load_rl_config(path: str | os.PathLike | None = None, overrides: dict | list[str] | None = None) -> RLConfig:
    """Read a YAML config (optional) and apply overrides on top (``section.key=value`` for section keys)."""
    data = _nest(read_config_file(path, "RLConfig config")) if path is not None else {}
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for key, value in _nest(overrides or {}).items():
        if key in SECTIONS and isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return RLConfig.from_dict(data)


def save_rl_config(cfg: RLConfig, path: str | os.PathLike) -> None:
    save_config(cfg, path)


__all__ = [
    "BACKENDS", "SECTIONS", "BackendConfig", "CheckpointingConfig", "LoRAConfig", "LossConfig", "OptimiserConfig",
    "RLConfig", "ReconstructorConfig", "RewardConfig", "RolloutConfig", "load_rl_config", "save_rl_config",
]
