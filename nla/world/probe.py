"""What is in the vector? Linear probes for the world's facts, per layer.

For every layer K of the subject model, the residual-stream output of block K (HF
``hidden_states[K + 1]``, the vector an NLA at layer K reads) is collected at random
token positions of world stories, with the facts true at that token. For each fact kind
a linear probe (one sigmoid per fact of the kind, L2-regularised logistic regression)
is fitted on training stories and scored on held-out stories:

1. ``top1``: over held-out rows where at least one fact of the kind is true, how often the
   probe's highest-scoring fact of the kind is a true one.
2. ``chance``: the same for a guess uniform over the kind's facts, i.e. the mean over
   those rows of ``n_true_of_kind / n_facts_of_kind``.
2a. ``recall_top1``: the fact recall of a reader that names the probe's top fact on every such row, i.e. the
   mean of ``[top fact true] / n_true_of_kind``: ``top1`` in the grader's units (a story with two persons
   has two to recall; naming one is recall 0.5 there), what a verbalizer's per-kind recall is set against.
2b. ``recall_p90``: the most of that recall a reader of the probe can keep while at least ``PRECISION_BAR``
   of what it names is true: it names the probe's top fact on the held-out rows where the probe is
   surest (its highest sigmoid), every row counted (one without the kind: a false claim), as many rows
   as keep the share true at or over the bar; the cut is chosen on the held-out rows themselves, so
   this is an upper bound on what such a reader reaches (issue 59: a vector that holds little gets a short,
   true explanation; a kind the probe reads at chance has ``recall_p90`` 0).
3. Vectors are L2-normalised (the NLA compares directions), then standardised with the
   training rows' mean and std, so every layer is probed on the same footing.

It bounds what any verbalizer can say faithfully about the facts at a layer, and picks
the extraction layer (docs/design.md §5). Beside the facts, the quotation: for each position p
from the end of the text read (``quote[0]`` the token read's own word or mark, ``quote[1]`` the one
before it...), a multinomial probe over the units seen at least twice in training
(``nla.core.probing.read_units``) scores how often it names the held-out row's unit (an unseen
unit is a miss); its ``chance`` is the commonest training unit's share. Quotation probes are
reported beside the kinds and never enter the layer choice. Notation: N rows, d width, F facts of a kind.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from nla.core.probing import fit_logistic, standardise
from nla.world.facts import KINDS, TEXT_END_UNITS, VOCAB, Document, Fact, token_facts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KindProbe:
    """Held-out decodability of one fact kind at one layer."""

    kind: str
    n_facts: int  # facts of the kind the probe chooses among
    n_rows: int  # held-out rows where the kind is present
    top1: float
    chance: float
    recall_top1: float | None = None  # 2a above (None: the quotation's probes, and probes written before)
    recall_p90: float | None = None  # 2b above


# The share of a reader's claims that must be true for ``recall_p90`` (issue 59's precision bar).
PRECISION_BAR = 0.90


def recall_at_precision(scores: torch.Tensor, y: torch.Tensor, bar: float = PRECISION_BAR) -> float:
    """``recall_p90`` of the module docstring: ``scores`` [N, F] a probe's logits on every held-out row, ``y``
    [N, F] the facts true there (0/1). Rows are taken in order of the probe's top score, highest first; a
    row named contributes ``[top fact true] / n_true`` to recall (over the rows where any fact is true) and
    one claim, true or false, to precision. Returns the largest recall over the prefixes whose share of
    true claims is at least ``bar`` (0.0 when none is)."""
    if scores.shape != y.shape or scores.ndim != 2:
        raise ValueError(f"recall_at_precision: scores {tuple(scores.shape)} and truth {tuple(y.shape)} must be the "
                         "same [rows, facts] shape")
    n_true = y.sum(1)
    has = n_true > 0
    if not bool(has.any()):
        return 0.0
    top = scores.argmax(1, keepdim=True)
    hit = y.gather(1, top).squeeze(1)  # the named fact is true
    gain = torch.where(has, hit / n_true.clamp(min=1), torch.zeros_like(hit))
    order = torch.argsort(scores.max(1).values, descending=True, stable=True)
    right = torch.cumsum(hit[order], 0)
    named = torch.arange(1, len(order) + 1, dtype=right.dtype)
    recall = torch.cumsum(gain[order], 0) / has.sum()
    ok = right / named >= bar
    return float(recall[ok].max()) if bool(ok.any()) else 0.0


@dataclass(frozen=True)
class LayerProbe:
    """Every kind's probe at layer ``layer`` (output of block ``layer``)."""

    layer: int
    kinds: tuple[KindProbe, ...]
    quotes: tuple[KindProbe, ...] = ()  # quote[p]: the unit p from the end of the text read (n_facts: its classes)

    @property
    def mean_top1(self) -> float:
        return float(np.mean([k.top1 for k in self.kinds])) if self.kinds else float("nan")

    @property
    def mean_chance(self) -> float:
        return float(np.mean([k.chance for k in self.kinds])) if self.kinds else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out = {"layer": self.layer, "mean_top1": self.mean_top1, "mean_chance": self.mean_chance,
               "kinds": [asdict(k) for k in self.kinds]}
        if self.quotes:
            out["quotes"] = [asdict(k) for k in self.quotes]
        return out


def probe_kinds(
    x_train: np.ndarray | torch.Tensor,
    facts_train: Sequence[Sequence[str]],
    x_test: np.ndarray | torch.Tensor,
    facts_test: Sequence[Sequence[str]],
    kinds: Sequence[str] = KINDS,
    l2: float = 1e-3,
    steps: int = 100,
) -> tuple[KindProbe, ...]:
    """Fit and score one probe per kind. ``facts_*[i]``: the facts true at row i, as ``"kind=value"``.

    A kind with no training row or no held-out row where it is present is left out.
    """
    x_tr, x_te = standardise(torch.as_tensor(np.asarray(x_train), dtype=torch.float32),
                              torch.as_tensor(np.asarray(x_test), dtype=torch.float32))
    if x_tr.shape[0] != len(facts_train) or x_te.shape[0] != len(facts_test):
        raise ValueError(
            f"probe_kinds: {x_tr.shape[0]} training vectors for {len(facts_train)} fact rows and "
            f"{x_te.shape[0]} held-out vectors for {len(facts_test)}; they must match one to one"
        )
    sets_tr, sets_te = [set(fs) for fs in facts_train], [set(fs) for fs in facts_test]
    out = []
    for kind in kinds:
        facts = [str(Fact(kind, v)) for v in sorted(VOCAB[kind])]
        y_tr = torch.tensor([[f in fs for f in facts] for fs in sets_tr], dtype=torch.float32)
        y_te = torch.tensor([[f in fs for f in facts] for fs in sets_te], dtype=torch.float32)
        has = y_te.sum(1) > 0
        if y_tr.sum() == 0 or not bool(has.any()):
            continue
        w, b = fit_logistic(x_tr, y_tr, l2, steps)
        scores, y_has = x_te[has] @ w + b, y_te[has]  # [N_has, F]
        every = x_te @ w + b  # [N, F]: every held-out row, for recall_p90
        hit = y_has.gather(1, scores.argmax(1, keepdim=True)).squeeze(1)
        top1 = float(hit.mean())
        chance = float((y_has.sum(1) / len(facts)).mean())
        out.append(KindProbe(kind, len(facts), int(has.sum()), top1, chance,
                             recall_top1=float((hit / y_has.sum(1)).mean()),
                             recall_p90=recall_at_precision(every, y_te)))
    return tuple(out)


def probe_quotes(x_train: np.ndarray, reads_train: Sequence[str], x_test: np.ndarray, reads_test: Sequence[str],
                 positions: int = TEXT_END_UNITS, steps: int = 100) -> tuple[KindProbe, ...]:
    """One unit probe per position p from the end of the text read (``reads_*[i]``: row i's text up to
    and including its token): ``quote[p]`` top-1 over the held-out rows with a unit at p."""
    from nla.core.probing import read_units
    from nla.world.facts import text_units

    if len(reads_train) != len(x_train) or len(reads_test) != len(x_test):
        raise ValueError(f"probe_quotes: {len(x_train)} / {len(x_test)} vectors for {len(reads_train)} / "
                         f"{len(reads_test)} texts read; they must match one to one")
    units_tr = [text_units(r) for r in reads_train]
    units_te = [text_units(r) for r in reads_test]
    out = []
    for p in range(positions):
        tr = [i for i, u in enumerate(units_tr) if len(u) > p]
        te = [i for i, u in enumerate(units_te) if len(u) > p]
        if len(tr) < 2 or not te:
            continue
        y_tr = [units_tr[i][-1 - p] for i in tr]
        truth = [units_te[i][-1 - p] for i in te]
        top, _ = read_units(np.asarray(x_train)[tr], y_tr, np.asarray(x_test)[te], steps=steps)
        counts = Counter(y_tr)
        common = counts.most_common(1)[0][0]
        out.append(KindProbe(f"quote[{p}]", sum(1 for c in counts.values() if c >= 2), len(te),
                             float(np.mean([a == b for a, b in zip(top, truth, strict=True)])),
                             float(np.mean([t == common for t in truth]))))
    return tuple(out)


@torch.no_grad()
def collect_layer_vectors(
    model: Any,
    tokenizer: Any,
    docs: Sequence[Document],
    layers: Sequence[int],
    positions_per_doc: int = 8,
    skip_first: int = 4,
    seed: int = 0,
    max_len: int = 128,
    batch_size: int = 32,
    progress: bool = False,
    texts_read: list[str] | None = None,
) -> tuple[dict[int, np.ndarray], list[list[str]]]:
    """Block-``K`` outputs for every K in ``layers`` at sampled positions, and the facts there.

    The vectors are ``nla.core.activations.blocks_outputs``, what datagen extracts: the raw output of the
    last block too (HF's ``hidden_states[-1]`` has the final norm applied, so it is not read).

    Positions are drawn as in datagen (``nla.core.activations.sample_positions``), so a probe
    sees the same kind of rows the NLA is trained on. Returns ``({K: [N, d]}, facts)``; a list
    given as ``texts_read`` gets each row's text up to and including its token (for ``probe_quotes``).
    """
    from nla.core.activations import blocks_outputs, sample_positions

    vecs: dict[int, list[np.ndarray]] = {k: [] for k in layers}
    facts: list[list[str]] = []
    model.eval()
    for i in tqdm(range(0, len(docs), batch_size), desc="probe: collect", disable=not progress, leave=False):
        batch = docs[i : i + batch_size]
        enc = tokenizer([d.text for d in batch], truncation=True, max_length=max_len, padding=True,
                        return_offsets_mapping=True, return_tensors="pt")
        offsets = enc.pop("offset_mapping")
        out = blocks_outputs(model, enc["input_ids"], enc["attention_mask"], layers)
        for j, doc in enumerate(batch):
            real = enc["attention_mask"][j].nonzero().squeeze(1)  # token indices, whichever side pads
            pos = sample_positions(seed, doc.doc_id, len(real), positions_per_doc, skip_first)
            if len(pos) == 0:
                continue
            tf = token_facts(doc, [tuple(o) for o in offsets[j, real].tolist()])
            facts += [sorted(str(f) for f in tf[p]) for p in pos]
            if texts_read is not None:
                ends = offsets[j, real].tolist()
                texts_read += [doc.text[: ends[p][1]] for p in pos]
            idx = real[torch.as_tensor(pos)]
            for k in layers:
                vecs[k].append(out[k][j, idx].float().numpy())
    return {k: np.concatenate(v) for k, v in vecs.items()}, facts


def probe_world_layers(
    subject_dir: str | Path,
    train_docs: Sequence[Document],
    test_docs: Sequence[Document],
    layers: Sequence[int] | None = None,
    positions_per_doc: int = 8,
    skip_first: int = 4,
    max_len: int = 128,
    progress: bool = False,
    quote_layers: Sequence[int] | None = None,
) -> list[LayerProbe]:
    """Probe every layer in ``layers`` (default: every block) of a world subject, and the
    quotation's positions at ``quote_layers`` (default: the same layers; the unit probes cost most of
    the time, so the quickstart asks for its extraction layer only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(subject_dir))
    model = AutoModelForCausalLM.from_pretrained(str(subject_dir), use_safetensors=True)
    n_layers = int(model.config.num_hidden_layers)
    layers = list(range(n_layers)) if layers is None else list(layers)
    bad = [k for k in layers if not 0 <= k < n_layers]
    if bad:
        raise ValueError(f"probe layers: expected blocks 0..{n_layers - 1} of this {n_layers}-block subject, "
                         f"found {bad}")
    kw = dict(positions_per_doc=positions_per_doc, skip_first=skip_first, max_len=max_len, progress=progress)
    quoted = set(layers if quote_layers is None else quote_layers)
    r_tr: list[str] = []
    r_te: list[str] = []
    x_tr, f_tr = collect_layer_vectors(model, tok, train_docs, layers, seed=0, texts_read=r_tr, **kw)
    x_te, f_te = collect_layer_vectors(model, tok, test_docs, layers, seed=1, texts_read=r_te, **kw)
    results = []
    for k in tqdm(layers, desc="probe: fit", disable=not progress, leave=False):
        results.append(LayerProbe(k, probe_kinds(x_tr[k], f_tr, x_te[k], f_te),
                                  probe_quotes(x_tr[k], r_tr, x_te[k], r_te) if k in quoted else ()))
        logger.info("probe layer %d: mean top-1 %.3f (chance %.3f)", k, results[-1].mean_top1,
                    results[-1].mean_chance)
    return results


def probe_world(
    world: Any, layers: Sequence[int] | None = None, n_train_docs: int = 1500, n_test_docs: int = 300,
    progress: bool = False, quote_layers: Sequence[int] | None = None,
) -> list[LayerProbe]:
    """Probe a world build (``nla.world.build.WorldArtifacts``): fit on its first training stories,
    score on its held-out stories (never seen in pretraining)."""
    from nla.world.generator import generate_documents

    cfg = world.config
    if n_test_docs > cfg.n_heldout_docs:
        raise ValueError(f"n_test_docs: the world holds out {cfg.n_heldout_docs} stories, asked for {n_test_docs}")
    train = generate_documents(cfg.seed, min(n_train_docs, cfg.n_docs))
    test = generate_documents(cfg.seed, n_test_docs, start_id=cfg.heldout_start)
    return probe_world_layers(world.subject_dir, train, test, layers=layers, progress=progress,
                              quote_layers=quote_layers)


def best_layer(results: Sequence[LayerProbe]) -> int:
    """The layer with the highest mean top-1 (ties: the earliest)."""
    if not results:
        raise ValueError("best_layer: no probe results")
    return max(results, key=lambda r: (r.mean_top1, -r.layer)).layer


def probe_table_markdown(results: Sequence[LayerProbe], chosen: int | None = None) -> str:
    """Rows: layers; columns: top-1 per kind, mean, chance, then each quotation position's top-1.
    ``chosen`` is marked."""
    kinds = [k.kind for k in results[0].kinds] if results else []
    quotes = list(dict.fromkeys(k.kind for r in results for k in r.quotes))  # those of any layer probed for them
    lines = ["| layer | " + " | ".join(kinds) + " | mean top-1 | chance |" + "".join(f" {q} |" for q in quotes),
             "|---" * (len(kinds) + 3 + len(quotes)) + "|"]
    for r in results:
        by = {k.kind: k for k in r.kinds + r.quotes}
        cells = [f"{by[k].top1:.2f}" if k in by else "–" for k in kinds]
        qcells = "".join(f" {by[q].top1:.2f} |" if q in by else " – |" for q in quotes)
        mark = " (chosen)" if r.layer == chosen else ""
        lines.append(f"| {r.layer}{mark} | " + " | ".join(cells) + f" | **{r.mean_top1:.3f}** | {r.mean_chance:.3f} |"
                     + qcells)
    return "\n".join(lines)


def write_probe_json(path: str | Path, results: Sequence[LayerProbe], **info: Any) -> None:
    from nla.util.fsutil import write_text_atomic

    write_text_atomic(json.dumps({**info, "layers": [r.to_dict() for r in results]}, indent=1), Path(path))
