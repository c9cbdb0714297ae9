"""Part 5, confabulation: the false-claim rate per fact kind, and whether recurring claims are truer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nla.core.graders import DatasetGrader, quotation_summary
from nla.eval.suite.common import by_document, earlier_truths, fact_kind


# ------------------------------------------------------------------ 5. confabulation
def confabulation(texts: Sequence[str | None], truths: Sequence[Sequence[str]], grader: DatasetGrader,
                  doc_ids: Sequence[int] | None = None, positions: Sequence[int] | None = None,
                  quotes: Sequence[Any] | None = None) -> dict[str, Any]:
    """False-claim rate overall and per kind (claimed facts not true / claimed facts), and, with
    ``doc_ids`` and ``positions``, the truth rate of claims that recur at a neighbouring position
    (the previous or next evaluated position of the same document) vs claims that do not, and the
    share of false claims that were true at an earlier evaluated position (``false_stale``: an
    outdated fact, not an invented one). With ``quotes`` (each row's quote truth, the grader's
    ``quote_truths``), ``quotation``: the quotations of the text's end as claims (a false quotation is
    a false claim, one with a quoted unit that is not the text's), their false rate and per position
    (``nla.core.graders.Quotation``); the fact figures above do not count them."""
    named = [grader.named_facts(t) if t is not None else frozenset() for t in texts]
    per_kind: dict[str, list[int]] = {}  # kind -> [claims, false]
    for fs, truth in zip(named, truths, strict=True):
        for f in fs:
            c = per_kind.setdefault(fact_kind(f), [0, 0])
            c[0] += 1
            c[1] += f not in set(truth)
    n_claims = sum(c[0] for c in per_kind.values())
    out: dict[str, Any] = {
        "claims": n_claims, "false_rate": sum(c[1] for c in per_kind.values()) / n_claims if n_claims else None,
        "by_kind": {k: {"claims": c[0], "false_rate": c[1] / c[0]} for k, c in sorted(per_kind.items())}}
    if doc_ids is not None and positions is not None:
        neighbours: dict[int, list[int]] = {}
        for rows in by_document(doc_ids, positions):
            for k, i in enumerate(rows):
                neighbours[i] = [rows[j] for j in (k - 1, k + 1) if 0 <= j < len(rows)]
        rec, lone = [0, 0], [0, 0]  # [claims, true]
        for i, fs in enumerate(named):
            for f in fs:
                c = rec if any(f in named[j] for j in neighbours.get(i, [])) else lone
                c[0] += 1
                c[1] += f in set(truths[i])
        out["recurring"] = {"claims": rec[0], "true_rate": rec[1] / rec[0] if rec[0] else None}
        out["lone"] = {"claims": lone[0], "true_rate": lone[1] / lone[0] if lone[0] else None}
        # a false claim that was true at an earlier evaluated position of the document: stale, not invented
        earlier = earlier_truths(truths, doc_ids, positions)
        false = [(i, f) for i, fs in enumerate(named) for f in fs if f not in set(truths[i])]
        stale = sum(f in earlier[i] for i, f in false)
        out["false_stale"] = stale / len(false) if false else None
    if quotes is not None:
        q = quotation_summary(texts, quotes, grader)
        if q is not None:
            quoting = round((q.said or 0.0) * q.n)
            out["quotation"] = {"claims": quoting,
                                "false_rate": None if q.all_true is None else 1.0 - q.all_true,
                                "exact": q.exact, "by_position": {k: list(v) for k, v in q.by_position.items()}}
    return out
