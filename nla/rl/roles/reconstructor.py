"""The reconstructor role: rewards from the AR's *live* weights, and its updates on the same rollouts.

``ReconstructorWorker.mse_batch(items) -> mse_nrm`` is what the reward service calls (a bound
method: every reward comes from this very module, no copy, no reload); it returns MSEs, and
``nla.core.reward.make_rewards`` alone turns them into rewards. ``update(explanations, golds)`` is one
supervised step.

How the step's reward forwards relate to its update is a strategy the role is given
(``window``): ``PlainScoring`` scores without autograd and the update runs every row;
``FusedRewardWindow`` makes the reward forwards the update's forwards (``begin_rollout``).
``default_window`` picks the fused one exactly where it computes the plain step.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nla.core import arch
from nla.core.reconstructor import Reconstructor, reconstruction_loss, tokenize_ar_texts
from nla.core.sidecar import NLAConfig
from nla.core.vectors import mse_nrm
from nla.rl.distributed import DataParallel
from nla.rl.kernels import rank_micro_batches
from nla.rl.roles.trainable import LOCAL, OptimSettings, Trainable

__all__ = ["FusedRewardWindow", "PlainScoring", "REWARD_SUB_BATCH", "ReconstructorWorker", "RewardWindow",
           "default_window", "has_dropout"]

logger = logging.getLogger(__name__)

# Rows per padded AR forward of a reward call (rows ordered longest first). On the default
# world (2 cores, fp32) 64 rows in one batch: 0.252 s forward+backward, sorted sub-batches of
# 32: 0.212 s, 16: 0.210 s, 8: 0.223 s.
REWARD_SUB_BATCH = 32


DROPOUT_CONFIG_KEYS = ("attention_dropout", "hidden_dropout", "activation_dropout", "dropout", "attn_pdrop",
                       "resid_pdrop", "embd_pdrop")


def has_dropout(module: nn.Module) -> bool:
    """Whether training mode may compute something else than eval mode: a dropout module or a
    dropout config value (``DROPOUT_CONFIG_KEYS``) above 0 (HF passes attention dropout to the
    attention kernel as a number)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()):
        return True
    cfg = getattr(module, "config", None)
    return any(isinstance(v := getattr(cfg, k, 0), (int, float)) and v > 0 for k in DROPOUT_CONFIG_KEYS)



class RewardWindow:
    """How one RL step's reward forwards relate to its AR update (the AR role's strategy).

    ``open`` starts a step (``begin_rollout``); ``mse_rows`` scores one padded batch;
    ``close(explanations, golds)`` is called by the update and returns ``(k, mse_sum)``: its first
    ``k`` rows already hold their summed gradient (whose summed ``mse_nrm`` is ``mse_sum``).
    """

    name = "plain"

    def open(self, worker: ReconstructorWorker) -> None:
        """Start a step's window."""

    def mse_rows(self, worker: ReconstructorWorker, explanations: list[str], gold: Tensor) -> Tensor:
        """``mse_nrm`` [n] of one padded batch (reward layout), no gradient."""
        return mse_nrm(worker.predict(explanations), gold, worker.scale)

    def scored(self, items: list[tuple[str, Tensor]]) -> None:
        """The items of one ``mse_batch`` call, in order."""

    def close(self, worker: ReconstructorWorker, explanations: list[str], golds: Tensor) -> tuple[int, float]:
        return 0, 0.0


class PlainScoring(RewardWindow):
    """Rewards without autograd; the update runs a forward and backward of every row."""


class FusedRewardWindow(RewardWindow):
    """The reward forward doubles as the AR update's forward.

    The reward of a sample is the live AR's prediction on its explanation, made with the very
    weights the step's AR update starts from (nothing changes the AR in between), and the update
    trains on exactly those samples. So every ``mse_batch`` call between ``open`` and the update
    runs its forward with autograd on and backpropagates the sum of its rows' ``mse_nrm`` at once
    (no graph is kept); the update then computes only the rows it has not seen (replay rows),
    scales the sum to the mean and steps. The reward values are those of the plain path (the
    same forward, read the same way); the gradient is the plain update's to float tolerance
    (the reward layout is left-padded, the training layout right-padded: the step-0 guard holds
    them equal). Exact only when training mode computes what eval mode does (no dropout) and the
    AR is not sharded (``default_window``). Calls outside a window (evaluation, tests) take the
    plain no-grad path.

    Over replicated ranks (``Replicas``) each rank scores, and so backpropagates, its share of
    every reward call (``DISPATCH``: contiguous, in rank order); the update then skips the rows
    the ranks' windows hold together, and the one gradient all-reduce of the step sums the
    shares (each scaled to the global mean), as the plain step sums its micro-batches.
    """

    name = "fused"

    def __init__(self) -> None:
        self._calls: list[list[tuple[str, Tensor]]] | None = None  # this rank's items of each reward call
        self._mse_sum = 0.0

    def open(self, worker: ReconstructorWorker) -> None:
        self._calls, self._mse_sum = [], 0.0
        worker.opt.zero_grad(set_to_none=True)

    def mse_rows(self, worker: ReconstructorWorker, explanations: list[str], gold: Tensor) -> Tensor:
        if self._calls is None:
            return super().mse_rows(worker, explanations, gold)
        # The same forward as the plain path (reward layout), with autograd on, in training mode
        # (which computes what eval mode does: no dropout).
        ar = worker.ar
        was = ar.training
        ar.train()
        try:
            ids, mask, kw = worker.read(explanations, "left")
            with torch.enable_grad():
                pred = ar.predict(ids, mask, **kw)
                per_row = mse_nrm(pred, gold.to(pred.device), worker.scale)  # reconstruction_loss's terms
                per_row.sum().backward()
        finally:
            ar.train(was)
        self._mse_sum += float(per_row.detach().sum())
        return mse_nrm(pred.detach().float().cpu(), gold, worker.scale)  # exactly the plain path's value

    def scored(self, items: list[tuple[str, Tensor]]) -> None:
        if self._calls is not None:
            self._calls.append(list(items))

    def close(self, worker: ReconstructorWorker, explanations: list[str], golds: Tensor) -> tuple[int, float]:
        """How many leading rows of the update the ranks' windows already backpropagated (0 when there
        was no window, or when their items are not the update's first rows), and this rank's share
        of their summed MSE. Collective over the group when it has several ranks."""
        calls, self._calls = self._calls, None
        if calls is None:
            return 0, 0.0
        # The windows' rows in the update's order: reward call by reward call, each call's items
        # in rank order (every rank is called with its share, possibly empty). Compared by
        # digest so that the ranks exchange a few bytes per row, not the texts and vectors.
        per_rank = worker.dp.gather([[_row_digest(e, g) for e, g in call] for call in calls])
        n_calls = {len(r) for r in per_rank}
        if len(n_calls) != 1:
            return _drop_window(worker, f"the ranks' reward windows hold different numbers of calls ({sorted(n_calls)})")
        order = [d for c in range(len(calls)) for r in per_rank for d in r[c]]
        k = len(order)
        if k and not (k <= len(explanations)
                      and order == [_row_digest(explanations[i], golds[i]) for i in range(k)]):
            return _drop_window(worker, f"the {k} samples scored since begin_rollout are not the update's first rows")
        return k, self._mse_sum


def _drop_window(worker: ReconstructorWorker, why: str) -> tuple[int, float]:
    logger.warning("AR update: %s; their gradients are dropped and every row is recomputed", why)
    worker.opt.zero_grad(set_to_none=True)
    return 0, 0.0


def _row_digest(explanation: str, gold: Tensor) -> bytes:
    """A 16-byte digest of one (explanation, gold vector) row: the text and the vector's fp32 bytes."""
    h = hashlib.blake2b(explanation.encode(), digest_size=16)
    h.update(gold.detach().float().cpu().contiguous().numpy().tobytes())
    return h.digest()


def default_window(ar: nn.Module, dp: DataParallel) -> RewardWindow:
    """``FusedRewardWindow`` where it computes the plain step: an unsharded AR (one process, or
    replicated ranks; an FSDP group, even of one rank, is left on the plain path: its forwards
    are collectives) with no dropout; else ``PlainScoring``."""
    sharded = dp.shards or any(arch.is_sharded(m) for m in ar.modules())
    return FusedRewardWindow() if not sharded and not has_dropout(ar) else PlainScoring()


class ReconstructorWorker(Trainable):
    """The AR: ``mse_nrm`` from its *live* weights, and supervised MSE updates on the same rollouts.

    ``mse_batch`` is handed to the reward service as a bound method, so every reward is
    computed from this very module: no copy, no reload. Sharded, each rank scores its share of
    the items (``DISPATCH``) in as many forwards as the largest share needs. ``window``: how the
    step's reward forwards relate to its update (``default_window(ar, dp)`` when None).
    """

    def __init__(self, ar: Reconstructor, tokenizer: Any, sidecar: NLAConfig, optim: OptimSettings,
                 max_length: int, micro_batch_size: int, device: torch.device, dp: DataParallel = LOCAL,
                 window: RewardWindow | None = None) -> None:
        self.ar, self.tokenizer, self.sidecar = ar, tokenizer, sidecar
        self.scale = sidecar.mse_scale_value()
        self.max_length, self.micro_batch_size, self.device = max_length, micro_batch_size, device
        self._setup_optim(ar, optim, dp)
        self.window = window if window is not None else default_window(ar, dp)

    @property
    def fuse_reward(self) -> bool:
        """Whether the reward forwards are the update's forwards (``FusedRewardWindow``)."""
        return isinstance(self.window, FusedRewardWindow)

    @fuse_reward.setter
    def fuse_reward(self, on: bool) -> None:
        self.window = FusedRewardWindow() if on else PlainScoring()

    def encode(self, explanations: list[str], padding_side: str = "right") -> dict[str, Tensor]:
        """The AR template around each explanation, tokenized and padded on ``padding_side``. A pair of
        several blocks is given AR texts already (the loop names each row's block: ``RLData.ar_inputs``)."""
        texts = list(explanations) if self.sidecar.layers is not None else [self.sidecar.ar_text(e) for e in explanations]
        return tokenize_ar_texts(self.tokenizer, texts, self.max_length, padding_side)

    def read(self, explanations: list[str], padding_side: str = "right") -> tuple[Tensor, Tensor, dict[str, Any]]:
        """``encode``'s ids and mask on the AR's device, and ``predict``'s keyword arguments: each row's block
        for an AR reading each row at its own block (``Reconstructor.exits``), from the AR text that names it."""
        enc = self.encode(explanations, padding_side)
        kw: dict[str, Any] = {}
        if getattr(self.ar, "exits", None) is not None:
            kw["blocks"] = [self.sidecar.ar_text_layer(t) for t in explanations]
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device), kw

    @torch.no_grad()
    def predict(self, explanations: list[str], padding_side: str = "left") -> Tensor:
        """AR predictions [n, d] (fp32, CPU) for explanation texts, in one padded batch.

        The reward path pads on the left like a batched inference server; the training path
        pads on the right. ``layout_check`` asserts both give the same numbers.
        """
        was = self.ar.training
        self.ar.eval()
        try:
            ids, mask, kw = self.read(explanations, padding_side)
            pred = self.ar.predict(ids, mask, **kw)
        finally:
            self.ar.train(was)
        return pred.float().cpu()

    def begin_rollout(self) -> None:
        """Open the reward window of one RL step (``window``): with ``FusedRewardWindow`` the
        rollout's rewards become its AR gradients."""
        self.window.open(self)

    def mse_batch(self, items: list[tuple[str, Tensor]]) -> Tensor:
        """``mse_nrm`` [n] for (explanation, RAW gold [d]) pairs with the live AR weights.

        The rows run longest first in sub-batches of ``REWARD_SUB_BATCH`` (left-padded): a
        batch in rollout order was ~25% padding on the default world, sorted sub-batches ~10%.
        Each row's prediction does not depend on its neighbours (float rounding aside), so a
        batch split over AR ranks scores what one rank would.
        """
        exps = [e for e, _ in items]
        gold = torch.stack([g for _, g in items]).float() if items else torch.zeros(0, self.sidecar.d_model)
        order = sorted(range(len(exps)), key=lambda i: -len(exps[i]))
        out = torch.empty(len(exps))
        forwards = math.ceil(len(order) / REWARD_SUB_BATCH)
        # Sharded, each rank scores its share of a batch: all run as many forwards (collectives);
        # replicated ranks' forwards are their own.
        forwards = self.dp.max_count(forwards) if self.dp.world > 1 and self.dp.shards else forwards
        for k in range(forwards):
            rows = order[k * REWARD_SUB_BATCH : (k + 1) * REWARD_SUB_BATCH]
            if rows:
                out[rows] = self.window.mse_rows(self, [exps[i] for i in rows], gold[rows])
            else:  # a dummy forward, so FSDP's all-gathers pair with the other ranks'
                dummy = "" if self.sidecar.layers is None else self.sidecar.ar_text("", layer=self.sidecar.layers[-1])
                self.window.mse_rows(self, [dummy], torch.ones(1, gold.shape[1]))
        self.window.scored(items)
        return out

    def layout_check(self, explanations: list[str], golds: Tensor) -> float:
        """Max relative difference of per-sample MSE between the reward and training layouts."""
        reward_mse = mse_nrm(self.predict(explanations, "left"), golds, self.scale)
        train_mse = mse_nrm(self.predict(explanations, "right"), golds, self.scale)
        return float(((reward_mse / train_mse.clamp_min(1e-12)) - 1).abs().max())

    def save_model(self, directory: str | Path, **provenance: Any) -> None:
        """HF dir + head + sidecar (role ar), written by the answering rank. With LoRA
        (``reconstructor.lora_r``) the dir holds the merged AR, and ``<dir>_adapter`` the adapter."""
        from nla.core.lora import adapter_dir_for, has_lora, merged_state_dict, save_adapter

        lora = has_lora(self.ar)
        full = self.dp.full_state_dict(self.ar)  # None locally: the module's own
        state = merged_state_dict(self.ar, full) if lora else full
        if self.dp.answers:
            self.ar.save_pretrained(directory, self.sidecar, state_dict=state, **provenance)
            if lora:  # the adapter alone too: RL resumes from it on the warm-started AR
                save_adapter(self.ar, adapter_dir_for(directory), provenance.get("parent_ar", ""), state=full)

    def update(self, explanations: list[str], golds: Tensor) -> dict[str, float]:
        """One supervised step: mean ``mse_nrm`` over all rows (right-padded layout, this rank's share).

        Rows whose gradients the reward window already holds (``begin_rollout``) are not run
        again: their summed gradient is scaled to their share of the mean, and only the other
        rows (replay rows) run here.
        """
        n = len(explanations)
        done, done_mse = self.window.close(self, explanations, golds)
        if n == 0:
            return {"ar_loss": float("nan"), "ar_rows": 0.0}
        dp = self.dp
        self.ar.train()
        total = 0.0
        if done:
            for p in self.ar.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / n)
            total = done_mse / n
        mine = dp.my_rows(torch.arange(done, n))
        # Micro-batches of texts of similar length pad less; the loss is a mean over rows, so
        # each micro-batch's weight (its share of rows) keeps the step the same on any order.
        mine = mine[torch.sort(torch.tensor([-len(explanations[i]) for i in mine.tolist()]), stable=True).indices]
        # (Windows covering every row leave nothing to run, on every rank alike.)
        chunks = rank_micro_batches(dp, mine, n - done, self.micro_batch_size) if done < n else ()
        for idx, real in chunks:
            ids, mask, kw = self.read([explanations[i] for i in idx.tolist()], "right")
            loss, _ = reconstruction_loss(self.ar, ids, mask, golds[idx], self.scale, **kw)
            w = len(idx) / n if real else 0.0
            (loss * (w * dp.grad_scale)).backward()
            total += float(loss.detach()) * w
        stats = {f"ar_{k}": v for k, v in self._step().items()}
        stats.update(ar_loss=dp.sum({"ar_loss": total})["ar_loss"], ar_rows=float(n))
        return stats

