"""Part 1, claim attribution: the deletion cost of true, false and quotation claims.

``attribute_claims`` and ``Claim`` live with the client (``nla.client``), which offers them as
``NLAClient.attribute_claims``; this part summarises them over a dataset."""

from __future__ import annotations

from typing import Any

import numpy as np

from nla.client import Claim
from nla.core.graders import DatasetGrader


def claims_summary(attr: list[list[Claim]], raw_mean: float, grader: DatasetGrader | None = None,
                   truths: list[list[str]] | None = None, earlier: list[set[str]] | None = None) -> dict[str, Any]:
    """Mean deletion cost of true, false, quotation and other claims, in mse and FVE units; with
    ``earlier`` (facts true before in the document), false claims also split into ``false_stale``
    (a fact that was true earlier) and ``false_invented``."""
    groups: dict[str, list[float]] = {"true": [], "false": [], "quotation": [], "other": []}
    split: dict[str, list[float]] = {"false_stale": [], "false_invented": []}
    for i, cs in enumerate(attr):
        for c in cs:
            g = "quotation" if c.quotation else "true" if c.truth is True else "false" if c.truth is False else "other"
            groups[g].append(c.delta_mse)
            if g == "false" and earlier is not None and grader is not None and truths is not None:
                wrong = grader.named_facts(c.text) - set(truths[i])
                split["false_stale" if wrong & earlier[i] else "false_invented"].append(c.delta_mse)
    out: dict[str, Any] = {"rows": len(attr), "claims": sum(len(v) for v in groups.values())}
    for g, v in groups.items():
        out[f"n_{g}"] = len(v)
        out[f"delta_mse_{g}"] = float(np.mean(v)) if v else None
        out[f"fve_cost_{g}"] = float(np.mean(v)) / raw_mean if v else None
    if earlier is not None:
        for g, v in split.items():
            out[f"n_{g}"] = len(v)
            out[f"fve_cost_{g}"] = float(np.mean(v)) / raw_mean if v else None
    t, f = out["fve_cost_true"], out["fve_cost_false"]
    out["true_over_false"] = t / f if t is not None and f is not None and f > 0 else None
    out["false_cost_nonpositive"] = f is not None and f <= 0  # deleting false claims does not hurt at all
    return out
