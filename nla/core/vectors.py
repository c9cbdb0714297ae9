"""Vector normalisation and the reconstruction metrics shared by training, reward and eval.

Notation: ``B`` rows, ``d`` = model width. All metrics compute in fp32 whatever the
input dtype, because bf16 squared errors of vectors with norm ~60 lose most of their bits.

Both vectors are L2-normalised to ``scale`` before comparison, so with ``scale = sqrt(d)``
``mse_nrm = mean_d((p̂ - ĝ)^2) = 2 (1 - cos)``: 0 is perfect, 2 is orthogonal, 4 is opposite.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

SQRT_D_MODEL = "sqrt_d_model"

# Norms below this are treated as zero so a zero vector normalises to zero instead of NaN.
_EPS = 1e-12


def resolve_scale(spec: float | str | None, d_model: int) -> float | None:
    """Turn a sidecar scale sentinel into a number.

    ``"sqrt_d_model"`` -> ``sqrt(d_model)``; a number -> ``float(number)``; ``None`` -> ``None``
    (meaning: do not normalise, use the raw vector).
    """
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise ValueError(f"scale: expected a positive number, 'sqrt_d_model' or null, found {spec!r}")
    if isinstance(spec, str):
        if spec == SQRT_D_MODEL:
            if d_model <= 0:
                raise ValueError(f"scale 'sqrt_d_model' needs a positive d_model, found d_model={d_model}")
            return math.sqrt(d_model)
        raise ValueError(
            f"scale: expected a positive number, 'sqrt_d_model' or null, found the string {spec!r}; "
            "fix the sidecar's injection_scale / mse_scale"
        )
    if isinstance(spec, (int, float)):
        value = float(spec)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"scale: expected a positive finite number, found {spec!r}")
        return value
    raise ValueError(f"scale: expected a positive number, 'sqrt_d_model' or null, found {spec!r} ({type(spec).__name__})")


def normalize_activation(v: Tensor, scale: float | None) -> Tensor:
    """L2-normalise the last dim of ``v`` to norm ``scale``, in fp32.

    ``scale=None`` is a no-op (returns ``v`` unchanged, original dtype): the sidecar's null
    means "inject / compare raw". Zero vectors stay zero.
    """
    if scale is None:
        return v
    v32 = v.float()
    norm = v32.norm(dim=-1, keepdim=True)
    # clamp keeps 0/0 away; a zero vector then gives 0 * scale / eps = 0.
    out = v32 * (scale / norm.clamp_min(_EPS))
    over = _norm_overflows(v32, norm.squeeze(-1))
    if over.any():  # finite entries whose squares overflow fp32: the fp32 norm is inf, the row would be 0
        v64 = v32[over].double()
        out = out.index_put((over,), (v64 * (scale / v64.norm(dim=-1, keepdim=True).clamp_min(_EPS))).float())
    return out


def _norm_overflows(v32: Tensor, norm: Tensor) -> Tensor:
    """[B] rows of fp32 ``v32`` [B, d] whose entries are all finite but whose fp32 norm is not
    (squares above 3.4e38: entries from ~1.8e19 up). Their norm is taken in float64 instead; rows
    with a NaN or an infinite entry stay non-finite, as they should."""
    return ~torch.isfinite(norm) & torch.isfinite(v32).all(dim=-1)


def mse_nrm(pred: Tensor, gold: Tensor, scale: float | None) -> Tensor:
    """Per-row ``mean_d((normalize(pred) - normalize(gold))^2)``.  pred, gold: [B, d] -> [B]."""
    _check_pair(pred, gold)
    p = normalize_activation(pred.float(), scale)
    g = normalize_activation(gold.float(), scale)
    return ((p - g) ** 2).mean(dim=-1)


def cosine(pred: Tensor, gold: Tensor) -> Tensor:
    """Per-row cosine similarity in fp32.  [B, d] x [B, d] -> [B]; zero vectors give 0."""
    _check_pair(pred, gold)
    p, g = pred.float(), gold.float()
    pn, gn = p.norm(dim=-1), g.norm(dim=-1)
    cos = (p * g).sum(dim=-1) / (pn * gn).clamp_min(_EPS)
    over = _norm_overflows(p, pn) | _norm_overflows(g, gn) | (torch.isfinite(pn) & torch.isfinite(gn)
                                                              & ~torch.isfinite(pn * gn))
    if over.any():  # the same in float64 where an fp32 norm or product overflows
        p64, g64 = p[over].double(), g[over].double()
        c64 = (p64 * g64).sum(-1) / (p64.norm(dim=-1) * g64.norm(dim=-1)).clamp_min(_EPS)
        cos = cos.index_put((over,), c64.float())
    return cos


class MeanBaselines(NamedTuple):
    """MSE of predicting the mean gold vector, the denominators of FVE.

    raw_mean: ``mean_rows mean_d((ĝ - μ)^2)`` with ĝ the normalised golds and μ their mean,
        μ NOT renormalised. This is the headline FVE baseline (published: 0.72).
    normalized_mean: μ renormalised to ``scale`` and scored like a prediction with
        ``mse_nrm``. Larger (published: 0.94) because the mean of unit vectors is shorter than
        a unit vector; using it inflates FVE, so it is reported but never the headline.
    """

    raw_mean: float
    normalized_mean: float


def predict_mean_baselines(gold: Tensor, scale: float | None) -> MeanBaselines:
    """Both predict-the-mean baselines for the gold vectors ``gold`` [B, d]."""
    if gold.ndim != 2 or gold.shape[0] == 0:
        raise ValueError(f"gold: expected a non-empty [B, d] tensor, found shape {tuple(gold.shape)}")
    g = normalize_activation(gold.float(), scale)
    mu = g.mean(dim=0, keepdim=True)  # [1, d]
    raw = ((g - mu) ** 2).mean(dim=-1).mean()
    normalized = mse_nrm(mu.expand_as(g), g, scale).mean()
    return MeanBaselines(raw_mean=float(raw), normalized_mean=float(normalized))


def fve(pred: Tensor, gold: Tensor, scale: float | None) -> float:
    """Fraction of variance explained: ``1 - mean(mse_nrm) / raw_mean baseline``."""
    _check_pair(pred, gold)
    return fve_of_mse(mse_nrm(pred, gold, scale), check_spread(gold, scale, "fve").raw_mean)


# A raw-mean baseline below this share of the vectors' mean squared entry is rounding, not spread:
# identical vectors leave ~1e-15 of it, real data ~0.5-1.
SPREAD_RTOL = 1e-6


def check_spread(gold: Tensor, scale: float | None, what: str) -> MeanBaselines:
    """The mean baselines of ``gold`` [N, d], after checking that FVE is defined on them: at least two
    rows that do not all point the same way (else the raw-mean baseline is 0, or rounding noise that
    turns every FVE into -1e15)."""
    n = gold.shape[0]
    base = predict_mean_baselines(gold, scale) if n else MeanBaselines(0.0, 0.0)
    typical = float(normalize_activation(gold.float(), scale).pow(2).mean()) if n else 0.0
    if n < 2 or not base.raw_mean > SPREAD_RTOL * typical:
        raise ValueError(
            f"{what}: the {n} gold vector(s) have no spread after normalisation (a single row, or every row "
            "pointing the same way), so FVE's baseline is 0 and FVE is undefined; use data with more than one "
            "distinct vector")
    return base


def fve_of_mse(mse: Tensor, baseline: float) -> float:
    """``1 - mean(mse) / baseline`` (the mean in float64), for per-sample ``mse_nrm`` [N] whose
    failed samples are already charged (``nla.core.reward.charge_failures``): the one FVE of RL's
    logs (``fve_nrm``), ``nla eval``'s rows and ``fve``; ``baseline``: the raw-mean MSE."""
    return 1.0 - float(mse.double().mean()) / baseline


def _check_pair(pred: Tensor, gold: Tensor) -> None:
    if pred.shape != gold.shape:
        raise ValueError(
            f"pred and gold must have the same shape [B, d], found {tuple(pred.shape)} vs {tuple(gold.shape)}"
        )


def ridge_solve(x: Tensor, y: Tensor, ridge: float = 1e-3) -> Tensor:
    """``W`` [d_out, d_in] minimising ``||x W^T - y||^2 + lam ||W||^2`` for ``x`` [N, d_in], ``y``
    [N, d_out], with ``lam = ridge * trace(x^T x) / d_in`` (scale-free); in float64, on the CPU.
    (The starts of a cross-model pair: ``InjectionAdapter.fit``, ``Reconstructor.fit_head``.)"""
    x, y = x.double().cpu(), y.double().cpu()
    gram = x.T @ x
    lam = ridge * float(torch.trace(gram)) / gram.shape[0]
    return torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), x.T @ y).T
