"""Recall slots of world stories: tokens after which the next word names a fact already true.

"… He was still at the ___": the story revealed the place earlier, and the next word names it
again. At such a token the subject's prediction should follow the fact its residual stream holds,
which is what the explanation suite's causal edits (``nla.eval.suite.causal_edits``) test: edit the
explanation's claim of that fact, reconstruct, patch, and see whether the prediction follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nla.world.facts import SURFACE_INDEX, Document, token_facts

__all__ = ["recall_slots"]


@torch.no_grad()
def recall_slots(model: Any, tokenizer: Any, docs: Sequence[Document], layer: int, *, max_len: int = 128,
                 batch_size: int = 32) -> dict[str, Any]:
    """Every recall slot of ``docs`` (token p whose next token starts a surface word of a fact
    true at p), as columns: ``doc_id``, ``position``, ``context`` (the text up to and including
    token p, as datagen writes it), ``facts`` (true at p, ``"kind=value"``), ``next_fact`` and
    ``vectors`` [N, d] (block ``layer``'s output at p, as datagen extracts it)."""
    from nla.core.activations import block_outputs, pad_right, tokenize_text

    out: dict[str, Any] = {"doc_id": [], "position": [], "context": [], "facts": [], "next_fact": []}
    vecs = []
    device = next(model.parameters()).device
    for s in range(0, len(docs), batch_size):
        batch = docs[s : s + batch_size]
        enc = [tokenize_text(tokenizer, d.text, max_len) for d in batch]
        ids_t, mask = pad_right([ids for ids, _ in enc], tokenizer.pad_token_id or 0)
        hidden = block_outputs(model, ids_t.to(device), mask.to(device), layer).float().cpu()
        for i, (doc, (ids, offsets)) in enumerate(zip(batch, enc, strict=True)):
            if offsets is None:
                raise ValueError("recall_slots: the subject's tokenizer gives no offsets; use a fast tokenizer")
            tf = token_facts(doc, offsets)
            for p in range(len(ids) - 1):
                a, b = offsets[p + 1]
                fact = SURFACE_INDEX.get(doc.text[a:b].strip().lower())
                if fact is None or fact not in tf[p] or b <= a:
                    continue
                out["doc_id"].append(int(doc.doc_id))
                out["position"].append(p)
                out["context"].append(doc.text[: offsets[p][1]])
                out["facts"].append(sorted(str(f) for f in tf[p]))
                out["next_fact"].append(str(fact))
                vecs.append(hidden[i, p])
    out["vectors"] = torch.stack(vecs) if vecs else torch.zeros(0, hidden.shape[-1] if docs else 0)
    return out
