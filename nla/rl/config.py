"""The RL stage config: one frozen dataclass, YAML keys map one to one onto fields.

Defaults reproduce the published recipe (DESIGN §7) where it makes sense at any scale:
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

from nla.rl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES
from nla.train.config import load_config, save_config

# The one registry of backend names: config validation reads it, and the dispatcher
# (``nla.rl.backend.BACKEND_BUILDERS``) has one builder per name.
BACKENDS: dict[str, str] = {
    "local": "every role in this process, on one device (CPU or one GPU)",
    "ray": "each role a group of Ray actors with torch.distributed and FSDP2 (pip install 'nla[ray]')",
}


def _bad(name: str, expected: str, found: Any) -> None:
    raise ValueError(f"RLConfig.{name}: expected {expected}, found {found!r}")


@dataclass(frozen=True)
class RLConfig:
    """RL stage settings.

    Inputs:
      av / ar: warm-started AV and AR checkpoint dirs (HF dir + nla_meta.yaml). The AV is
        also the frozen KL reference.
      dataset: RL prompts parquet (``rl.parquet``: ``activation_vector`` RAW, optional world
        ``facts`` for faithfulness metrics).
      eval_dataset: optional held-out parquet scored every ``eval_every`` steps.
      out_dir: run directory (metrics, checkpoints/step_*, curves PNG, resolved config).
    Rollout:
      rollout_batch_size prompts x n_samples_per_prompt samples per step;
      global_batch_size: samples per optimiser step (null = all of a rollout: one step per
        rollout). A smaller value needs ``allow_multiple_updates: true`` (off-policy steps).
      max_response_len, temperature, top_p: sampling.
    Advantages / loss (``nla.rl.algorithms``):
      advantage: grpo | drgrpo | reinforce_baseline | gae (PPO, needs the value model);
      scale_by_std (GRPO), gamma / lam (GAE), eps_low / eps_high (clip-higher when
      eps_high > eps_low), dual_clip_c, kl_coef / kl_estimator (k1|k2|k3), loss_agg.
      DAPO: dynamic_sampling (drop zero-spread groups, refill up to max_refill_rounds),
      overlong_buffer_len / overlong_penalty_factor (soft overlong punishment; 0 = off).
      log_mse: reward = -log(mse) instead of -mse.
    Optimisers: lr (AV), ar_lr (AR, null = lr), value_lr (PPO value model, null = lr).
    Reward batching: reward_batch_size, reward_flush_seconds (RewardBatcher);
      generation_chunk_prompts: generate this many prompts at a time and score each chunk
      while the next generates (null = the whole rollout at once).
    step0_guard_tol: refuse to start when the padded reward path and the AR's training
      layout disagree by more than this ratio of MSEs.
    """

    av: str = ""
    ar: str = ""
    dataset: str = ""
    eval_dataset: str | None = None
    out_dir: str = "runs/rl"
    backend: str = "local"
    ray_address: str | None = None
    steps: int = 50
    stop_after_steps: int | None = None
    rollout_batch_size: int = 8
    n_samples_per_prompt: int = 8
    global_batch_size: int | None = None
    allow_multiple_updates: bool = False
    micro_batch_size: int = 16
    max_response_len: int = 150
    temperature: float = 1.0
    top_p: float = 1.0
    advantage: str = "grpo"
    scale_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None
    kl_coef: float = 0.01
    kl_estimator: str = "k3"
    loss_agg: str = "token-mean"
    dynamic_sampling: bool = False
    max_refill_rounds: int = 2
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    log_mse: bool = False
    lr: float = 1e-5
    ar_lr: float | None = None
    value_lr: float | None = None
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    ar_max_length: int = 256
    reward_batch_size: int = 64
    reward_flush_seconds: float = 0.05
    generation_chunk_prompts: int | None = None
    step0_guard_tol: float = 1e-4
    eval_every: int = 10
    eval_max_rows: int = 64
    save_every: int = 25
    keep_last: int = 2
    log_every: int = 1
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    tensorboard: bool = True
    progress: bool = True
    num_policy_workers: int = 1
    num_reconstructor_workers: int = 1

    def __post_init__(self) -> None:
        for name in ("av", "ar", "dataset", "out_dir"):
            if not getattr(self, name):
                _bad(name, "a path", getattr(self, name))
        if self.backend not in BACKENDS:
            _bad("backend", f"one of {sorted(BACKENDS)}", self.backend)
        for name in ("steps", "rollout_batch_size", "n_samples_per_prompt", "micro_batch_size", "max_response_len",
                     "ar_max_length", "reward_batch_size", "eval_every", "eval_max_rows", "save_every", "log_every",
                     "num_policy_workers", "num_reconstructor_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                _bad(name, "a positive integer", v)
        if self.generation_chunk_prompts is not None and (
                not isinstance(self.generation_chunk_prompts, int) or self.generation_chunk_prompts <= 0):
            _bad("generation_chunk_prompts", "a positive integer or null", self.generation_chunk_prompts)
        if self.stop_after_steps is not None and (not isinstance(self.stop_after_steps, int) or self.stop_after_steps <= 0):
            _bad("stop_after_steps", "a positive integer or null", self.stop_after_steps)
        if self.n_samples_per_prompt < 2 and self.advantage in ("grpo", "drgrpo"):
            _bad("n_samples_per_prompt", f">= 2 for the group baseline of {self.advantage!r}", self.n_samples_per_prompt)
        if self.dynamic_sampling and self.n_samples_per_prompt < 2:
            _bad("n_samples_per_prompt",
                 ">= 2 with dynamic_sampling: true (a group of one sample has no reward spread, so dynamic "
                 "sampling would drop every group and never update); raise n_samples_per_prompt or set "
                 "dynamic_sampling: false", self.n_samples_per_prompt)
        n = self.rollout_batch_size * self.n_samples_per_prompt
        if self.global_batch_size is not None:
            if not isinstance(self.global_batch_size, int) or self.global_batch_size <= 0 or n % self.global_batch_size:
                _bad("global_batch_size", f"a positive divisor of rollout_batch_size x n_samples_per_prompt = {n}",
                     self.global_batch_size)
            if self.global_batch_size != n and not self.allow_multiple_updates:
                _bad("global_batch_size",
                     f"{n} (= rollout_batch_size x n_samples_per_prompt: one optimiser step per rollout, the on-policy "
                     "recipe); set allow_multiple_updates: true to take several off-policy steps per rollout",
                     self.global_batch_size)
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            _bad("advantage", f"one of {sorted(ADVANTAGE_ESTIMATORS)}", self.advantage)
        if self.kl_estimator not in KL_ESTIMATORS:
            _bad("kl_estimator", f"one of {sorted(KL_ESTIMATORS)}", self.kl_estimator)
        if self.loss_agg not in LOSS_AGG_MODES:
            _bad("loss_agg", f"one of {sorted(LOSS_AGG_MODES)}", self.loss_agg)
        for name in ("lr", "temperature", "reward_flush_seconds", "step0_guard_tol"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                _bad(name, "a positive finite number", v)
        for name in ("ar_lr", "value_lr"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                _bad(name, "a positive finite number or null (= lr)", v)
        if not 0 < self.top_p <= 1:
            _bad("top_p", "a number in (0, 1]", self.top_p)
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            _bad("eps_low/eps_high", "0 <= eps_low < 1 and eps_high >= 0", (self.eps_low, self.eps_high))
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            _bad("dual_clip_c", "a number > 1 or null", self.dual_clip_c)
        if self.kl_coef < 0:
            _bad("kl_coef", "a number >= 0", self.kl_coef)
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            _bad("gamma/lam", "numbers in [0, 1]", (self.gamma, self.lam))
        if not 0 <= self.overlong_buffer_len < self.max_response_len:
            _bad("overlong_buffer_len", f"an integer in [0, max_response_len={self.max_response_len})",
                 self.overlong_buffer_len)
        if self.max_refill_rounds < 0:
            _bad("max_refill_rounds", "an integer >= 0", self.max_refill_rounds)
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            _bad("warmup_steps", f"an integer in [0, steps={self.steps}]", self.warmup_steps)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            _bad("dtype", "float32 | bfloat16 | float16", self.dtype)

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def updates_per_rollout(self) -> int:
        return self.samples_per_step // (self.global_batch_size or self.samples_per_step)

    @property
    def ar_lr_value(self) -> float:
        return self.ar_lr if self.ar_lr is not None else self.lr

    @property
    def value_lr_value(self) -> float:
        return self.value_lr if self.value_lr is not None else self.lr

    def replace(self, **changes: Any) -> RLConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_rl_config(path: str | os.PathLike | None = None, overrides: dict | list[str] | None = None) -> RLConfig:
    """Read a YAML config (optional) and apply ``key=value`` overrides on top."""
    return load_config(RLConfig, path, overrides)


def save_rl_config(cfg: RLConfig, path: str | os.PathLike) -> None:
    save_config(cfg, path)
