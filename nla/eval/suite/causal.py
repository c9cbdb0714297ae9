"""Part 3, causal edits: an edited claim, read by the AR and patched into the subject's residual,
moves the subject's prediction; ``patch_residual`` and ``steering_vector`` are the generic tools."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from nla.client import NLAClient
from nla.core.graders import DatasetGrader
from nla.eval.suite.common import fact_kind


# ------------------------------------------------------------------ 3. causal edits
@contextmanager
def patch_residual(model: nn.Module, layer: int, positions: Tensor | Sequence[int], vectors: Tensor,
                   mode: str = "replace") -> Iterator[None]:
    """Within the block, decoder block ``layer``'s output (the residual stream an NLA at layer
    ``layer`` reads, HF ``hidden_states[layer + 1]``) at ``positions[b]`` of row b is replaced by
    (``mode="replace"``) or added ``vectors[b]`` to (``mode="add"``); every other position and
    layer input is untouched. ``vectors`` [B, d] RAW (cast to the model's dtype)."""
    from nla.core.arch import decoder_layers

    if mode not in ("replace", "add"):
        raise ValueError(f"patch_residual: mode must be 'replace' or 'add', found {mode!r}")
    blocks = decoder_layers(model)
    if not 0 <= layer < len(blocks):
        raise ValueError(f"patch_residual: layer {layer} outside the model's blocks 0..{len(blocks) - 1}")
    pos = torch.as_tensor(positions, dtype=torch.long)
    if vectors.ndim != 2 or vectors.shape[0] != pos.shape[0]:
        raise ValueError(f"patch_residual: {pos.shape[0]} positions for vectors of shape {tuple(vectors.shape)}")

    def hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        v = vectors.to(hidden.device, hidden.dtype)
        p = pos.to(hidden.device)
        hidden[rows, p] = v if mode == "replace" else hidden[rows, p] + v
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = blocks[layer].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def patched_next_token_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, positions: Tensor,
                              layer: int | None = None, vectors: Tensor | None = None, mode: str = "replace"
                              ) -> Tensor:
    """[B, V] next-token logits at ``positions`` (right-padded rows), with ``vectors`` patched at
    ``layer`` and those positions when given (``patch_residual``), unpatched otherwise."""
    def run() -> Tensor:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits[torch.arange(input_ids.shape[0]), positions].float()

    if vectors is None:
        return run()
    with patch_residual(model, layer, positions, vectors, mode):
        return run()


def steering_vector(client: NLAClient, texts: Sequence[str], norm: float | Tensor, batch_size: int = 64) -> Tensor:
    """Words -> vectors: the AR's reconstruction of each text, rescaled to ``norm`` (a scalar or
    [N]), ready for ``patch_residual`` at the AR's layer (a steering vector from words)."""
    pred = client.reconstruct(list(texts), batch_size=batch_size)
    n = torch.as_tensor(norm, dtype=torch.float32)
    return pred / pred.norm(dim=-1, keepdim=True).clamp_min(1e-12) * (n.unsqueeze(-1) if n.ndim else n)


def _encode_contexts(tokenizer: Any, contexts: Sequence[str], max_len: int) -> tuple[Tensor, Tensor, Tensor]:
    from nla.core.activations import pad_right, tokenize_text

    ids = [tokenize_text(tokenizer, c, max_len)[0] for c in contexts]
    input_ids, mask = pad_right(ids, tokenizer.pad_token_id or 0)
    return input_ids, mask, mask.sum(1) - 1


def _fact_token_ids(tokenizer: Any, grader: DatasetGrader, fact: str) -> set[int]:
    """The ids of the first token of each word naming ``fact``, with and without a leading space
    (how the word would start as the next token)."""
    out = set()
    for w in grader.fact_words(fact):
        for form in (" " + w, w, " " + w.capitalize(), w.capitalize()):
            ids = tokenizer(form, add_special_tokens=False)["input_ids"]
            if ids:
                out.add(int(ids[0]))
    return out


def causal_edits(client: NLAClient, subject: nn.Module, subject_tokenizer: Any, contexts: Sequence[str],
                 vectors: Tensor, texts: Sequence[str | None], truths: Sequence[Sequence[str]], grader: DatasetGrader,
                 layer: int, *, seed: int = 0, batch_size: int = 32, max_len: int = 512,
                 reproduce_tol: float = 1e-3) -> dict[str, Any]:
    """The causal-edit test (module docstring, part 3) on rows ``contexts[i]`` (the text read up to
    and including the token whose block-``layer`` output is ``vectors[i]``), explained by
    ``texts[i]``, with facts ``truths[i]``.

    A row is used when (1) re-running the subject on its context reproduces ``vectors[i]``
    (cosine >= 1 - ``reproduce_tol``; else it was not extracted this way), (2) the subject's top
    next token names a fact of ``truths[i]`` (a recall slot), and (3) the explanation claims that
    fact, so there is a claim to edit (to another value of its kind, drawn with ``seed``).
    Returns the counts and the rates in the module docstring, plus ``examples``.
    """
    rng = random.Random(f"nla-suite-causal:{seed}")
    gen = torch.Generator().manual_seed(seed)
    device = next(subject.parameters()).device
    # A pair trained on centred vectors (extraction.vector_offset) reads and writes them minus the
    # offset: the subject's own outputs are compared in the pair's space (client.to_pair_space), and
    # the AR's readings patched in in the subject's (client.from_pair_space); an uncentred pair: as is.
    subject.eval()
    from nla.core.activations import block_outputs

    counts = dict(rows=len(contexts), not_reproduced=0, recall_slots=0, not_claimed=0, edits=0)
    hits = dict(edited_moves=0, edited_keeps=0, unedited_keeps=0, unedited_moves=0, random_moves=0,
                random_keeps=0, original_keeps=0, means_moves=0, means_keeps=0)
    kept_and_moved = [0, 0]  # [edits whose unedited reconstruction keeps the prediction, of those the edit moves]
    # The text-free control: the same edit as a difference of means (the vector minus the mean of the
    # rows holding the old fact plus the mean of those holding the new one): whether this position's
    # residual drives the prediction at all, whatever an AR can write into it.
    allv = vectors.float()
    sums: dict[str, Tensor] = {}
    cnt: dict[str, int] = {}
    for i, t in enumerate(truths):
        for f in t:
            sums[f] = sums.get(f, 0) + allv[i]
            cnt[f] = cnt.get(f, 0) + 1
    means = {f: sums[f] / cnt[f] for f in sums}
    examples: list[dict[str, Any]] = []
    ids_cache: dict[str, set[int]] = {}

    def ids_of(f: str) -> set[int]:
        if f not in ids_cache:
            ids_cache[f] = _fact_token_ids(subject_tokenizer, grader, f)
        return ids_cache[f]

    for s in range(0, len(contexts), batch_size):
        ctx = list(contexts[s : s + batch_size])
        gold = vectors[s : s + batch_size].float()
        input_ids, mask, pos = _encode_contexts(subject_tokenizer, ctx, max_len)
        input_ids, mask, pos = input_ids.to(device), mask.to(device), pos.to(device)
        rows = torch.arange(len(ctx), device=device)
        hidden = client.to_pair_space(block_outputs(subject, input_ids, mask, layer)[rows, pos].float().cpu())
        repro = torch.nn.functional.cosine_similarity(hidden, gold, dim=-1)
        top = patched_next_token_logits(subject, input_ids, mask, pos).argmax(-1).cpu()
        chosen: list[tuple[int, str, str, str]] = []  # (row in batch, fact, new fact, edited text)
        for b in range(len(ctx)):
            i = s + b
            if float(repro[b]) < 1 - reproduce_tol:
                counts["not_reproduced"] += 1
                continue
            word = subject_tokenizer.decode([int(top[b])])
            fact = grader.fact_of_word(word.strip())
            if fact is None or fact not in set(truths[i]) or int(top[b]) not in ids_of(fact):
                continue
            counts["recall_slots"] += 1
            # a language with an open set of values (the wiki's next token) edits to another value seen in the rows
            known = grader.facts_of_kind(fact_kind(fact)) or tuple(f for f in means if fact_kind(f) == fact_kind(fact))
            others = [f for f in known
                      if f != fact and f not in set(truths[i]) and f in means]  # the control needs its mean
            edited = None
            if texts[i] is not None and others:
                new = rng.choice(others)
                edited = grader.edit_fact(str(texts[i]), fact, new)
            if edited is None:
                counts["not_claimed"] += 1
                continue
            chosen.append((b, fact, new, edited))
        if not chosen:
            continue
        counts["edits"] += len(chosen)
        bs = [c[0] for c in chosen]
        norms = gold[bs].norm(dim=-1)
        v_edit = steering_vector(client, [c[3] for c in chosen], norms)
        v_orig = steering_vector(client, [str(texts[s + b]) for b in bs], norms)
        noise = torch.randn(len(bs), gold.shape[1], generator=gen)
        v_rand = noise / noise.norm(dim=-1, keepdim=True) * norms.unsqueeze(-1)
        v_means = torch.stack([gold[b] - means[f] + means[nf] for b, f, nf, _ in chosen])
        v_means = v_means / v_means.norm(dim=-1, keepdim=True).clamp_min(1e-12) * norms.unsqueeze(-1)
        sub = (input_ids[bs], mask[bs], pos[bs])
        preds = {name: patched_next_token_logits(subject, *sub, layer=layer, vectors=client.from_pair_space(v)).argmax(-1).cpu()
                 for name, v in (("edited", v_edit), ("unedited", v_orig), ("random", v_rand), ("original", gold[bs]),
                                 ("means", v_means))}
        for k, (b, fact, new, edited) in enumerate(chosen):
            for name in ("edited", "unedited", "random", "means"):
                hits[f"{name}_moves"] += int(preds[name][k]) in ids_of(new)
                hits[f"{name}_keeps"] += int(preds[name][k]) in ids_of(fact)
            hits["original_keeps"] += int(preds["original"][k]) in ids_of(fact)
            if int(preds["unedited"][k]) in ids_of(fact):
                kept_and_moved[0] += 1
                kept_and_moved[1] += int(preds["edited"][k]) in ids_of(new)
            if len(examples) < 12:
                examples.append({"row": s + b, "context_tail": ctx[b][-80:], "fact": fact, "edited_to": new,
                                 "explanation": texts[s + b], "edited": edited,
                                 "prediction": {n: subject_tokenizer.decode([int(p[k])]) for n, p in preds.items()}})
    n = counts["edits"]
    out: dict[str, Any] = dict(counts)
    out.update({k: (v / n if n else None) for k, v in hits.items()})
    # where the AR's reading of the unedited text already drives the prediction, how often the edit moves it
    out["edited_moves_where_unedited_keeps"] = kept_and_moved[1] / kept_and_moved[0] if kept_and_moved[0] else None
    out["examples"] = examples
    return out
