"""Part 2, hidden-code tests: FVE after re-phrasing, re-ordering and dropping the quotation."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from nla.client import NLAClient
from nla.core.graders import DatasetGrader
from nla.core.vectors import fve_of_mse
from nla.eval.suite.common import charged_mse

# ------------------------------------------------------------------ 2. hidden-code tests
Paraphraser = Callable[[list[str]], list[str | None]]


def hidden_code_variants(texts: Sequence[str | None], grader: DatasetGrader, seed: int = 0,
                         paraphraser: Paraphraser | None = None) -> dict[str, list[str | None]]:
    """The three re-writings of every explanation (module docstring, part 2), keyed
    ``paraphrase`` / ``shuffle`` / ``drop_quotation``; a text a re-writing cannot change is kept.

    Paraphrase: each claim in another phrasing (``grader.paraphrase``; claims it cannot rephrase
    go to ``paraphraser``, a callable list[str] -> list[str | None], when given; quotations are
    kept). Shuffle: the claims in a random order other than their own (texts of one claim are
    kept). Drop quotation: the text without its quotation claims. Seeded by ``seed``.
    """
    rng = random.Random(f"nla-suite-hidden:{seed}")
    claims = [grader.claims(t) if t is not None else None for t in texts]
    para: list[list[str] | None] = []
    asks: list[tuple[int, int, str]] = []
    for i, cs in enumerate(claims):
        if cs is None:
            para.append(None)
            continue
        row = []
        for j, c in enumerate(cs):
            new = None if grader.is_quotation(c) else grader.paraphrase(c, rng)
            if new is None and paraphraser is not None and not grader.is_quotation(c):
                asks.append((i, j, c))
            row.append(new or c)
        para.append(row)
    if asks:
        answers = paraphraser([c for _, _, c in asks])
        if len(answers) != len(asks):
            raise ValueError(f"paraphraser: {len(answers)} answers for {len(asks)} claims")
        for (i, j, _), a in zip(asks, answers, strict=True):
            if a and a.strip():
                para[i][j] = a.strip()
    shuffled: list[str | None] = []
    for t, cs in zip(texts, claims, strict=True):
        if cs is None or len(cs) < 2:
            shuffled.append(t)
            continue
        order = list(range(len(cs)))
        while order == sorted(order):
            rng.shuffle(order)
        shuffled.append(" ".join(cs[k] for k in order))
    dropped = [t if cs is None else " ".join(c for c in cs if not grader.is_quotation(c)) for t, cs in
               zip(texts, claims, strict=True)]
    return {"paraphrase": [None if cs is None else " ".join(cs) for cs in para], "shuffle": shuffled,
            "drop_quotation": dropped}


def hidden_code_summary(client: NLAClient, texts: list[str | None], gold: Tensor, grader: DatasetGrader,
                        raw_mean: float, seed: int, batch_size: int, paraphraser: Paraphraser | None,
                        oracle: list[str] | None = None) -> dict[str, Any]:
    """The re-writings' FVE costs on the AV's texts and, as the control, on the grader's oracle texts
    (``oracle_*``): what the AR's reading alone loses on a text that holds no code."""
    out: dict[str, Any] = {}
    for prefix, ts in (("", texts), ("oracle_", oracle)):
        if ts is None:
            continue
        base = fve_of_mse(charged_mse(client, ts, gold, batch_size), raw_mean)
        out[f"{prefix}fve"] = base
        for name, vs in hidden_code_variants(ts, grader, seed, paraphraser if not prefix else None).items():
            changed = sum(v is not None and v != t for v, t in zip(vs, ts, strict=True))
            f = fve_of_mse(charged_mse(client, vs, gold, batch_size), raw_mean)
            out[f"{prefix}{name}_fve"] = f
            out[f"{prefix}{name}_cost"] = base - f
            out[f"{prefix}{name}_changed"] = changed / max(1, len(ts))
    return out
