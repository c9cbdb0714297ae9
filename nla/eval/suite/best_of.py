"""Part 6, best-of-N: the sample the AR reconstructs best, against greedy decoding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from nla.client import NLAClient
from nla.core.graders import DatasetGrader
from nla.core.vectors import fve_of_mse
from nla.eval.suite.common import charged_mse


# ------------------------------------------------------------------ 6. best-of-N
def best_of_n(client: NLAClient, gold: Tensor, truths: list[list[str]] | None, grader: DatasetGrader | None,
              raw_mean: float, ns: Sequence[int] = (1, 4, 8), *, seed: int = 0, temperature: float = 1.0,
              batch_size: int = 64, max_new_tokens: int = 150, greedy_texts: list[str | None] | None = None
              ) -> dict[str, Any]:
    """FVE, recall and precision of greedy decoding and of best-of-N for each N in ``ns`` (one
    draw of max(ns) samples per vector, seeded; best-of-N keeps the best of its first N, which is
    what ``NLAClient.verbalize(best_of=N, seed=seed)`` returns for N = max(ns))."""
    from nla.core.graders import faithfulness

    def row(texts: list[str | None], mse: Tensor) -> dict[str, Any]:
        f = faithfulness(texts, truths, grader) if truths is not None and grader is not None else None
        return {"fve": fve_of_mse(mse, raw_mean), "recall": f.recall if f else None,
                "precision": f.precision if f else None}

    if greedy_texts is None:
        greedy_texts = [v.explanation for v in client.verbalize(gold, max_new_tokens=max_new_tokens,
                                                                batch_size=batch_size)]
    out: dict[str, Any] = {"greedy": row(greedy_texts, charged_mse(client, greedy_texts, gold, batch_size))}
    k = max(ns)
    verbs = client.verbalize(gold, n_samples=k, greedy=False, temperature=temperature, seed=seed,
                             max_new_tokens=max_new_tokens, batch_size=batch_size)
    texts = [v.explanation for v in verbs]
    mse = charged_mse(client, texts, gold[[v.row for v in verbs]], batch_size).view(-1, k)
    for n in ns:
        best = mse[:, :n].argmin(dim=1)
        chosen = [texts[i * k + int(j)] for i, j in enumerate(best)]
        out[str(n)] = row(chosen, mse[torch.arange(mse.shape[0]), best])
    out[f"fve_gain_{k}"] = out[str(k)]["fve"] - out["greedy"]["fve"]
    p8, pg = out[str(k)]["precision"], out["greedy"]["precision"]
    out[f"precision_change_{k}"] = p8 - pg if p8 is not None and pg is not None else None
    return out
