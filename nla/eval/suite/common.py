"""What the suite's parts share: the part names, the targets every report checks, fact kinds, rows
grouped by document, and the AR's mse of texts against vectors (failed samples charged)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from nla.client import NLAClient
from nla.core.reward import charge_failures, failed_mse
from nla.core.vectors import mse_nrm

PARTS = ("claims", "hidden_code", "causal", "directions", "confabulation", "best_of")

# The targets, checked on every report: (section, key, comparison, bound, what it means)
TARGETS: tuple[tuple[str, str, str, float, str], ...] = (
    ("claims", "true_over_false", ">=", 3.0, "deleting a true claim costs >= 3x the FVE of deleting a false one"),
    ("hidden_code", "paraphrase_cost", "<=", 0.03, "re-phrasing every claim costs <= 0.03 FVE"),
    ("hidden_code", "shuffle_cost", "<=", 0.02, "re-ordering the claims costs <= 0.02 FVE"),
    ("causal", "edited_moves", ">=", 0.70, "an edited claim moves the subject's prediction to the edited value"),
    ("causal", "random_moves", "<=", 0.05, "a random vector of the same norm moves it (control)"),
    ("causal", "unedited_keeps", ">=", 0.80, "the unedited explanation's reconstruction keeps the prediction"),
    ("directions", "named", ">=", 0.70, "the AV names a probe direction's fact (kinds x values)"),
    ("best_of", "fve_gain_8", ">=", 0.05, "best-of-8 adds >= 0.05 FVE over greedy"),
    ("best_of", "precision_change_8", ">=", 0.0, "... without losing precision"),
)


def fact_kind(fact: str) -> str:
    """``"place=beach"`` -> ``"place"`` (a fact without ``=`` is its own kind)."""
    return fact.partition("=")[0]


def by_document(doc_ids: Sequence[int], positions: Sequence[int]) -> list[list[int]]:
    """Row indices grouped by document, each group in position order."""
    order: dict[int, list[tuple[int, int]]] = {}
    for i, (d, p) in enumerate(zip(doc_ids, positions, strict=True)):
        order.setdefault(int(d), []).append((int(p), i))
    return [[i for _, i in sorted(rows)] for rows in order.values()]


def earlier_truths(truths: Sequence[Sequence[str]], doc_ids: Sequence[int], positions: Sequence[int]
                    ) -> list[set[str]]:
    """Per row, the facts true at the earlier evaluated positions of its document."""
    out: list[set[str]] = [set() for _ in truths]
    for rows in by_document(doc_ids, positions):
        seen: set[str] = set()
        for i in rows:
            out[i] = set(seen)
            seen |= set(truths[i])
    return out


def mse_of_texts(client: NLAClient, texts: Sequence[str], gold: Tensor, batch_size: int,
                 layer: int | Sequence[int] | None = None) -> Tensor:
    """[N] ``mse_nrm`` of the AR's reading of ``texts`` (every one a string, the empty one included)
    against ``gold`` [N, d] RAW, at the AR's scale; ``layer``: the block of every text, or of each (a pair
    for several blocks: ``NLAClient.reconstruct``)."""
    side = client.require_ar("the suite")
    if not texts:
        return torch.zeros(0)
    pred = client.reconstruct(list(texts), batch_size=batch_size, layer=layer)
    return mse_nrm(pred, gold.float(), side.mse_scale_value())


def charged_mse(client: NLAClient, texts: Sequence[str | None], gold: Tensor, batch_size: int) -> Tensor:
    """[N] mse with None texts (failed samples) charged the failure cost."""
    failed = torch.tensor([t is None for t in texts], dtype=torch.bool)
    mse = torch.zeros(len(texts))
    ok = [i for i, t in enumerate(texts) if t is not None]
    if ok:
        mse[ok] = mse_of_texts(client, [texts[i] for i in ok], gold[ok], batch_size)
    return charge_failures(mse, failed, failed_mse(gold, client.ar_sidecar.mse_scale_value()))
