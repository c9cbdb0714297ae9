"""Training utilities shared by the warm-start stages and the RL loop.

Nothing here knows about NLA models: optimiser + schedule, micro-batching with
gradient accumulation, a non-finite-gradient guard, atomic checkpoint
directories, resumable training state, and a deterministic data cursor.

Departures from the usual recipe:
1. A step whose gradient norm is non-finite is skipped (no optimiser update, gradients
   dropped) but the LR schedule still advances, so the schedule stays a function of the
   global step and a resumed run lines up with an uninterrupted one.
2. Training state is saved as plain tensors / dicts and loaded with
   ``torch.load(weights_only=True)``: nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nla.health import StuckRunMonitor, check_finite_loss, check_micro_batch_memory
from nla.threads import adapt_threads
from nla.validation import write_checksums

logger = logging.getLogger(__name__)

TRAINING_STATE_FILE = "training_state.pt"


# ---------------------------------------------------------------- optimiser & schedule
def build_optimizer(
    params: Iterable[nn.Parameter] | nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    lr_scales: dict[str, float] | None = None,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (``requires_grad``) of ``params``.

    lr_scales: (``params`` a module) ``{submodule name: factor}``: that submodule's parameters
        form their own group at ``lr * factor`` (the schedule scales every group alike); the
        rest stay in the first group, at ``lr``."""
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"build_optimizer: lr must be a positive finite number, found {lr!r}")
    scales = {k: v for k, v in (lr_scales or {}).items() if v != 1.0}
    if scales and not isinstance(params, nn.Module):
        raise ValueError("build_optimizer: lr_scales names submodules, so params must be a module")
    if isinstance(params, nn.Module):
        named = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    else:
        named = [("", p) for p in params if p.requires_grad]
    if not named:
        raise ValueError("build_optimizer: no trainable parameters (all have requires_grad=False)")
    for name, factor in scales.items():
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"build_optimizer: lr_scales[{name!r}] must be a positive finite number, found {factor!r}")
    groups: list[dict[str, Any]] = [{"params": []}]
    extra = {name: {"params": [], "lr": lr * factor} for name, factor in scales.items()}
    for n, p in named:
        owner = next((name for name in extra if n == name or n.startswith(name + ".")), None)
        (groups[0] if owner is None else extra[owner])["params"].append(p)
    for name, group in extra.items():
        if not group["params"]:
            raise ValueError(f"build_optimizer: lr_scales names {name!r}, which holds no trainable parameter")
    groups += list(extra.values())
    if not groups[0]["params"]:
        groups.pop(0)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=tuple(betas))


def warmup_cosine(
    opt: torch.optim.Optimizer, warmup: int, total: int, min_lr_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr`` at ``total``."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    if total <= 0 or warmup < 0 or warmup > total:
        raise ValueError(f"warmup_cosine: need 0 <= warmup <= total and total > 0, found warmup={warmup}, total={total}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"warmup_cosine: min_lr_ratio must be in [0, 1], found {min_lr_ratio}")
    return get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=min_lr_ratio
    )


def sqrt_lr(batch: int, base_lr: float = 2e-5, base_batch: int = 256) -> float:
    """LR scaled with the square root of the batch: ``base_lr * sqrt(batch / base_batch)`` (DESIGN §7)."""
    if batch <= 0 or base_batch <= 0:
        raise ValueError(f"sqrt_lr: batch sizes must be positive, found batch={batch}, base_batch={base_batch}")
    return base_lr * math.sqrt(batch / base_batch)


def warn_if_lr_far(lr: float, batch: int, base_lr: float = 2e-5, base_batch: int = 256, factor: float = 2.0) -> bool:
    """Warn (and return True) when ``lr`` is more than ``factor`` x away from :func:`sqrt_lr`.

    Only a hint: tiny models train well at much larger LRs than the published 7B recipe.
    """
    ref = sqrt_lr(batch, base_lr, base_batch)
    far = lr > factor * ref or lr < ref / factor
    if far:
        logger.warning(
            "lr=%.3g is more than %gx away from the sqrt-scaled reference %.3g for batch %d "
            "(%.1e at batch %d); fine for tiny models, check it for real ones",
            lr, factor, ref, batch, base_lr, base_batch,
        )
    return far


# ---------------------------------------------------------------- micro-batching
def micro_batches(n_rows: int, micro_batch_size: int) -> list[tuple[slice, float]]:
    """Split ``n_rows`` into micro-batch slices with their loss weights.

    Each weight is ``rows_in_micro / n_rows``: summing ``weight * mean_loss(micro)`` over the
    micro-batches equals the mean loss of the whole batch, so an accumulated 4 x 2 step
    gives the gradient of one batch of 8.
    """
    if n_rows <= 0 or micro_batch_size <= 0:
        raise ValueError(f"micro_batches: need positive sizes, found n_rows={n_rows}, micro={micro_batch_size}")
    out = []
    for start in range(0, n_rows, micro_batch_size):
        stop = min(start + micro_batch_size, n_rows)
        out.append((slice(start, stop), (stop - start) / n_rows))
    return out


def optimizer_step_guarded(
    model: nn.Module | Iterable[nn.Parameter],
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    max_grad_norm: float | None,
) -> tuple[bool, float]:
    """Clip, then step unless the gradient is non-finite.  Returns ``(stepped, grad_norm)``.

    ``max_grad_norm`` None or <= 0 disables clipping (the norm is still measured). A skipped
    step drops the gradients; the scheduler advances either way (see module docstring).
    The caller counts skipped steps (``stepped == False``).
    """
    params = list(model.parameters()) if isinstance(model, nn.Module) else list(model)
    params = [p for p in params if p.grad is not None]
    clip = max_grad_norm if (max_grad_norm is not None and max_grad_norm > 0) else float("inf")
    if params:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        # FSDP2 gradients are DTensors: the norm is a sharded DTensor; its full value is the
        # global norm, the same on every rank.
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    else:
        grad_norm = 0.0
    stepped = math.isfinite(grad_norm)
    if stepped:
        opt.step()
    else:
        logger.warning("non-finite gradient norm (%s): optimizer step skipped", grad_norm)
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        with warnings.catch_warnings():
            # torch warns when the scheduler steps without an optimiser step; here that is intended.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
            sched.step()
    return stepped, grad_norm


# ---------------------------------------------------------------- atomic checkpoint dirs
def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    with contextlib.suppress(OSError):  # directory fsync is not supported everywhere
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_dir(final_path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; on clean exit it replaces ``final_path``.

    The previous ``final_path`` (if any) is kept until the new one is complete and fsynced,
    then swapped out by rename; an exception removes the temporary dir and leaves the old
    checkpoint untouched.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        # Each folder of weights records their SHA-256: a flipped bit is caught at load (nla.validation).
        for folder in sorted({f.parent for f in tmp.rglob("*.safetensors")}):
            write_checksums(folder)
        _fsync_tree(tmp)
        old = None
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, RuntimeError)) and not isinstance(exc, CheckpointSaveError):
            # torch.save on a full disk says only "[enforce fail at inline_container.cc] unexpected pos".
            free = shutil.disk_usage(final.parent).free
            raise CheckpointSaveError(
                f"saving the checkpoint {final} failed ({' '.join(str(exc).split())}); {free / 2**20:.0f} MB are free "
                f"on that disk now. The previous checkpoint is intact; free space (or pick another out_dir) and "
                "rerun with --resume"
            ) from exc
        raise


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (full disk, permissions); nothing partial was left in its place."""


# ---------------------------------------------------------------- RNG & training state
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as plain tensors / tuples (safe for weights_only loads)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gauss": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@dataclass
class TrainingState:
    """What :func:`load_training_state` returns; ``optimizer``/``scheduler`` are state dicts."""

    step: int
    data_cursor: dict[str, int]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    rng: dict[str, Any] | None
    extra: dict[str, Any]


def save_training_state(
    dir: str | os.PathLike,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    step: int,
    data_cursor: DataCursor | dict[str, int],
    rng: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``training_state.pt`` into ``dir`` (the checkpoint being built, usually an atomic_dir).

    ``rng`` defaults to :func:`capture_rng_state` now. ``extra`` holds small plain values
    (ints, floats, strings, tensors) a trainer needs back, e.g. counters.
    """
    cursor = data_cursor.state_dict() if isinstance(data_cursor, DataCursor) else dict(data_cursor)
    payload = {
        "step": int(step),
        "data_cursor": cursor,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng if rng is not None else capture_rng_state(),
        "extra": extra or {},
    }
    path = Path(dir) / TRAINING_STATE_FILE
    torch.save(payload, path)
    return path


def load_state_file(path: str | os.PathLike, what: str, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` (nothing is unpickled), with a damaged or truncated file
    named instead of torch's zip-reader message."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise ValueError(
            f"{path}: not a readable {what} ({' '.join(str(err).split())[:160]}); it is truncated or damaged (a "
            "kill while it was written?): resume from an earlier checkpoint, or start afresh with --overwrite"
        ) from None


def load_training_state(dir: str | os.PathLike, map_location: str | torch.device = "cpu") -> TrainingState:
    """Read ``training_state.pt`` from ``dir`` with ``weights_only=True`` (no unpickling)."""
    path = Path(dir) / TRAINING_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no training state at {path}: this checkpoint cannot be resumed (it was saved without "
            "optimizer state, or the save was interrupted); start a fresh run or pick another checkpoint"
        )
    payload = load_state_file(path, "training state", map_location)
    return TrainingState(
        step=int(payload["step"]),
        data_cursor=dict(payload["data_cursor"]),
        optimizer=payload["optimizer"],
        scheduler=payload["scheduler"],
        rng=payload["rng"],
        extra=dict(payload.get("extra") or {}),
    )


def apply_training_state(
    state: TrainingState,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    restore_rng: bool = True,
) -> None:
    optimizer.load_state_dict(state.optimizer)
    if scheduler is not None and state.scheduler is not None:
        scheduler.load_state_dict(state.scheduler)
    if restore_rng and state.rng is not None:
        restore_rng_state(state.rng)


# ---------------------------------------------------------------- data cursor
@dataclass
class DataCursor:
    """Deterministic pass over ``n`` rows: a fresh permutation per epoch keyed on ``(seed, epoch)``.

    The state is just ``(epoch, position)``, so a resumed run continues at the exact sample.
    """

    n: int
    seed: int
    epoch: int = 0
    position: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError(f"DataCursor: n must be positive, found {self.n}")

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next_indices(self, k: int) -> np.ndarray:
        """The next ``k`` row indices, continuing into the next epoch when this one runs out."""
        out: list[np.ndarray] = []
        need = k
        while need > 0:
            order = self.order(self.epoch)
            take = order[self.position : self.position + need]
            out.append(take)
            need -= len(take)
            self.position += len(take)
            if self.position >= self.n:
                self.epoch += 1
                self.position = 0
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["n"]) != self.n or int(state["seed"]) != self.seed:
            raise ValueError(
                f"data cursor mismatch: checkpoint was saved for n={state['n']}, seed={state['seed']}, "
                f"this run has n={self.n}, seed={self.seed}; resume with the same dataset and seed"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


# ---------------------------------------------------------------- checkpoint discovery
def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    """The highest ``step_*`` directory under ``ckpt_root`` holding a training state, or None."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return None
    cands = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / TRAINING_STATE_FILE).is_file()),
        key=lambda p: p.name,
    )
    return cands[-1] if cands else None


def prune_checkpoints(ckpt_root: str | os.PathLike, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` ``step_*`` directories (``keep_last <= 0`` keeps all)."""
    if keep_last <= 0:
        return
    root = Path(ckpt_root)
    dirs = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")), key=lambda p: p.name)
    for p in dirs[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)


def resolve_device(spec: str) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu; anything else is checked, then passed to torch.device."""
    from nla.validation import check_device

    check_device(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, found {name!r}")
    return _DTYPES[name]


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


def checkpoints_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def find_resume_checkpoint(out_dir: str | os.PathLike) -> Path:
    """The checkpoint ``--resume`` continues from; a clear error when there is none."""
    root = checkpoints_root(out_dir)
    last = latest_checkpoint(root)
    if last is None:
        raise FileNotFoundError(
            f"--resume: no resumable checkpoint under {root} (expected step_* dirs with {TRAINING_STATE_FILE}); "
            "run without --resume to start fresh, or point out_dir at the earlier run"
        )
    return last


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

    from nla.metrics import MetricsLogger
    from nla.train.config import save_config

    t0 = time.perf_counter()
    out = Path(cfg.out_dir)
    root = checkpoints_root(out)
    model = spec.model
    opt = build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas, spec.lr_scales)
    sched = warmup_cosine(opt, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    warn_if_lr_far(cfg.lr, cfg.batch_size)
    device = next(model.parameters()).device
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
