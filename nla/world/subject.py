"""Pretraining the world's subject model: a small ``LlamaForCausalLM`` trained from scratch.

Next-token prediction alone teaches a small model to *retrieve* a fact when a slot needs it
(measured: it answers "Where was Leo now? At the ___" right on every held-out story) but not
to *carry* the story state at other positions: a linear probe of the residual stream at
random tokens finds the facts at chance (0.13-0.14 mean top-1 against 0.105, every layer of a
4-block model after 1,500 steps). So, like a model trained to keep a world model, the subject
also learns a state-tracking objective: a linear head on the output of block ``state_layer``
predicts the facts true at every story token (multi-label, binary cross-entropy summed over
facts, weight ``state_weight``). The head is dropped after pretraining; the saved model is a plain
``LlamaForCausalLM`` whose residual stream at that layer holds the state the NLA must verbalize.

The training stream mixes stories with explanation text (chat-formatted AV samples and
AR-template samples), so the model already knows the explanation format and vocabulary
before the NLA stages fine-tune it. Samples are concatenated with EOS between them and
cut into fixed-length blocks (no padding, every token counts).

Notation: B = batch size, T = block length (seq_len), V = vocabulary size.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from nla.util.threads import adapt_threads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """Architecture of the subject model (the Llama fields that vary between presets)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_len: int

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"ModelShape: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_layers < 3:
            raise ValueError(f"ModelShape.n_layers: need >= 3 so a middle layer exists, found {self.n_layers}")


@dataclass(frozen=True)
class PretrainSettings:
    """Optimiser schedule: AdamW, linear warmup, cosine decay to ``min_lr_ratio * lr``."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 20
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    state_layer: int | None = None  # block whose output learns the story state (None: no state objective)
    state_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"PretrainSettings: steps and batch_size must be >= 1, found {self.steps}, {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"PretrainSettings.lr: must be > 0, found {self.lr}")


@dataclass
class PretrainResult:
    losses: list[float] = field(default_factory=list)  # train loss (nats/token) per step
    state_losses: list[float] = field(default_factory=list)  # state objective (BCE) per step, if any
    seconds: float = 0.0
    tokens: int = 0


def build_model(shape: ModelShape, pad_id: int, bos_id: int, eos_id: int, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.d_model,
        intermediate_size=shape.d_ff,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_heads,
        max_position_embeddings=shape.max_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def pack_blocks(samples: Sequence[Sequence[int]], block_len: int, eos_id: int) -> torch.Tensor:
    """Concatenate samples (each followed by EOS) and cut into full blocks: ``[N, block_len]``."""
    stream: list[int] = []
    for s in samples:
        stream.extend(s)
        stream.append(eos_id)
    n = len(stream) // block_len
    if n == 0:
        raise ValueError(f"pack_blocks: {len(stream)} tokens do not fill one block of {block_len}; add more text")
    return torch.tensor(stream[: n * block_len], dtype=torch.long).view(n, block_len)


def pack_state_blocks(states: Sequence[Sequence[Sequence[int]] | None], lengths: Sequence[int], block_len: int,
                      n_facts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """State targets aligned with ``pack_blocks`` of the same samples.

    ``states[i]``: per token of sample i, the indices of the facts true there (None: a sample
    without state, e.g. an explanation text); ``lengths[i]``: its token count. EOS separators
    and stateless samples are masked out. Returns ``(targets [N, T, F] uint8, mask [N, T] bool)``.
    """
    total = sum(n + 1 for n in lengths)
    n_tok = (total // block_len) * block_len
    rows: list[int] = []  # flat token index of every (token, true fact) pair
    cols: list[int] = []
    labelled: list[int] = []
    pos = 0
    for st, n in zip(states, lengths, strict=True):
        if st is not None:
            for t, facts in enumerate(st):
                labelled.append(pos + t)
                rows.extend([pos + t] * len(facts))
                cols.extend(facts)
        pos += n + 1  # the EOS after the sample stays masked
    r, c, lab = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long), torch.tensor(labelled)
    keep = r < n_tok  # the tail that fills no block is dropped, as in pack_blocks
    targets = torch.zeros(n_tok, n_facts, dtype=torch.uint8)
    targets[r[keep], c[keep]] = 1
    mask = torch.zeros(n_tok, dtype=torch.bool)
    mask[lab[lab < n_tok]] = True
    n_blocks = n_tok // block_len
    return targets.view(n_blocks, block_len, n_facts), mask.view(n_blocks, block_len)


def unigram_entropy(ids: Sequence[int] | torch.Tensor) -> float:
    """Entropy (nats) of the empirical token distribution: the best loss any model with
    no context could reach on these tokens."""
    ids = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
    counts = Counter(ids)
    n = len(ids)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def _lr_lambda(s: PretrainSettings):
    def f(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def pretrain(
    model: LlamaForCausalLM, blocks: torch.Tensor, settings: PretrainSettings, progress: bool = True,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PretrainResult:
    """Train ``model`` on random batches of ``blocks`` ([N, T]); returns the loss curve.

    ``state``: ``(targets [N, T, F], mask [N, T])`` from ``pack_state_blocks``; with
    ``settings.state_layer`` set, the state objective (module docstring) is added.
    """
    torch.manual_seed(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    use_state = settings.state_layer is not None and state is not None
    head = None
    if use_state:
        head = torch.nn.Linear(model.config.hidden_size, state[0].shape[-1])
        with torch.no_grad():  # start at each fact's base rate, so early state gradients stay small
            rate = (state[0][state[1]].float().mean(0)).clamp(1e-4, 1 - 1e-4)
            head.weight.zero_()
            head.bias.copy_(torch.log(rate / (1 - rate)))
        captured: dict[str, torch.Tensor] = {}
        # Block K's output, as datagen extracts it (HF hidden_states[K+1]).
        hook = model.model.layers[settings.state_layer].register_forward_hook(
            lambda _m, _i, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out))
    params = list(model.named_parameters()) + (list(head.named_parameters()) if head is not None else [])
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(settings))
    model.train()
    result = PretrainResult()
    t0 = time.perf_counter()
    bar = tqdm(range(settings.steps), desc="pretrain", disable=not progress, leave=False)
    for _ in bar:
        adapt_threads()
        idx = torch.randint(0, blocks.shape[0], (settings.batch_size,), generator=gen)
        batch = blocks[idx]  # [B, T]
        loss = model(input_ids=batch, labels=batch).loss
        total = loss
        if use_state:
            targets, mask = state[0][idx].float(), state[1][idx]  # [B, T, F], [B, T]
            logits = head(captured.pop("h"))  # [B, T, F]
            # Summed over facts (a mean over ~66 mostly-absent facts would drown the ~5 true ones).
            bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1)
            state_loss = (bce * mask).sum() / mask.sum().clamp_min(1)
            total = loss + settings.state_weight * state_loss
            result.state_losses.append(state_loss.item())
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], settings.grad_clip)
        opt.step()
        sched.step()
        result.losses.append(loss.item())
        result.tokens += batch.numel()
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}")
    result.seconds = time.perf_counter() - t0
    if use_state:
        hook.remove()
    model.eval()
    return result


@torch.no_grad()
def evaluate_loss(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token loss (nats/token) over all predicted tokens of ``blocks`` [N, T]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch_size):
        batch = blocks[i : i + batch_size]
        n = batch.shape[0] * (batch.shape[1] - 1)  # HF shifts labels: T-1 targets per row
        total += model(input_ids=batch, labels=batch).loss.item() * n
        count += n
    model.train(was_training)
    return total / count


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
