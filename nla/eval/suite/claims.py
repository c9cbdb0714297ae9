"""Part 1, claim attribution: what deleting each claim of an explanation costs the AR's
reconstruction (``attribute_claims``), and the deletion cost of true, false and quotation claims
over a dataset (``claims_summary``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from nla.client import NLAClient, NLAClientError
from nla.core.graders import DatasetGrader, get_grader
from nla.eval.suite.common import mse_of_texts

__all__ = ["Claim", "attribute_claims", "claims_summary"]


@dataclass(frozen=True)
class Claim:
    """One claim of an explanation and what deleting it costs the AR's reconstruction.

    delta_mse: mse_nrm without the claim minus with it (> 0: the claim carried information the
        AR used); truth: the grader's verdict (None: names no fact, or no truth was given; a
        quotation is false when one quoted unit is not the text's, given the row's quote truth);
        quotation: the claim quotes the text read (its end, in the world's language) rather than claiming a fact.
    """

    text: str
    delta_mse: float
    truth: bool | None
    quotation: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def attribute_claims(client: NLAClient, texts: Sequence[str | None], vectors: Any, *,
                     grader: DatasetGrader | str | None = None, truths: Sequence[Sequence[str]] | None = None,
                     quotes: Sequence[Any] | None = None, batch_size: int = 64,
                     layer: int | Sequence[int] | None = None) -> list[list[Claim]]:
    """Per explanation, its claims with their deletion cost (``nla.eval.suite``, part 1).

    ``texts[i]`` explains RAW ``vectors[i]``; None (a failed sample) has no claims. ``grader``: the
    one that splits claims and judges them (``generic``: sentences, no truth); ``truths[i]``: row
    i's facts, for each claim's ``truth``; ``quotes[i]``: what row i's text ends with (the grader's
    ``quote_truths``), for a quotation's ``truth``; ``layer``: the block of every row, or of each (a pair for
    several blocks). All deletions are read in one batched pass of the AR.
    """
    grader = get_grader(grader) if isinstance(grader, str) else (grader or get_grader("generic"))
    gold = torch.as_tensor(np.asarray(vectors), dtype=torch.float32)
    if gold.ndim != 2 or gold.shape[0] != len(texts):
        raise NLAClientError(f"attribute_claims: {len(texts)} texts for vectors of shape {tuple(gold.shape)}; pass "
                             "one [N, d] row per text")
    if truths is not None and len(truths) != len(texts):
        raise NLAClientError(f"attribute_claims: {len(truths)} fact lists for {len(texts)} texts")
    if quotes is not None and len(quotes) != len(texts):
        raise NLAClientError(f"attribute_claims: {len(quotes)} quote truths for {len(texts)} texts")
    claims = [grader.claims(t) if t is not None else [] for t in texts]
    variants: list[str] = []  # per row with claims: the full text, then each deletion
    rows: list[int] = []
    for i, cs in enumerate(claims):
        if cs:
            variants.append(str(texts[i]))
            variants += [" ".join(cs[:j] + cs[j + 1:]) for j in range(len(cs))]
            rows += [i] * (len(cs) + 1)
    if layer is not None and not isinstance(layer, int):
        if len(layer) != len(texts):
            raise NLAClientError(f"attribute_claims: {len(layer)} blocks for {len(texts)} texts")
        layer = [layer[i] for i in rows]  # each deletion read at its row's block
    mse = mse_of_texts(client, variants, gold[rows], batch_size, layer) if variants else torch.zeros(0)
    out: list[list[Claim]] = []
    k = 0
    for i, cs in enumerate(claims):
        if not cs:
            out.append([])
            continue
        full = float(mse[k])
        quote = quotes[i] if quotes is not None else None
        out.append([Claim(c, float(mse[k + 1 + j]) - full, _truth(grader, c, truths[i] if truths is not None else None,
                                                                   quote), grader.is_quotation(c))
                    for j, c in enumerate(cs)])
        k += len(cs) + 1
    return out


def _truth(grader: DatasetGrader, claim: str, truth: Sequence[str] | None, quote: Any) -> bool | None:
    """A claim's verdict: a quotation against ``quote`` (when given), any other against ``truth`` (None
    when not given)."""
    if truth is None:
        return grader.claim_truth(claim, [], quote) if quote is not None and grader.is_quotation(claim) else None
    return grader.claim_truth(claim, truth, quote)


def claims_summary(attr: list[list[Claim]], raw_mean: float, grader: DatasetGrader | None = None,
                   truths: list[list[str]] | None = None, earlier: list[set[str]] | None = None) -> dict[str, Any]:
    """Mean deletion cost of true, false, quotation and other claims, in mse and FVE units; with
    ``earlier`` (facts true before in the document), false claims also split into ``false_stale``
    (a fact that was true earlier) and ``false_invented``. Quotations keep their own group (the fact
    claims' figures stay what they were) and split into ``quotation_true`` / ``quotation_false`` when
    they were graded (``attribute_claims(quotes=...)``)."""
    groups: dict[str, list[float]] = {"true": [], "false": [], "quotation": [], "other": []}
    split: dict[str, list[float]] = {"false_stale": [], "false_invented": []}
    quoted: dict[str, list[float]] = {"quotation_true": [], "quotation_false": []}
    for i, cs in enumerate(attr):
        for c in cs:
            g = "quotation" if c.quotation else "true" if c.truth is True else "false" if c.truth is False else "other"
            groups[g].append(c.delta_mse)
            if g == "quotation" and c.truth is not None:
                quoted["quotation_true" if c.truth else "quotation_false"].append(c.delta_mse)
            if g == "false" and earlier is not None and grader is not None and truths is not None:
                wrong = grader.named_facts(c.text) - set(truths[i])
                split["false_stale" if wrong & earlier[i] else "false_invented"].append(c.delta_mse)
    out: dict[str, Any] = {"rows": len(attr), "claims": sum(len(v) for v in groups.values())}
    for g, v in groups.items():
        out[f"n_{g}"] = len(v)
        out[f"delta_mse_{g}"] = float(np.mean(v)) if v else None
        out[f"fve_cost_{g}"] = float(np.mean(v)) / raw_mean if v else None
    if any(quoted.values()):
        for g, v in quoted.items():
            out[f"n_{g}"] = len(v)
            out[f"fve_cost_{g}"] = float(np.mean(v)) / raw_mean if v else None
    if earlier is not None:
        for g, v in split.items():
            out[f"n_{g}"] = len(v)
            out[f"fve_cost_{g}"] = float(np.mean(v)) / raw_mean if v else None
    t, f = out["fve_cost_true"], out["fve_cost_false"]
    out["true_over_false"] = t / f if t is not None and f is not None and f > 0 else None
    out["false_cost_nonpositive"] = f is not None and f <= 0  # deleting false claims does not hurt at all
    return out
