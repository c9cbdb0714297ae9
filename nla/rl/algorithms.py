"""RL math for the verbalizer: advantages, losses, KL estimators, DAPO helpers.

Pure tensor functions: no config objects, no I/O, no model calls. The RL loop
picks variants by name through the registries at the bottom
(``ADVANTAGE_ESTIMATORS``, ``KL_ESTIMATORS``, ``LOSS_AGG_MODES``).

Notation (used in every shape comment below):
    B     prompts (activation vectors) in a rollout
    G     samples per prompt (``group_size``); the G samples of a prompt are
          contiguous rows, so row ``i`` belongs to group ``i // G``
    N     = B * G rollout rows
    L     padded response length
    V     vocabulary size
    mask  [N, L] float/bool, 1 on response tokens that carry loss, 0 on padding

Papers: PPO (Schulman et al. 2017), GAE (Schulman et al. 2016), GRPO
(DeepSeekMath, Shao et al. 2024), Dr.GRPO (Liu et al. 2025), DAPO (Yu et al.
2025), dual-clip PPO (Ye et al. 2020), KL estimators k1/k2/k3 (Schulman,
"Approximating KL divergence", 2020).

Where the code departs from the papers:
1. GRPO divides by the *unbiased* group standard deviation (``torch.std``,
   as verl does); the paper does not say which. A group of one sample has no
   spread, so (as in verl) its baseline is 0 and its scale 1: the advantage is
   the raw reward.
2. KL to the reference is a loss term (``kl_penalty`` averaged with the same
   aggregation as the policy loss), never folded into the reward (GRPO-style,
   not InstructGPT-style).
3. Loss aggregation is an explicit argument. ``seq-mean-*`` modes average over
   rows that have at least one response token (verl averages over all rows,
   so an empty row would dilute the loss); ``token-mean`` over all response
   tokens of the batch is DAPO's choice and the default.
4. The log-ratio ``logp - old_logp`` is clamped to [-20, 20] before ``exp``
   (verl does the same) so one wild token cannot produce inf/nan; k3 clamps
   ``ref_logp - logp`` the same way.
5. Dual clip applies only to tokens with negative advantage (Ye et al.);
   for those the per-token loss is ``min(max(-A r, -A clip(r)), -A c)``.
6. GAE uses outcome rewards placed on the last response token
   (``sequence_to_token_rewards``) and skips masked positions when it
   bootstraps, so holes and right padding in ``mask`` are handled; the value
   after the last response token is 0 (the episode ends there).
7. Dynamic sampling only *marks* groups with zero reward spread; dropping
   them and refilling the batch is the loop's job.
8. Group statistics are computed in float64 and a group whose rewards are all
   equal (``max == min``) gets advantage exactly 0: in fp32 the mean of equal
   values is off by an ulp and the std is ~1e-7, so ``dev / (std + eps)``
   would give such a group a spurious uniform push of up to ~0.5.
9. Every masked reduction selects with ``torch.where(mask, x, 0)`` instead of
   multiplying by the mask, and the losses zero their inputs outside the mask
   before any arithmetic: NaN or inf in a padded position (NaN x 0 = NaN)
   changes neither the loss nor any gradient (verl guards the same way).
10. ``seq-mean-token-sum-norm`` (Dr.GRPO) divides each row's token sum by a
   constant ``norm_len`` (the generation cap, ``max_response_len``), as the
   Dr.GRPO code and TRL do, never by the step's padded length.
11. PPO: GAE advantages are not whitened and the value loss is not clipped unless asked
   (``loss.whiten_advantages``, ``loss.value_clip``; ``masked_whiten`` and ``value_loss``'s
   ``clip_eps``), where verl whitens GAE advantages always and clips values at 0.5, and
   cleanrl does both by default (``norm_adv``, ``clip_vloss``). With one outcome reward per
   response and ``gamma = lam = 1`` the plain estimator is ``R - V_t``, in the reward's own
   units like GRPO's advantages; whitening rescales every step by its batch. Both stay
   options so a PPO run can match either reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdvantageEstimator",
    "LossAggregation",
    "aggregate_loss",
    "broadcast_to_tokens",
    "drgrpo_advantages",
    "dynamic_sampling_mask",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_loss_agg",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "reinforce_baseline_advantages",
    "sequence_to_token_rewards",
    "value_loss",
]

# Bound for log-ratios before exp (departure 4): exp(20) ~ 5e8 is finite in fp32.
_LOG_RATIO_CLAMP = 20.0


# ---------------------------------------------------------------- validation


def _check_1d(name: str, x: Tensor) -> None:
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N], found shape {tuple(x.shape)}; pass one value per rollout row.")


def _check_same_shape(**tensors: Tensor) -> None:
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.shape != t0.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {name0} has shape {tuple(t0.shape)}; "
                "all per-token tensors must be [N, L] with the same N and L."
            )


def _check_group(n: int, group_size: int) -> int:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, found {group_size}.")
    if n % group_size != 0:
        raise ValueError(
            f"number of rows N={n} is not a multiple of group_size={group_size}; "
            "rows must hold B complete groups of G samples each (N = B*G)."
        )
    return n // group_size


# ------------------------------------------------------------------- helpers


def _where_mask(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is set, exactly 0 elsewhere (whatever ``x`` holds there: departure 9)."""
    return torch.where(mask.to(torch.bool), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 where no position is set.

    ``x`` and ``mask`` have the same shape; ``dim=None`` reduces everything.
    """
    m = mask.to(torch.bool)
    x = _where_mask(x, m)
    count = m.to(x.dtype)
    if dim is None:
        return x.sum() / count.sum().clamp_min(1.0)
    return x.sum(dim) / count.sum(dim).clamp_min(1.0)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` [N, L] using mean and unbiased variance over masked positions.

    With ``shift_mean=False`` the mean is added back (only the scale changes).
    Positions outside the mask are returned as 0. Needs at least 2 masked
    positions, since one value has no variance.
    """
    _check_same_shape(x=x, mask=mask)
    m = mask.to(torch.bool)
    n = m.sum()
    if n < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 masked positions, found {int(n.item())}; "
            "skip whitening for batches this small."
        )
    x = _where_mask(x, m)
    mean = x.sum() / n
    var = _where_mask((x - mean) ** 2, m).sum() / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return _where_mask(out, m)


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Sequence-level advantages [N] -> per-token [N, L], zero outside ``mask``."""
    _check_1d("adv", adv)
    if mask.dim() != 2 or mask.shape[0] != adv.shape[0]:
        raise ValueError(
            f"mask must be [N, L] with N={adv.shape[0]} rows to match adv, found shape {tuple(mask.shape)}."
        )
    return _where_mask(adv[:, None].expand(mask.shape), mask)


def sequence_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each row's outcome reward [N] on its last response token -> [N, L].

    Rows without any response token get no reward (all zeros).
    """
    _check_1d("rewards", rewards)
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"mask must be [N, L] with N={rewards.shape[0]} rows to match rewards, found {tuple(mask.shape)}."
        )
    m = mask.to(torch.bool)
    L = m.shape[1]
    # index of the last True per row: argmax over positions weighted by index
    pos = torch.arange(L, device=m.device).expand_as(m)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(dim=1).values  # [N]
    out = torch.zeros(m.shape, dtype=rewards.dtype, device=rewards.device)
    has = last >= 0
    out[has.nonzero(as_tuple=True)[0], last[has]] = rewards[has]
    return out


# ---------------------------------------------------------------- advantages


def grpo_advantages(
    rewards: Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO outcome advantages: ``(r - mean_g) / (std_g + eps)`` per group.

    rewards: [N] with N = B*G, groups contiguous. Returns [N] (same dtype).
    ``std_g`` is the unbiased group std (departure 1); ``scale_by_std=False``
    gives Dr.GRPO's ``r - mean_g``. A group whose rewards are all equal gets
    advantage exactly 0, in any dtype (departure 8).
    """
    _check_1d("rewards", rewards)
    b = _check_group(rewards.shape[0], group_size)
    if group_size == 1:
        # No group to compare against (departure 1): baseline 0, scale 1.
        return rewards.clone()
    r = rewards.reshape(b, group_size).to(torch.float64)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)).expand_as(adv)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(rewards.dtype)


def drgrpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr.GRPO outcome advantages: ``r - mean_g`` (no std scaling). [N] -> [N]."""
    return grpo_advantages(rewards, group_size, scale_by_std=False)


def reinforce_baseline_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE with a batch-mean baseline: ``r - mean(r)``. [N] -> [N]."""
    _check_1d("rewards", rewards)
    return rewards - rewards.mean()


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, vectorised over rows.

    token_rewards, values, mask: [N, L]. Returns ``(advantages [N, L],
    returns [N, L])`` with ``returns = advantages + values``, both zero outside
    ``mask``. Masked positions are skipped when bootstrapping (departure 6):
    for response positions t < t' (t' the next response position),
    ``delta_t = r_t + gamma V_t' - V_t`` and ``A_t = delta_t + gamma lam A_t'``;
    after the last response position V = A = 0. Advantages are not whitened;
    call ``masked_whiten`` if wanted.
    """
    _check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    if not (0.0 <= gamma <= 1.0) or not (0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], found gamma={gamma}, lam={lam}.")
    m = mask.to(torch.bool)
    values = _where_mask(values.detach(), m)
    token_rewards = _where_mask(token_rewards, m)
    n, L = values.shape
    next_value = values.new_zeros(n)
    last_gae = values.new_zeros(n)
    adv = values.new_zeros(n, L)
    for t in reversed(range(L)):
        mt = m[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # On padding, carry the bootstrap state through unchanged.
        last_gae = torch.where(mt, gae_t, last_gae)
        next_value = torch.where(mt, values[:, t], next_value)
        adv[:, t] = _where_mask(gae_t, mt)
    returns = _where_mask(adv + values, m)
    return adv, returns


# -------------------------------------------------------------- aggregation


def _token_sums(loss_mat: Tensor, mask: Tensor) -> Tensor:
    return _where_mask(loss_mat, mask).sum(dim=1)  # [N]


def _seq_reduce(per_seq: Tensor, mask: Tensor) -> Tensor:
    # Mean over rows with at least one response token (departure 3).
    nonempty = mask.to(torch.bool).any(dim=1)
    return _where_mask(per_seq, nonempty).sum() / nonempty.sum().clamp_min(1).to(per_seq.dtype)


def _agg_token_mean(loss_mat: Tensor, mask: Tensor, norm_len: float | None) -> Tensor:
    return _where_mask(loss_mat, mask).sum() / mask.to(torch.bool).sum().clamp_min(1).to(loss_mat.dtype)


def _agg_seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, norm_len: float | None) -> Tensor:
    counts = mask.to(torch.bool).sum(dim=1).clamp_min(1).to(loss_mat.dtype)
    return _seq_reduce(_token_sums(loss_mat, mask) / counts, mask)


def _agg_seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, norm_len: float | None) -> Tensor:
    return _seq_reduce(_token_sums(loss_mat, mask), mask)


def _agg_seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, norm_len: float | None) -> Tensor:
    # Dr.GRPO: token sum divided by a constant (departure 10), not by each row's own
    # length nor by this batch's padded length, so every token weighs alike in every step.
    return _seq_reduce(_token_sums(loss_mat, mask), mask) / norm_len


@dataclass(frozen=True)
class LossAggregation:
    """One loss aggregation mode: the reduction and how a micro-batch is weighted.

    ``fn(loss_mat [N, L], mask [N, L], norm_len)`` reduces to a scalar. ``unit`` is what
    the mode averages over, ``"tokens"`` or ``"rows"`` (rows with at least one response
    token): a micro-batch's loss times ``micro_batch_weight(micro_mask, batch_mask)`` (its
    share of the batch's units), summed over micro-batches, equals the loss of the whole
    batch. ``needs_norm_len``: the mode divides by a caller-given constant.
    """

    name: str
    unit: str
    fn: Callable[[Tensor, Tensor, float | None], Tensor]
    needs_norm_len: bool = False

    def __call__(self, loss_mat: Tensor, mask: Tensor, norm_len: float | None = None) -> Tensor:
        if self.needs_norm_len and not (norm_len is not None and norm_len > 0):
            raise ValueError(
                f"loss aggregation {self.name!r} needs norm_len > 0 (the generation cap, max_response_len), "
                f"found {norm_len!r}; pass norm_len=max_response_len."
            )
        return self.fn(loss_mat, mask, norm_len)

    def units(self, mask: Tensor) -> int:
        """How many units (tokens or non-empty rows) ``mask`` [n, L] holds."""
        m = mask.to(torch.bool)
        return int(m.sum()) if self.unit == "tokens" else int(m.any(dim=1).sum())

    def micro_batch_weight(self, micro_mask: Tensor, batch_mask: Tensor) -> float:
        """The share of ``batch_mask``'s units that ``micro_mask`` (a subset of its rows) holds."""
        return self.units(micro_mask) / max(self.units(batch_mask), 1)


LOSS_AGG_MODES: dict[str, LossAggregation] = {
    "token-mean": LossAggregation("token-mean", "tokens", _agg_token_mean),
    "seq-mean-token-mean": LossAggregation("seq-mean-token-mean", "rows", _agg_seq_mean_token_mean),
    "seq-mean-token-sum": LossAggregation("seq-mean-token-sum", "rows", _agg_seq_mean_token_sum),
    "seq-mean-token-sum-norm": LossAggregation("seq-mean-token-sum-norm", "rows", _agg_seq_mean_token_sum_norm,
                                               needs_norm_len=True),
}


def _lookup(registry: dict, kind: str, name: str):
    try:
        return registry[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; valid names: {sorted(registry)}") from None


def get_loss_agg(name: str) -> LossAggregation:
    """The aggregation mode registered under ``name`` (KeyError lists valid names)."""
    return _lookup(LOSS_AGG_MODES, "loss aggregation mode", name)


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", *,
                   norm_len: float | None = None) -> Tensor:
    """Reduce a per-token loss [N, L] to a scalar.

    ``token-mean``: sum over all response tokens / their count.
    ``seq-mean-token-mean``: per-row mean over its tokens, then mean over rows.
    ``seq-mean-token-sum``: per-row sum, then mean over rows.
    ``seq-mean-token-sum-norm``: per-row sum / ``norm_len``, then mean over rows
    (Dr.GRPO; ``norm_len`` is the generation cap and is required).
    Row means skip rows with no response token; an all-zero mask gives 0 (still
    connected to the graph, so ``backward`` works and yields zero gradients).
    Values outside ``mask`` are never read (NaN there is harmless: departure 9).
    """
    agg = get_loss_agg(mode)
    _check_same_shape(loss_mat=loss_mat, mask=mask)
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [N, L], found shape {tuple(loss_mat.shape)}.")
    return agg(loss_mat, mask, norm_len)


# ------------------------------------------------------------------- losses


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg: str = "token-mean",
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with clip-higher and optional dual clip.

    logp, old_logp, advantages, mask: [N, L]. Per token, with
    ``ratio = exp(logp - old_logp)``:
        ``l = max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high))``
    and, when ``dual_clip_c`` (> 1) is set, for ``A < 0``:
        ``l = min(l, -A c)``  (bounds the loss at ``c |A|``).
    The per-token loss is then reduced with ``aggregate_loss(…, agg, norm_len=norm_len)``.
    Positions outside ``mask`` are zeroed before any arithmetic (departure 9), so
    whatever they hold reaches neither the loss nor any gradient.

    Returns ``(loss, metrics)``; metrics are detached floats over response
    tokens: ``clipfrac`` (tokens where the clipped branch is active),
    ``clipfrac_dual`` (tokens where the dual clip bound is active),
    ``approx_kl`` (k3 estimate of KL(old || new): mean of ``(ratio - 1) -
    log ratio``), ``ratio_mean``, ``ratio_max``, ``ratio_min``.
    """
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if eps_low < 0 or eps_high < 0 or eps_low >= 1:
        raise ValueError(
            f"need 0 <= eps_low < 1 and eps_high >= 0, found eps_low={eps_low}, eps_high={eps_high}."
        )
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), found {dual_clip_c}.")
    m = mask.to(torch.bool)
    logp = _where_mask(logp, m)
    advantages = _where_mask(advantages.detach(), m)
    old_logp = _where_mask(old_logp.detach(), m)
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = torch.maximum(pg1, pg2)
    per_token = clipped
    dual_active = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip_c is not None:
        pg3 = -advantages * dual_clip_c
        bounded = torch.minimum(clipped, pg3)
        negative = advantages < 0
        per_token = torch.where(negative, bounded, clipped)
        dual_active = negative & (clipped > pg3)
    loss = aggregate_loss(per_token, mask, agg, norm_len=norm_len)

    with torch.no_grad():
        mf = m.to(logp.dtype)
        r = ratio.detach()
        if m.any():
            ratio_max, ratio_min = r[m].max().item(), r[m].min().item()
        else:
            ratio_max = ratio_min = math.nan
        metrics = {
            "clipfrac": masked_mean((pg2 > pg1).to(logp.dtype), mf).item(),
            "clipfrac_dual": masked_mean(dual_active.to(logp.dtype), mf).item(),
            "approx_kl": masked_mean((r - 1.0) - log_ratio.detach(), mf).item(),
            "ratio_mean": masked_mean(r, mf).item(),
            "ratio_max": ratio_max,
            "ratio_min": ratio_min,
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = None,
    agg: str = "token-mean",
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO value-model loss ``0.5 (V - R)^2`` with optional value clipping.

    values, old_values, returns, mask: [N, L]. With ``clip_eps`` the prediction
    is also clipped to ``old_values ± clip_eps`` and the larger of the two
    squared errors is used (PPO2 / verl). Returns ``(loss, metrics)`` with
    ``vf_clipfrac`` and ``vpred_mean``. Positions outside ``mask`` are zeroed first
    (departure 9).
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0 (or None to disable), found {clip_eps}.")
    m = mask.to(torch.bool)
    values = _where_mask(values, m)
    old_values = _where_mask(old_values, m)
    returns = _where_mask(returns.detach(), m)
    err1 = (values - returns) ** 2
    if clip_eps is None:
        per_token = err1
        clip_active = torch.zeros_like(err1, dtype=torch.bool)
    else:
        old_values = old_values.detach()
        v_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err2 = (v_clipped - returns) ** 2
        per_token = torch.maximum(err1, err2)
        clip_active = err2 > err1
    loss = 0.5 * aggregate_loss(per_token, mask, agg, norm_len=norm_len)
    with torch.no_grad():
        mf = mask.to(values.dtype)
        metrics = {
            "vf_clipfrac": masked_mean(clip_active.to(values.dtype), mf).item(),
            "vpred_mean": masked_mean(values.detach(), mf).item(),
        }
    return loss, metrics


# ----------------------------------------------------------------------- KL


def _kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


def _kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    d = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
}


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The KL estimator registered under ``name`` (KeyError lists valid names)."""
    return _lookup(KL_ESTIMATORS, "KL estimator", name)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3", mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi. [N, L] -> [N, L].

    ``k1 = logp - ref_logp`` (unbiased, can be negative);
    ``k2 = 0.5 (logp - ref_logp)^2`` (biased, low variance);
    ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (unbiased, >= 0).
    ``ref_logp`` is treated as a constant. With ``mask`` [N, L], positions outside it
    are 0 and whatever they hold reaches no gradient (departure 9).
    """
    fn = get_kl_estimator(kind)
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    ref_logp = ref_logp.detach()
    if mask is None:
        return fn(logp, ref_logp)
    _check_same_shape(logp=logp, mask=mask)
    return _where_mask(fn(_where_mask(logp, mask), _where_mask(ref_logp, mask)), mask)


# --------------------------------------------------------------- diagnostics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: [N, L, V] -> [N, L] (fp32)."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over masked tokens.

    1 is a perfect value model, 0 is no better than a constant, negative is
    worse. NaN when the returns have no variance (nothing to explain).
    """
    _check_same_shape(values=values, returns=returns, mask=mask)
    m = mask.to(torch.bool)
    v = values.detach().double()[m]
    r = returns.detach().double()[m]
    if r.numel() < 2:
        return math.nan
    var_r = r.var()
    if var_r == 0:
        return math.nan
    return float(1.0 - (r - v).var() / var_r)


# -------------------------------------------------------------------- DAPO


def dynamic_sampling_mask(rewards: Tensor, group_size: int, tol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling: True for groups worth training on. [N] -> bool [B].

    A group is kept when ``max(r) - min(r) > tol``: with equal rewards every
    GRPO advantage is 0 and the group only dilutes the batch.
    """
    _check_1d("rewards", rewards)
    if tol < 0:
        raise ValueError(f"tol must be >= 0, found {tol}.")
    b = _check_group(rewards.shape[0], group_size)
    r = rewards.reshape(b, group_size)
    spread = r.max(dim=1).values - r.min(dim=1).values
    return spread > tol


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, added to the reward. [N] -> [N] (float).

    With ``expected = max_len - buffer_len``:
    0 for ``len <= expected``; ``(expected - len) / buffer_len * factor`` for
    ``expected < len <= max_len`` (a linear ramp reaching ``-factor`` at
    ``max_len``); ``-factor`` beyond ``max_len``.
    """
    _check_1d("lengths", lengths)
    if not (0 < buffer_len <= max_len):
        raise ValueError(
            f"need 0 < buffer_len <= max_len, found buffer_len={buffer_len}, max_len={max_len}; "
            "buffer_len is the length of the ramp before max_len."
        )
    if factor < 0:
        raise ValueError(f"factor must be >= 0 (it scales a penalty), found {factor}.")
    length = lengths.to(torch.float32)
    expected = float(max_len - buffer_len)
    ramp = (expected - length) / buffer_len * factor
    out = torch.where(length <= expected, torch.zeros_like(length), ramp)
    return torch.where(length > max_len, torch.full_like(length, -factor), out)


# ---------------------------------------------------- advantage registry


@dataclass(frozen=True)
class AdvantageEstimator:
    """One advantage estimator behind a uniform call.

    ``fn(rewards [N], mask [N, L], *, group_size, values, gamma, lam)`` returns
    ``(advantages [N, L], returns [N, L] | None)``; ``returns`` is only set by
    estimators that need a value model (``needs_values``). ``needs_groups``: the
    baseline is the group's own rewards, so a group needs at least 2 samples.
    """

    name: str
    needs_values: bool
    fn: Callable[..., tuple[Tensor, Tensor | None]]
    needs_groups: bool = False

    def __call__(
        self,
        rewards: Tensor,
        mask: Tensor,
        *,
        group_size: int,
        values: Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
    ) -> tuple[Tensor, Tensor | None]:
        if self.needs_values and values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs values [N, L] from a value model.")
        return self.fn(rewards, mask, group_size=group_size, values=values, gamma=gamma, lam=lam)


def _est_grpo(rewards, mask, *, group_size, values, gamma, lam):
    return broadcast_to_tokens(grpo_advantages(rewards, group_size), mask), None


def _est_drgrpo(rewards, mask, *, group_size, values, gamma, lam):
    return broadcast_to_tokens(drgrpo_advantages(rewards, group_size), mask), None


def _est_reinforce(rewards, mask, *, group_size, values, gamma, lam):
    return broadcast_to_tokens(reinforce_baseline_advantages(rewards), mask), None


def _est_gae(rewards, mask, *, group_size, values, gamma, lam):
    return gae_advantages(sequence_to_token_rewards(rewards, mask), values, mask, gamma, lam)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator("grpo", False, _est_grpo, needs_groups=True),
    "drgrpo": AdvantageEstimator("drgrpo", False, _est_drgrpo, needs_groups=True),
    "reinforce_baseline": AdvantageEstimator("reinforce_baseline", False, _est_reinforce),
    "gae": AdvantageEstimator("gae", True, _est_gae),
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name`` (KeyError lists valid names)."""
    return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)
