"""The training loop shared by the AR and AV warm-starts.

Optimiser, schedule, micro-batching, the non-finite guard, logging, held-out evaluation, atomic
saves and resume; a stage plugs in its loss, evaluation and save through :class:`LoopSpec`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nla.train.checkpoint import (
    apply_training_state,
    capture_rng_state,
    checkpoint_dir_name,
    checkpoints_root,
    load_training_state,
    prune_checkpoints,
    restore_rng_state,
    save_training_state,
)
from nla.train.data import DataCursor
from nla.train.health import StuckRunMonitor, check_finite_loss, check_micro_batch_memory
from nla.train.optim import (
    build_optimizer,
    micro_batches,
    optimizer_step_guarded,
    warmup_cosine,
    warn_if_lr_far,
)
from nla.train.rundir import write_input_fingerprints
from nla.util.checkpoint_files import atomic_dir
from nla.util.precision import autocast, keep_heads_fp32, prepare_autocast
from nla.util.threads import adapt_threads

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What ``train_ar`` / ``train_av`` return.

    checkpoint_dir: the last checkpoint written (a loadable HF dir + sidecar + training state).
    metrics: the final metrics (last logged value of every key, plus the stage's summary).
    seconds: wall time of this invocation.
    """

    checkpoint_dir: Path
    metrics: dict[str, Any]
    seconds: float


# ---------------------------------------------------------------- the shared loop
MicroLoss = Callable[[np.ndarray], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass
class LoopSpec:
    """What a stage plugs into :func:`run_training_loop`.

    micro_loss(indices) -> (mean loss over those training rows, detached metrics to average).
    evaluate(step) -> held-out metrics (model is in eval mode and under no_grad).
    save_model(dir, step) -> extra metrics to record (e.g. smoke-check flags); writes the
        model files into ``dir`` (an atomic temp dir that becomes the checkpoint).
    """

    name: str
    model: nn.Module
    n_train: int
    micro_loss: MicroLoss
    evaluate: Callable[[int], dict[str, float]]
    save_model: Callable[[Path, int], dict[str, Any]]
    plot_keys: list[str]
    resume_from: Path | None = None
    lr_scales: dict[str, float] | None = None  # build_optimizer's: submodules trained at lr x factor


@contextlib.contextmanager
def _rng_preserved() -> Iterator[None]:
    # Evaluation and saving must not move the RNG streams, or a run split at a save point
    # would diverge from an uninterrupted one.
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


def run_training_loop(cfg: Any, spec: LoopSpec) -> TrainResult:
    """Optimiser, schedule, micro-batching, guard, logging, eval, atomic saves and resume.

    ``cfg`` is a stage config (``nla.train.config._TrainBase``); the schedule spans
    ``cfg.max_steps``; this call stops at ``cfg.stop_after_steps`` when set.
    """
    from tqdm.auto import tqdm

    from nla.train.config import save_config
    from nla.util.metrics import MetricsLogger

    t0 = time.perf_counter()
    out = Path(cfg.out_dir)
    root = checkpoints_root(out)
    model = spec.model
    opt = build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas, spec.lr_scales, impl=cfg.adamw)
    sched = warmup_cosine(opt, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    warn_if_lr_far(cfg.lr, cfg.batch_size)
    device = next(model.parameters()).device
    amp = getattr(cfg, "autocast", None)
    prepare_autocast(amp, device, f"{spec.name}.autocast")
    if amp is not None:
        keep_heads_fp32(model)
    check_micro_batch_memory(f"train {spec.name}", model, cfg.micro, cfg.max_length, device)
    cursor = DataCursor(n=spec.n_train, seed=cfg.seed)
    step, skipped = 0, 0
    if spec.resume_from is not None:
        state = load_training_state(spec.resume_from)
        apply_training_state(state, opt, sched)
        cursor.load_state_dict(state.data_cursor)
        step = state.step
        skipped = int(state.extra.get("skipped_steps", 0))
        logger.info("resuming %s from %s at step %d", spec.name, spec.resume_from, step)
    stop = min(cfg.max_steps, cfg.stop_after_steps or cfg.max_steps)
    metrics = MetricsLogger(out, spec.name, tensorboard=cfg.tensorboard)
    last_ckpt: Path | None = spec.resume_from
    summary: dict[str, Any] = {}
    model.train()
    stuck = StuckRunMonitor(spec.name)
    bar = tqdm(total=stop, initial=step, desc=f"train {spec.name}", disable=not cfg.progress)
    try:
        while step < stop:
            adapt_threads()
            idx = cursor.next_indices(cfg.batch_size)
            sums: dict[str, float] = {}
            total_loss = 0.0
            for sl, w in micro_batches(len(idx), cfg.micro):
                with autocast(device, amp):  # the forward only: backward follows its dtypes
                    loss, m = spec.micro_loss(idx[sl])
                (loss * w).backward()
                total_loss += float(loss.detach()) * w
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * w
            lr = opt.param_groups[0]["lr"]
            check_finite_loss(spec.name, step + 1, {"loss": total_loss, **sums}, f"lr={cfg.lr:g}", last_ckpt)
            stepped, grad_norm = optimizer_step_guarded(model, opt, sched, cfg.max_grad_norm)
            skipped += 0 if stepped else 1
            step += 1
            stuck.observe(step, grad_norm=grad_norm)
            bar.update(1)
            last = step == stop
            if step % cfg.log_every == 0 or last:
                metrics.log(step, loss=total_loss, lr=lr, grad_norm=grad_norm, skipped_steps=skipped, **sums)
                bar.set_postfix(loss=f"{total_loss:.4f}")
            if step % cfg.eval_every == 0 or last:
                with _rng_preserved(), torch.no_grad():
                    model.eval()
                    ev = spec.evaluate(step)
                    model.train()
                metrics.log(step, **ev)
                summary.update(ev)
            if step % cfg.save_every == 0 or last:
                with _rng_preserved():
                    final = root / checkpoint_dir_name(step)
                    with atomic_dir(final) as tmp:
                        model.eval()
                        extra = spec.save_model(tmp, step)
                        model.train()
                        save_config(cfg, tmp / "train_config.yaml")
                        write_input_fingerprints(tmp, cfg.to_dict())
                        save_training_state(tmp, opt, sched, step, cursor, extra={"skipped_steps": skipped})
                    prune_checkpoints(root, cfg.keep_last)
                    last_ckpt = final
                if extra:
                    metrics.log(step, **extra)
                    summary.update(extra)
    finally:
        bar.close()
    records = metrics.read()
    final_metrics: dict[str, Any] = {}
    for rec in records:
        final_metrics.update(rec)
    final_metrics.update(summary)
    final_metrics["skipped_steps"] = skipped
    final_metrics["stuck_warnings"] = stuck.warnings
    metrics.plot(out / f"{spec.name}_curves.png", spec.plot_keys, title=f"{spec.name} warm-start")
    metrics.close()
    if last_ckpt is None:
        raise RuntimeError(f"{spec.name}: no checkpoint written (stop step {stop} <= start step {step})")
    return TrainResult(checkpoint_dir=last_ckpt, metrics=final_metrics, seconds=time.perf_counter() - t0)
