"""Part 4, directions: verbalize a direction that is no activation (a probe's weight for one fact)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nla.client import NLAClient
from nla.core.graders import DatasetGrader
from nla.eval.suite.common import fact_kind

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ 4. directions
def norm_warnings(vectors: Tensor, reference: Tensor, factor: float = 2.0,
                  rows: Sequence[int] | None = None) -> list[str]:
    """One warning per input whose norm is below ``1/factor`` x the reference's 1st percentile or
    above ``factor`` x its 99th (the AV never saw such a vector; with a fixed injection scale only
    its direction is read, but a raw-scale AV reads noise). ``rows``: the number each vector is named by
    (default its index)."""
    rn = reference.float().norm(dim=-1)
    lo, hi = float(torch.quantile(rn, 0.01)) / factor, float(torch.quantile(rn, 0.99)) * factor
    out = []
    for i, n in enumerate(vectors.float().norm(dim=-1).tolist()):
        if not lo <= n <= hi:
            out.append(f"vector {i if rows is None else int(rows[i])}: norm {n:.3g} is outside the training data's range ({lo:.3g} .. {hi:.3g}, "
                       f"{factor:g}x beyond its 1st-99th percentiles); its explanation is off-distribution. Add the "
                       "data's mean activation and rescale to its typical norm (nla.eval.suite.direction_inputs)")
    return out


def fact_directions(vectors: Tensor, truths: Sequence[Sequence[str]], facts: Sequence[str], *,
                    l2: float = 1e-3, steps: int = 100) -> tuple[Tensor, Tensor]:
    """A linear probe's direction for each of ``facts``: (unit directions [F, d], the mean of the
    unit-normalised vectors [d]), in the space of unit-normalised vectors (``nla.core.probing``: the
    probe reads standardised features, so its weight for fact f maps back as ``w_f / sd``)."""
    from nla.core.probing import fit_logistic, standardise

    x = torch.as_tensor(np.asarray(vectors), dtype=torch.float32)
    z, _ = standardise(x, x[:1])
    unit = torch.nn.functional.normalize(x, dim=-1)
    sd = unit.std(0).clamp_min(1e-6)
    sets = [set(t) for t in truths]
    y = torch.tensor([[f in s for f in facts] for s in sets], dtype=torch.float32)
    w, _ = fit_logistic(z, y, l2, steps)
    dirs = torch.nn.functional.normalize((w / sd.unsqueeze(1)).T, dim=-1)
    return dirs, unit.mean(0)


def direction_inputs(directions: Tensor, mean_unit: Tensor, reference: Tensor, strength: float) -> Tensor:
    """Vectors the AV can read for directions [F, d]: the data's mean direction plus ``strength``
    standard deviations of the data's spread along each direction, rescaled to the data's median
    norm (``reference`` [N, d] RAW)."""
    unit = torch.nn.functional.normalize(reference.float(), dim=-1)
    spread = (unit @ directions.T).std(0)  # [F]
    v = mean_unit.unsqueeze(0) + strength * spread.unsqueeze(1) * directions
    return torch.nn.functional.normalize(v, dim=-1) * reference.float().norm(dim=-1).median()


def verbalize_directions(client: NLAClient, directions: Tensor, reference: Tensor, *, strength: float = 4.0,
                         **verbalize_kwargs: Any) -> tuple[list[Any], list[str]]:
    """Explanations of arbitrary directions [F, d] (``direction_inputs`` around ``reference``) and
    the norm warnings of the raw directions as given (``norm_warnings``; logged too)."""
    warnings = norm_warnings(directions, reference)
    for w in warnings[:5]:
        logger.warning("verbalize_directions: %s", w)
    mean_unit = torch.nn.functional.normalize(reference.float(), dim=-1).mean(0)
    dirs = torch.nn.functional.normalize(directions.float(), dim=-1)
    inputs = direction_inputs(dirs, mean_unit, reference, strength)
    return client.verbalize(inputs, **verbalize_kwargs), warnings


MIN_DIRECTION_ROWS = 5


def directions_summary(client: NLAClient, gold: Tensor, truths: list[list[str]], grader: DatasetGrader,
                       strengths: Sequence[float], batch_size: int, max_new_tokens: int) -> dict[str, Any] | None:
    """None when no fact holds on ``MIN_DIRECTION_ROWS`` rows or more (no direction can be fitted)."""
    present = sorted({f for t in truths for f in t})
    facts = [f for f in present if sum(f in t for t in truths) >= MIN_DIRECTION_ROWS]  # rows to fit it on
    if not facts:
        return None
    dirs, mean_unit = fact_directions(gold, truths, facts)
    per: dict[str, Any] = {}
    for strength in strengths:
        inputs = direction_inputs(dirs, mean_unit, gold, strength)
        verbs = client.verbalize(inputs, max_new_tokens=max_new_tokens, batch_size=batch_size)
        named = [f in grader.named_facts(v.explanation) for f, v in zip(facts, verbs, strict=True)]
        by_kind: dict[str, list[bool]] = {}
        for f, ok in zip(facts, named, strict=True):
            by_kind.setdefault(fact_kind(f), []).append(ok)
        per[f"{strength:g}"] = {"named": float(np.mean(named)) if named else None,
                                "by_kind": {k: float(np.mean(v)) for k, v in by_kind.items()},
                                "examples": [{"fact": f, "explanation": v.explanation}
                                             for f, v in list(zip(facts, verbs, strict=True))[:6]]}
    best = max(per, key=lambda k: per[k]["named"] or 0.0)
    raw_dir_warned = len(norm_warnings(dirs, gold))  # the unit directions as they are: far below the data's norm
    return {"facts": len(facts), "strengths": per, "best_strength": float(best), "named": per[best]["named"],
            "by_kind": per[best]["by_kind"], "raw_directions_warned": raw_dir_warned}
