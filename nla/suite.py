"""Does it explain? The explanation suite: tests that an NLA's text is a true, causal account.

A round-trip score says the AR can rebuild the vector from the text, not that the text is true
or that the vector does what the text says. The suite measures that, where the dataset's grader
(``nla.graders``) knows the truth, and runs its truth-free parts on any pair:

1. **claim attribution** (``attribute_claims``): delete each claim of an explanation and
   re-score with the AR; ``delta_mse`` = mse without the claim - mse with it (> 0: the AR used
   it). With truth: the mean cost of deleting a true vs a false claim.
2. **hidden-code tests** (``hidden_code_variants``): FVE after re-phrasing every claim (the
   grader's phrasings, or a provider's for a real model), after shuffling the order of the
   claims, and after dropping the quotation of the current word. An honest explanation loses
   little; a private code (meaning carried by phrasing or order) loses much.
3. **causal edits** (``causal_edits``): rows where the subject predicts a true fact as its next
   token (a recall slot); the explanation's claim of that fact is edited to another value of its
   kind, the AR reconstructs the edited text, the result (at the original vector's norm) replaces
   the subject's residual at the extraction layer and position (``patch_residual``), and the
   subject's top prediction is read. Baselines: the unedited explanation's reconstruction, a
   random vector of the same norm, and (no text) the same edit as a difference of class means,
   which says whether that residual drives the prediction at all. ``steering_vector`` is the generic tool: words -> a vector.
4. **directions** (``fact_directions``, ``direction_inputs``, ``norm_warnings``): verbalize a
   direction that is no activation (a linear probe's weight for one fact, added to the data's
   mean, at the data's norm), with a warning when an input's norm is far outside the data's.
5. **confabulation** (``confabulation``): the false-claim rate per fact kind for each AV
   (warm-start vs RL), and whether claims that recur at neighbouring positions of one document
   are more often true.
6. **best-of-N** (``best_of_n``): ``NLAClient.verbalize(best_of=N)`` keeps the sample the AR
   reconstructs best; FVE, recall and precision at N = 1, 4, 8 against greedy decoding.

``run_suite`` runs them on a held-out dataset and returns a ``SuiteReport`` (JSON, markdown with
each target met or missed); ``nla eval --suite`` is its command. Ground truth only grades here.

Conventions: a claim is one sentence of the grader's ``claims``; facts are ``"kind=value"``
strings (the kind is the part before ``=``); an explanation left without any claim is read by the
AR as the empty explanation (not a failed sample: the AR reads what is left); failed samples of
the AV (no explanation) have no claims and are charged the failure cost wherever FVE is taken.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from nla.client import NLAClient, NLAClientError
from nla.graders import DatasetGrader, get_grader, grader_for_table
from nla.reward import charge_failures, failed_mse
from nla.vectors import check_spread, fve_of_mse, mse_nrm

logger = logging.getLogger(__name__)

__all__ = [
    "PARTS", "TARGETS", "Claim", "SuiteReport", "attribute_claims", "best_of_n", "causal_edits", "confabulation",
    "direction_inputs", "fact_directions", "fact_kind", "hidden_code_variants", "norm_warnings", "patch_residual",
    "patched_next_token_logits", "run_suite", "steering_vector", "targets_table", "verbalize_directions",
]

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


def _mse_of_texts(client: NLAClient, texts: Sequence[str], gold: Tensor, batch_size: int) -> Tensor:
    """[N] ``mse_nrm`` of the AR's reading of ``texts`` (every one a string, the empty one included)
    against ``gold`` [N, d] RAW, at the AR's scale."""
    side = client._need_ar("the suite")
    if not texts:
        return torch.zeros(0)
    pred = client.reconstruct(list(texts), batch_size=batch_size)
    return mse_nrm(pred, gold.float(), side.mse_scale_value())


def _charged_mse(client: NLAClient, texts: Sequence[str | None], gold: Tensor, batch_size: int) -> Tensor:
    """[N] mse with None texts (failed samples) charged the failure cost."""
    failed = torch.tensor([t is None for t in texts], dtype=torch.bool)
    mse = torch.zeros(len(texts))
    ok = [i for i, t in enumerate(texts) if t is not None]
    if ok:
        mse[ok] = _mse_of_texts(client, [texts[i] for i in ok], gold[ok], batch_size)
    return charge_failures(mse, failed, failed_mse(gold, client.ar_sidecar.mse_scale_value()))


# ------------------------------------------------------------------ 1. claim attribution
@dataclass(frozen=True)
class Claim:
    """One claim of an explanation and what deleting it costs the AR's reconstruction.

    delta_mse: mse_nrm without the claim minus with it (> 0: the claim carried information the
        AR used); truth: the grader's verdict (None: names no fact, or no truth was given);
        quotation: the claim quotes the text read (the current word) rather than claiming a fact.
    """

    text: str
    delta_mse: float
    truth: bool | None
    quotation: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def attribute_claims(client: NLAClient, texts: Sequence[str | None], vectors: Any, *,
                     grader: DatasetGrader | str | None = None, truths: Sequence[Sequence[str]] | None = None,
                     batch_size: int = 64) -> list[list[Claim]]:
    """Per explanation, its claims with their deletion cost (module docstring, part 1).

    ``texts[i]`` explains RAW ``vectors[i]``; None (a failed sample) has no claims. ``grader``: the
    one that splits claims and judges them (``generic``: sentences, no truth); ``truths[i]``: row
    i's facts, for each claim's ``truth``. All deletions are read in one batched pass of the AR.
    """
    grader = get_grader(grader) if isinstance(grader, str) else (grader or get_grader("generic"))
    gold = torch.as_tensor(np.asarray(vectors), dtype=torch.float32)
    if gold.ndim != 2 or gold.shape[0] != len(texts):
        raise NLAClientError(f"attribute_claims: {len(texts)} texts for vectors of shape {tuple(gold.shape)}; pass "
                             "one [N, d] row per text")
    if truths is not None and len(truths) != len(texts):
        raise NLAClientError(f"attribute_claims: {len(truths)} fact lists for {len(texts)} texts")
    claims = [grader.claims(t) if t is not None else [] for t in texts]
    variants: list[str] = []  # per row with claims: the full text, then each deletion
    rows: list[int] = []
    for i, cs in enumerate(claims):
        if cs:
            variants.append(str(texts[i]))
            variants += [" ".join(cs[:j] + cs[j + 1:]) for j in range(len(cs))]
            rows += [i] * (len(cs) + 1)
    mse = _mse_of_texts(client, variants, gold[rows], batch_size) if variants else torch.zeros(0)
    out: list[list[Claim]] = []
    k = 0
    for i, cs in enumerate(claims):
        if not cs:
            out.append([])
            continue
        full = float(mse[k])
        out.append([Claim(c, float(mse[k + 1 + j]) - full,
                          grader.claim_truth(c, truths[i]) if truths is not None else None, grader.is_quotation(c))
                    for j, c in enumerate(cs)])
        k += len(cs) + 1
    return out


def _by_document(doc_ids: Sequence[int], positions: Sequence[int]) -> list[list[int]]:
    """Row indices grouped by document, each group in position order."""
    order: dict[int, list[tuple[int, int]]] = {}
    for i, (d, p) in enumerate(zip(doc_ids, positions, strict=True)):
        order.setdefault(int(d), []).append((int(p), i))
    return [[i for _, i in sorted(rows)] for rows in order.values()]


def _earlier_truths(truths: Sequence[Sequence[str]], doc_ids: Sequence[int], positions: Sequence[int]
                    ) -> list[set[str]]:
    """Per row, the facts true at the earlier evaluated positions of its document."""
    out: list[set[str]] = [set() for _ in truths]
    for rows in _by_document(doc_ids, positions):
        seen: set[str] = set()
        for i in rows:
            out[i] = set(seen)
            seen |= set(truths[i])
    return out


def _claims_summary(attr: list[list[Claim]], raw_mean: float, grader: DatasetGrader | None = None,
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


def _hidden_code_summary(client: NLAClient, texts: list[str | None], gold: Tensor, grader: DatasetGrader,
                         raw_mean: float, seed: int, batch_size: int, paraphraser: Paraphraser | None,
                         oracle: list[str] | None = None) -> dict[str, Any]:
    """The re-writings' FVE costs on the AV's texts and, as the control, on the grader's oracle texts
    (``oracle_*``): what the AR's reading alone loses on a text that holds no code."""
    out: dict[str, Any] = {}
    for prefix, ts in (("", texts), ("oracle_", oracle)):
        if ts is None:
            continue
        base = fve_of_mse(_charged_mse(client, ts, gold, batch_size), raw_mean)
        out[f"{prefix}fve"] = base
        for name, vs in hidden_code_variants(ts, grader, seed, paraphraser if not prefix else None).items():
            changed = sum(v is not None and v != t for v, t in zip(vs, ts, strict=True))
            f = fve_of_mse(_charged_mse(client, vs, gold, batch_size), raw_mean)
            out[f"{prefix}{name}_fve"] = f
            out[f"{prefix}{name}_cost"] = base - f
            out[f"{prefix}{name}_changed"] = changed / max(1, len(ts))
    return out


# ------------------------------------------------------------------ 3. causal edits
@contextmanager
def patch_residual(model: nn.Module, layer: int, positions: Tensor | Sequence[int], vectors: Tensor,
                   mode: str = "replace") -> Iterator[None]:
    """Within the block, decoder block ``layer``'s output (the residual stream an NLA at layer
    ``layer`` reads, HF ``hidden_states[layer + 1]``) at ``positions[b]`` of row b is replaced by
    (``mode="replace"``) or added ``vectors[b]`` to (``mode="add"``); every other position and
    layer input is untouched. ``vectors`` [B, d] RAW (cast to the model's dtype)."""
    from nla.arch import decoder_layers

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
    from nla.datagen.extract import pad_right, tokenize_text

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
    subject.eval()
    from nla.datagen.extract import block_outputs

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
        hidden = block_outputs(subject, input_ids, mask, layer)[rows, pos].float().cpu()
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
            others = [f for f in grader.facts_of_kind(fact_kind(fact))
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
        preds = {name: patched_next_token_logits(subject, *sub, layer=layer, vectors=v).argmax(-1).cpu()
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


# ------------------------------------------------------------------ 4. directions
def norm_warnings(vectors: Tensor, reference: Tensor, factor: float = 2.0) -> list[str]:
    """One warning per input whose norm is below ``1/factor`` x the reference's 1st percentile or
    above ``factor`` x its 99th (the AV never saw such a vector; with a fixed injection scale only
    its direction is read, but a raw-scale AV reads noise)."""
    rn = reference.float().norm(dim=-1)
    lo, hi = float(torch.quantile(rn, 0.01)) / factor, float(torch.quantile(rn, 0.99)) * factor
    out = []
    for i, n in enumerate(vectors.float().norm(dim=-1).tolist()):
        if not lo <= n <= hi:
            out.append(f"vector {i}: norm {n:.3g} is outside the training data's range ({lo:.3g} .. {hi:.3g}, "
                       f"{factor:g}x beyond its 1st-99th percentiles); its explanation is off-distribution. Add the "
                       "data's mean activation and rescale to its typical norm (nla.suite.direction_inputs)")
    return out


def fact_directions(vectors: Tensor, truths: Sequence[Sequence[str]], facts: Sequence[str], *,
                    l2: float = 1e-3, steps: int = 100) -> tuple[Tensor, Tensor]:
    """A linear probe's direction for each of ``facts``: (unit directions [F, d], the mean of the
    unit-normalised vectors [d]), in the space of unit-normalised vectors (``nla.probing``: the
    probe reads standardised features, so its weight for fact f maps back as ``w_f / sd``)."""
    from nla.probing import fit_logistic, standardise

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


def _directions_summary(client: NLAClient, gold: Tensor, truths: list[list[str]], grader: DatasetGrader,
                        strengths: Sequence[float], batch_size: int, max_new_tokens: int) -> dict[str, Any]:
    present = sorted({f for t in truths for f in t})
    facts = [f for f in present if sum(f in t for t in truths) >= 5]  # a direction needs rows to fit it on
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


# ------------------------------------------------------------------ 5. confabulation
def confabulation(texts: Sequence[str | None], truths: Sequence[Sequence[str]], grader: DatasetGrader,
                  doc_ids: Sequence[int] | None = None, positions: Sequence[int] | None = None) -> dict[str, Any]:
    """False-claim rate overall and per kind (claimed facts not true / claimed facts), and, with
    ``doc_ids`` and ``positions``, the truth rate of claims that recur at a neighbouring position
    (the previous or next evaluated position of the same document) vs claims that do not, and the
    share of false claims that were true at an earlier evaluated position (``false_stale``: an
    outdated fact, not an invented one)."""
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
        for rows in _by_document(doc_ids, positions):
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
        earlier = _earlier_truths(truths, doc_ids, positions)
        false = [(i, f) for i, fs in enumerate(named) for f in fs if f not in set(truths[i])]
        stale = sum(f in earlier[i] for i, f in false)
        out["false_stale"] = stale / len(false) if false else None
    return out


# ------------------------------------------------------------------ 6. best-of-N
def best_of_n(client: NLAClient, gold: Tensor, truths: list[list[str]] | None, grader: DatasetGrader | None,
              raw_mean: float, ns: Sequence[int] = (1, 4, 8), *, seed: int = 0, temperature: float = 1.0,
              batch_size: int = 64, max_new_tokens: int = 150, greedy_texts: list[str | None] | None = None
              ) -> dict[str, Any]:
    """FVE, recall and precision of greedy decoding and of best-of-N for each N in ``ns`` (one
    draw of max(ns) samples per vector, seeded; best-of-N keeps the best of its first N, which is
    what ``NLAClient.verbalize(best_of=N, seed=seed)`` returns for N = max(ns))."""
    from nla.graders import faithfulness

    def row(texts: list[str | None], mse: Tensor) -> dict[str, Any]:
        f = faithfulness(texts, truths, grader) if truths is not None and grader is not None else None
        return {"fve": fve_of_mse(mse, raw_mean), "recall": f.recall if f else None,
                "precision": f.precision if f else None}

    if greedy_texts is None:
        greedy_texts = [v.explanation for v in client.verbalize(gold, max_new_tokens=max_new_tokens,
                                                                batch_size=batch_size)]
    out: dict[str, Any] = {"greedy": row(greedy_texts, _charged_mse(client, greedy_texts, gold, batch_size))}
    k = max(ns)
    verbs = client.verbalize(gold, n_samples=k, greedy=False, temperature=temperature, seed=seed,
                             max_new_tokens=max_new_tokens, batch_size=batch_size)
    texts = [v.explanation for v in verbs]
    mse = _charged_mse(client, texts, gold[[v.row for v in verbs]], batch_size).view(-1, k)
    for n in ns:
        best = mse[:, :n].argmin(dim=1)
        chosen = [texts[i * k + int(j)] for i, j in enumerate(best)]
        out[str(n)] = row(chosen, mse[torch.arange(mse.shape[0]), best])
    out[f"fve_gain_{k}"] = out[str(k)]["fve"] - out["greedy"]["fve"]
    p8, pg = out[str(k)]["precision"], out["greedy"]["precision"]
    out[f"precision_change_{k}"] = p8 - pg if p8 is not None and pg is not None else None
    return out


# ------------------------------------------------------------------ the report
@dataclass
class SuiteReport:
    """What ``run_suite`` measured, by part (``PARTS``); ``targets``: each of ``TARGETS`` with its
    value and whether it is met (None: not measured)."""

    dataset: str
    n_rows: int
    seed: int
    sections: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def targets(self) -> list[dict[str, Any]]:
        out = []
        for section, key, op, bound, what in TARGETS:
            sec = self.sections.get(section, {})
            v = sec.get(key)
            met = None if v is None else (v >= bound if op == ">=" else v <= bound)
            note = None
            if key == "true_over_false" and v is None and sec.get("fve_cost_true") is not None \
                    and sec.get("fve_cost_false") is not None:  # false deletions cost nothing: no ratio
                met = sec["fve_cost_true"] > 0
                note = f"true {sec['fve_cost_true']:.3f}, false {sec['fve_cost_false']:.3f} (<= 0)"
            out.append({"section": section, "key": key, "target": f"{op} {bound:g}", "value": v, "met": met,
                        "what": what, "note": note})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "n_rows": self.n_rows, "seed": self.seed, "sections": self.sections,
                "skipped": self.skipped, "targets": self.targets, "samples": self.samples}

    def to_json(self) -> str:
        from nla.fsutil import dumps_json

        return dumps_json(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        s = self.sections
        lines = [f"# Does it explain? ({self.n_rows} rows of {self.dataset}, seed {self.seed})", ""]
        lines += targets_table(self.targets)
        if "claims" in s:
            c = s["claims"]
            lines += ["", "## Claim attribution (FVE lost when one claim is deleted)", "",
                      "| claim | n | mean FVE cost |", "|---|---|---|"]
            lines += [f"| {g.replace('_', ': ')} | {c[f'n_{g}']} | {_f(c[f'fve_cost_{g}'])} |"
                      for g in ("true", "false", "false_stale", "false_invented", "quotation", "other")
                      if c.get(f"n_{g}")]
        if "hidden_code" in s:
            h = s["hidden_code"]
            lines += ["", "## Hidden-code tests", "", f"FVE as written: {_f(h['fve'])}", "",
                      "| re-writing | rows changed | FVE | cost |", "|---|---|---|---|"]
            lines += [f"| {n} | {h[f'{n}_changed']:.0%} | {_f(h[f'{n}_fve'])} | {_f(h[f'{n}_cost'])} |"
                      for n in ("paraphrase", "shuffle", "drop_quotation")]
            if "oracle_fve" in h:
                lines += ["", f"The control, the oracle explanation (every true fact, no code; FVE "
                              f"{_f(h['oracle_fve'])} as written): re-phrased costs {_f(h['oracle_paraphrase_cost'])}, "
                              f"re-ordered {_f(h['oracle_shuffle_cost'])}, without the quoted word "
                              f"{_f(h['oracle_drop_quotation_cost'])}: what the AR's reading loses on a text that "
                              "holds no code."]
        if "causal" in s:
            c = s["causal"]
            lines += ["", "## Causal edits", "",
                      f"{c['rows']} rows ({c.get('source', 'the dataset')}); {c['recall_slots']} recall slots (the subject predicts a true fact); "
                      f"{c['edits']} edits ({c['not_claimed']} slots whose explanation did not claim the fact, "
                      f"{c['not_reproduced']} rows whose context did not reproduce the vector)", "",
                      "| patched vector | -> edited value | keeps the original |", "|---|---|---|",
                      f"| edited explanation, reconstructed | {_f(c['edited_moves'])} | {_f(c['edited_keeps'])} |",
                      f"| unedited explanation, reconstructed | {_f(c['unedited_moves'])} | {_f(c['unedited_keeps'])} |",
                      f"| random, same norm | {_f(c['random_moves'])} | {_f(c['random_keeps'])} |",
                      f"| difference of means (no text; the control) | {_f(c['means_moves'])} | "
                      f"{_f(c['means_keeps'])} |",
                      f"| the original vector | - | {_f(c['original_keeps'])} |", "",
                      "Where the unedited reconstruction keeps the prediction, the edit moves it in "
                      f"{_f(c.get('edited_moves_where_unedited_keeps'))}."]
        if "directions" in s:
            d = s["directions"]
            lines += ["", f"## Probe directions ({d['facts']} facts; strength in standard deviations)", "",
                      "| strength | named |" + "".join(f" {k} |" for k in d["by_kind"]),
                      "|---|---|" + "---|" * len(d["by_kind"])]
            for k, v in d["strengths"].items():
                lines.append(f"| {k} | {_f(v['named'])} |" + "".join(f" {_f(v['by_kind'].get(kk))} |"
                                                                   for kk in d["by_kind"]))
        if "confabulation" in s:
            lines += ["", "## Confabulation (false-claim rate per kind)", ""]
            models = list(s["confabulation"])
            kinds = sorted({k for m in models for k in s["confabulation"][m]["by_kind"]})
            lines += ["| AV | all |" + "".join(f" {k} |" for k in kinds)
                      + " recurring claims true | lone claims true | false claims once true |",
                      "|---|---|" + "---|" * (len(kinds) + 3)]
            for m in models:
                c = s["confabulation"][m]
                lines.append(f"| {m} | {_f(c['false_rate'])} |" + "".join(
                    f" {_f(c['by_kind'].get(k, {}).get('false_rate'))} |" for k in kinds)
                    + f" {_f(c.get('recurring', {}).get('true_rate'))} | {_f(c.get('lone', {}).get('true_rate'))} |"
                    + f" {_f(c.get('false_stale'))} |")
        if "best_of" in s:
            b = s["best_of"]
            lines += ["", f"## Best-of-N at inference (samples at temperature {b.get('temperature', 1.0):g})", "",
                      "| decoding | FVE | recall | precision |", "|---|---|---|---|"]
            for k in ["greedy"] + [k for k in b if k.isdigit()]:
                name = k if k == "greedy" else f"best of {k}"
                lines.append(f"| {name} | {_f(b[k]['fve'])} | {_f(b[k]['recall'])} | {_f(b[k]['precision'])} |")
        for part, why in self.skipped.items():
            lines += ["", f"- {part}: not run ({why})"]
        return "\n".join(lines) + "\n"


def targets_table(targets: list[dict[str, Any]], fmt: Callable[[Any], str] | None = None) -> list[str]:
    """Markdown rows of ``SuiteReport.targets`` (or their JSON): test, value (``fmt``), target, met."""
    fmt = fmt or _f
    lines = ["| test | value | target | met |", "|---|---|---|---|"]
    for t in targets:
        met = "-" if t["met"] is None else "yes" if t["met"] else "**no**"
        lines.append(f"| {t['what']} | {t.get('note') or fmt(t['value'])} | {t['target']} | {met} |")
    return lines


def _f(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _load_subject(path: str | os.PathLike, device: torch.device) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise NLAClientError(f"subject: {p} is no model directory (no config.json); pass the subject model the "
                             "dataset was extracted from (--subject DIR)")
    tok = AutoTokenizer.from_pretrained(str(p))
    model = AutoModelForCausalLM.from_pretrained(str(p), use_safetensors=True).to(device).eval()
    return model, tok


def run_suite(
    client: NLAClient,
    dataset_path: str | os.PathLike,
    *,
    parts: Sequence[str] = PARTS,
    subject: str | os.PathLike | None = None,
    baseline_av: NLAClient | None = None,
    grader: str | DatasetGrader | None = None,
    max_rows: int | None = None,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int = 150,
    best_of: Sequence[int] = (1, 4, 8),
    temperature: float = 0.7,
    strengths: Sequence[float] = (2.0, 4.0, 8.0),
    paraphraser: Paraphraser | None = None,
    n_show: int = 6,
) -> SuiteReport:
    """Run the suite's ``parts`` on a held-out dataset (module docstring). ``client`` holds the pair
    (AV and AR); ``temperature``: best-of-N's sampling temperature (0.7: on the default world best-of-8
    adds 0.056-0.061 FVE over greedy at 0.7 and 0.049-0.054 at 1.0, BENCHMARKS.md); ``baseline_av`` a client with the warm-start AV (confabulation compares the two);
    ``subject``: the subject model's directory for causal edits (default: the one the dataset's
    sidecar records, when it exists). Parts that need truth the grader lacks, or a subject that
    cannot be found, are listed in ``skipped`` with the reason."""
    from nla.evaluation import _load_eval_table

    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise NLAClientError(f"suite parts: expected some of {list(PARTS)}, found {bad}")
    client._need_av("run_suite")
    side = client._need_ar("run_suite")
    path = Path(dataset_path)
    rng = np.random.default_rng(seed)
    table, gold, dataset_rows = _load_eval_table(client, path, max_rows, rng)
    try:
        base = check_spread(gold, side.mse_scale_value(), f"dataset {path}")
    except ValueError as err:
        raise NLAClientError(str(err)) from None
    if isinstance(grader, str):
        grader = get_grader(grader)
    elif grader is None:
        grader = grader_for_table(table) or get_grader("generic")
    cols = table.column_names
    truths = table.column("facts").to_pylist() if "facts" in cols else None
    has_truth = truths is not None and grader.grade("", truths[0] or []) is not None
    if not has_truth:
        truths = None
    report = SuiteReport(dataset=str(path), n_rows=int(gold.shape[0]), seed=seed)
    logger.info("suite: verbalizing %d rows", gold.shape[0])
    verbs = client.verbalize(gold, max_new_tokens=max_new_tokens, batch_size=batch_size)
    texts = [v.explanation for v in verbs]

    if "claims" in parts:
        logger.info("suite: claim attribution")
        attr = attribute_claims(client, texts, gold, grader=grader, truths=truths, batch_size=batch_size)
        earlier = (_earlier_truths(truths, table.column("doc_id").to_pylist(), table.column("position").to_pylist())
                   if truths is not None and {"doc_id", "position"} <= set(cols) else None)
        report.sections["claims"] = _claims_summary(attr, base.raw_mean, grader, truths, earlier)
        for i in sorted(rng.choice(len(texts), size=min(n_show, len(texts)), replace=False).tolist()):
            report.samples.append({"row": int(dataset_rows[i]), "explanation": texts[i],
                                   "facts": truths[i] if truths else None, "claims": [c.to_dict() for c in attr[i]]})
    if "hidden_code" in parts:
        logger.info("suite: hidden-code tests")
        oracle = None
        if truths is not None:
            words = table.column("current_word").to_pylist() if "current_word" in cols else [None] * len(truths)
            oracle = [grader.oracle(t, w, int(r)) for t, w, r in zip(truths, words, dataset_rows, strict=True)]
            oracle = None if any(o is None for o in oracle) else oracle
        report.sections["hidden_code"] = _hidden_code_summary(client, texts, gold, grader, base.raw_mean, seed,
                                                              batch_size, paraphraser, oracle)
    if "causal" in parts:
        subject_dir = subject or side.base_model
        if truths is None:
            report.skipped["causal"] = "the dataset's grader knows no facts"
        elif "context" not in cols:
            report.skipped["causal"] = "the dataset has no context column (the text each vector was read at)"
        elif not subject_dir or not (Path(subject_dir) / "config.json").is_file():
            report.skipped["causal"] = (f"no subject model at {subject_dir!r} (the sidecar's extraction.base_model); "
                                        "pass --subject DIR")
        else:
            logger.info("suite: causal edits on the subject %s", subject_dir)
            from nla.client import _device_of

            model, tok = _load_subject(subject_dir, _device_of(client.ar))
            slots = grader.recall_slots(table, path, model, tok, side.layer_index, max_rows, seed=seed)
            if slots is not None and len(slots["context"]):
                logger.info("suite: verbalizing %d recall slots of the dataset's documents", len(slots["context"]))
                sv = slots["vectors"]
                stexts = [v.explanation for v in client.verbalize(sv, max_new_tokens=max_new_tokens,
                                                                  batch_size=batch_size)]
                res = causal_edits(client, model, tok, slots["context"], sv, stexts, slots["facts"], grader,
                                   side.layer_index, seed=seed)
                res["source"] = "recall slots of the dataset's documents"
            else:
                res = causal_edits(client, model, tok, table.column("context").to_pylist(), gold, texts, truths,
                                   grader, side.layer_index, seed=seed)
                res["source"] = "the dataset's rows"
            report.sections["causal"] = res
    if "directions" in parts:
        if truths is None:
            report.skipped["directions"] = "the dataset's grader knows no facts to take directions of"
        else:
            logger.info("suite: probe directions")
            report.sections["directions"] = _directions_summary(client, gold, truths, grader, strengths, batch_size,
                                                                max_new_tokens)
    if "confabulation" in parts:
        if truths is None:
            report.skipped["confabulation"] = "the dataset's grader knows no facts"
        else:
            docs = table.column("doc_id").to_pylist() if "doc_id" in cols else None
            pos = table.column("position").to_pylist() if "position" in cols else None
            conf = {"pair": confabulation(texts, truths, grader, docs, pos)}
            if baseline_av is not None:
                logger.info("suite: the baseline AV's explanations")
                btexts = [v.explanation for v in baseline_av.verbalize(gold, max_new_tokens=max_new_tokens,
                                                                         batch_size=batch_size)]
                conf = {"baseline": confabulation(btexts, truths, grader, docs, pos), **conf}
            report.sections["confabulation"] = conf
    if "best_of" in parts:
        logger.info("suite: best-of-%d", max(best_of))
        report.sections["best_of"] = best_of_n(client, gold, truths, grader if truths else None, base.raw_mean,
                                               best_of, seed=seed, temperature=temperature,
                                               batch_size=batch_size, max_new_tokens=max_new_tokens,
                                               greedy_texts=texts)
        report.sections["best_of"]["temperature"] = temperature
    return report
