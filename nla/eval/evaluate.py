"""Held-out evaluation of an AV/AR pair: reconstruction, faithfulness and baselines in one table.

Notation: N rows, d = ``d_model``; ``mse`` is ``mse_nrm`` at the AR's ``mse_scale``.

Conventions (where this departs from a bare metric):
1. A sample without a usable explanation (missing tags, truncated) is charged the MSE of an
   orthogonal prediction (``nla.client.failed_mse``, 2.0 at ``sqrt(d)``) and cosine 0, like
   the RL reward charges it; FVE, mean cosine and the MSE percentiles include those rows.
   With no failures FVE equals ``nla.core.vectors.fve`` exactly.
2. FVE's baseline is the raw-mean one (mean of the normalised golds, not renormalised); the
   normalised-mean baseline is reported as its own row (its FVE is negative), never used
   as the denominator.
3. Fact recall / precision are means over rows of the dataset's grader (``nla.core.graders``; the
   world's is ``nla.world.grade``); a failed
   sample is graded as the empty text (it claimed nothing). ``by_kind`` averages over the
   rows where that kind occurs in the truth or the prediction. The quotation of the text read
   (the world's ``The text ends with "…".``) is not a fact and does not enter them: it is graded
   on its own, unit by unit from the end (``faithfulness.quote``, ``nla.core.graders.Quotation``):
   per position ``quote[p]`` (0 = the token read) recall over the rows whose text's end has a unit
   there (no quotation: not said) and precision over the units quoted there, the share of rows
   whose quotation is exactly the text's end, and of the rows that quote, the share whose every
   unit is true. The truth is the row's ``text_end`` and ``context``.
4. Degeneracy: the share of explanations the grader's format checks flag (the world's: a
   repeated sentence, a broken quote, or a sentence outside its explanation language);
   failed samples are counted under ``failed``, not here.
5. ``frozen_ar``: the AV's explanations are also read by an AR that never saw them (the
   warm-start AR). A private code between an RL'd AV and its live AR shows up as a gap
   between "AV → AR round trip" and "AV → frozen warm-start AR".
6. The oracle row (a grader with an oracle, data the grader can quote, ``DatasetGrader.quotes``): every
   true fact and the quoted end of the text, nothing else (the world's ``oracle_explanation``), read by the live AR: the ceiling of
   the round trip for explanations that say only true things. A round trip above it comes
   from something other than the facts (a private code, or luck on the phrasing).
7. The text-explainer row uses the dataset's ``explanation`` column when present (that is
   the explainer's output); otherwise (the ``rl`` split) it regenerates the world's
   ``TextExplainer`` output from the row's facts with the datagen settings recorded in the
   dataset sidecar's provenance (defaults when they cannot be found).
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nla.client import NLAClient, NLAClientError, ScoreResult, failed_mse
from nla.core.graders import DatasetGrader, Faithfulness, faithfulness, get_grader, grader_for_table
from nla.core.provenance import Provenance, check_provenance
from nla.core.reward import charge_failures
from nla.core.vectors import (
    check_spread,
    cosine,
    fve_of_mse,
    mse_nrm,
    normalize_activation,
    predict_mean_baselines,
)
from nla.util.fsutil import dumps_json, json_ready

logger = logging.getLogger(__name__)

__all__ = ["EvalReport", "EvalRow", "Faithfulness", "Sample", "evaluate_pair", "faithfulness", "row_stats"]


# Row names the report and other readers look rows up by.
ROW_ROUND_TRIP = "AV → AR round trip"
ROW_FROZEN = "AV → frozen warm-start AR"
ROW_SHUFFLED = "AV on shuffled vectors → AR"
ROW_ORACLE = "oracle: every true fact → AR"


@dataclass(frozen=True)
class EvalRow:
    """One line of the table.

    name: what produced the predictions.
    fve: ``1 - mean(mse) / raw-mean baseline``.
    cosine / mse_mean / mse_p10 / mse_p50 / mse_p90: over all N rows (failures per convention 1).
    failure_rate: share of samples without an explanation (0 for text-fed rows).
    faithfulness: fact recall/precision of the explanations (world data only).
    degenerate: share of explanations flagged by the grader's format checks: ``any`` and each
        check (the world's: ``repeated`` / ``broken_quote`` / ``outside_language``).
    """

    name: str
    fve: float
    cosine: float
    mse_mean: float
    mse_p10: float
    mse_p50: float
    mse_p90: float
    failure_rate: float = 0.0
    faithfulness: Faithfulness | None = None
    degenerate: dict[str, float] | None = None
    diversity: dict[str, float] | None = None


def text_diversity(texts: Sequence[str | None]) -> dict[str, float]:
    """How varied a verbalizer's explanations are: ``distinct`` = distinct texts / rows and
    ``top_share`` = rows given the commonest text / rows (a failed sample, None, is a text of its own
    kind, counted once). One explanation for every vector (a memorised text) gives ``top_share`` 1."""
    n = len(texts)
    if not n:
        return {"distinct": 0.0, "top_share": 0.0}
    counts = Counter(texts)
    return {"distinct": len(counts) / n, "top_share": max(counts.values()) / n}


@dataclass(frozen=True)
class Sample:
    """One row shown next to its ground truth."""

    row: int
    explanation: str | None
    status: str
    mse_nrm: float
    facts: list[str] | None
    context: str | None
    reference: str | None


@dataclass
class EvalReport:
    """Everything ``nla eval`` writes (``eval.json`` via :meth:`to_dict`, ``eval.md`` via :meth:`to_markdown`)."""

    dataset: str
    n_rows: int
    d_model: int
    mse_scale: float | None
    baseline_raw_mean_mse: float
    baseline_normalized_mean_mse: float
    rows: list[EvalRow] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # a pair of several blocks: per block, per row name, {n, fve (against that block's own raw-mean
    # baseline), recall, precision}; None for a pair of one
    by_block: dict[int, dict[str, dict[str, float | None]]] | None = None

    def row(self, name: str) -> EvalRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"EvalReport: no row {name!r}; rows are {[r.name for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        return json_ready(asdict(self))

    def to_json(self) -> str:
        return dumps_json(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        lines = [
            f"# NLA evaluation: `{self.dataset}`",
            "",
            f"{self.n_rows} rows, d_model {self.d_model}, mse_scale {_fmt(self.mse_scale)}. FVE baseline (predict "
            f"the raw mean of normalised golds): MSE {self.baseline_raw_mean_mse:.4f}.",
            "",
            "| predictor | FVE | cosine | MSE mean | MSE p10 | p50 | p90 | failed | fact recall | fact precision "
            "| degenerate |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            f = r.faithfulness
            lines.append(
                f"| {r.name} | {r.fve:.4f} | {_fmt(r.cosine)} | {r.mse_mean:.4f} | {_fmt(r.mse_p10)} | "
                f"{_fmt(r.mse_p50)} | {_fmt(r.mse_p90)} | {r.failure_rate:.1%} | "
                f"{_fmt(f.recall if f else None)} | {_fmt(f.precision if f else None)} | "
                f"{_pct(r.degenerate['any']) if r.degenerate else '-'} |"
            )
        varied = [r for r in self.rows if r.diversity]
        if varied:
            lines += [""] + [f"{r.name}: {r.diversity['distinct']:.1%} of the explanations are distinct; the commonest "
                             f"is on {r.diversity['top_share']:.1%} of rows." for r in varied]
        notes = list(dict.fromkeys(r.faithfulness.note for r in self.rows if r.faithfulness and r.faithfulness.note))
        if notes:  # rows without ground truth are not graded (issue 48: all-null facts once graded 1.000)
            lines += [""] + [f"Fact recall / precision: {n}." for n in notes]
        kinds = [r for r in self.rows if r.faithfulness and r.faithfulness.by_kind]
        if kinds:
            lines += ["", "## Fact recall / precision by kind", "",
                      "| predictor | " + " | ".join(sorted(kinds[0].faithfulness.by_kind)) + " |",
                      "|---|" + "---|" * len(kinds[0].faithfulness.by_kind)]
            order = sorted(kinds[0].faithfulness.by_kind)
            for r in kinds:
                bk = r.faithfulness.by_kind
                cells = [f"{bk[k][0]:.2f} / {bk[k][1]:.2f}" if k in bk else "-" for k in order]
                lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
            counted = [r for r in kinds if r.faithfulness.said]
            if counted:  # precision over the claims made (the table counts a row not saying a kind as precise)
                told = any(shows_earlier(v) for r in counted for v in (r.faithfulness.stale or {}).values())
                lines += ["", "Claims said, and the share true, per kind"
                          + (" (and the share false but said earlier in the text read, no longer true at the token: "
                             "an object put down, a place left)" if told else "") + ": " + "; ".join(
                    f"{r.name}: " + ", ".join(f"{k} {n} ({p:.2f}" + _earlier(r.faithfulness.stale, k) + ")"
                                              for k, (n, p) in r.faithfulness.said.items())
                    for r in counted) + "."]
            unsure = [r for r in kinds if r.faithfulness.hedged]
            if unsure:  # wiki_explainer.unheld / world_explainer.fact_unheld hedge: not counted in the table
                lines += ["", "Said unsure (\"may\", \"Perhaps\"; counted as not said above): " + "; ".join(
                    f"{r.name}: " + ", ".join(f"{k} on {s:.2f} of rows, true on {t:.2f} of them"
                                              for k, (s, t) in r.faithfulness.hedged.items()) for r in unsure) + "."]
        lines += quote_table(self.rows)
        if self.by_block:
            names = list(next(iter(self.by_block.values())))
            lines += ["", "## By block", "",
                      "FVE against each block's own baseline (the mean of its normalised golds); fact recall / "
                      "precision of that block's rows, and the share of the facts claimed that are true (a row "
                      "claiming nothing is not counted there).", "",
                      "| block | rows | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
            for k, per in self.by_block.items():
                cells = []
                for name in names:
                    c = per.get(name) or {}
                    graded = (f" ({_fmt2(c['recall'])} / {_fmt2(c['precision'])}; claims true "
                              f"{_fmt2(c.get('claims_true'))})") if c and c.get("recall") is not None else ""
                    cells.append(f"{c['fve']:.4f}{graded}" if c else "-")
                n = next(iter(per.values()))["n"] if per else 0
                lines.append(f"| {k} | {n} | " + " | ".join(cells) + " |")
        if self.samples:
            lines += ["", "## Samples", ""]
            for s in self.samples:
                lines.append(f"- row {s.row} ({s.status}, mse {_fmt(s.mse_nrm)}): {s.explanation!r}")
                if s.facts is not None:
                    lines.append(f"  - facts: {', '.join(s.facts) or '(none)'}")
                if s.reference is not None:
                    lines.append(f"  - reference: {s.reference!r}")
                if s.context is not None:
                    lines.append(f"  - context: {s.context[-200:]!r}")
        return "\n".join(lines) + "\n"


def quote_table(rows: list[EvalRow]) -> list[str]:
    """Markdown: the quotation of the text's end graded per position (convention 3), one line per row
    with a graded quotation; nothing when none has one."""
    graded = [r for r in rows if r.faithfulness is not None and r.faithfulness.quote is not None
              and r.faithfulness.quote.n]
    if not graded:
        return []
    positions = sorted({p for r in graded for p in r.faithfulness.quote.by_position}, key=lambda k: int(k[6:-1]))
    lines = ["", "## Quotation of the text's end, unit by unit", "",
             "Each quoted word or mark is a claim about the text at its position from the end (quote[0] = the "
             "token read), graded against the row's text: recall / precision per position (a row without a "
             "quotation counts against recall only).", "",
             "| predictor | quotes | exactly the end | every unit true | " + " | ".join(positions) + " |",
             "|---|---|---|---|" + "---|" * len(positions)]
    for r in graded:
        q = r.faithfulness.quote
        cells = [" / ".join(_fmt2(v) for v in q.by_position[p]) if p in q.by_position else "-" for p in positions]
        lines.append(f"| {r.name} | {_fmt2(q.said)} | {_fmt2(q.exact)} | {_fmt2(q.all_true)} | " + " | ".join(cells)
                     + " |")
    hedging = [r for r in graded if r.faithfulness.quote.hedged]
    if hedging:  # quote_unheld: hedge (nla.world.explain.Hedged): not said above; how often right anyway
        lines += ["", "Said unsure (`The text may end with \"…\".`, counted as not said above): "
                  + "; ".join(f"{r.name} on {_fmt2(r.faithfulness.quote.hedged)} of rows, every unit true on "
                              f"{_fmt2(r.faithfulness.quote.hedged_true)} of them" for r in hedging) + "."]
    return lines


def shows_earlier(share: float | None) -> bool:
    """Whether a share of claims said earlier (``Faithfulness.stale``) is written: not where it rounds to 0.00
    (eval.md here, the report's per-kind table in ``nla.eval.report``)."""
    return share is not None and share >= 0.005


def _earlier(stale: dict[str, float] | None, kind: str) -> str:
    """``; 0.20 earlier`` where claims of ``kind`` were false but said earlier in the text read."""
    share = (stale or {}).get(kind)
    return f"; {share:.2f} earlier" if shows_earlier(share) else ""


def _fmt2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def _pct(x: float) -> str:
    return f"{x:.1%}"


# ------------------------------------------------------------------ primitives
def row_stats(name: str, mse: Tensor, cos: Tensor, raw_mean: float, failure_rate: float = 0.0,
              faith: Faithfulness | None = None, degenerate: dict[str, float] | None = None) -> EvalRow:
    """Table row from per-row mse [N] and cosine [N] (failures already filled per convention 1)."""
    q = torch.quantile(mse.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return EvalRow(name=name, fve=fve_of_mse(mse, raw_mean), cosine=float(cos.double().mean()),
                   mse_mean=float(mse.double().mean()), mse_p10=q[0], mse_p50=q[1], mse_p90=q[2],
                   failure_rate=failure_rate, faithfulness=faith, degenerate=degenerate)


def degeneracy_rates(texts: list[str | None], grader: DatasetGrader | None = None) -> dict[str, float]:
    """Share of ``texts`` flagged by each of the grader's format checks, and by ``any`` of them
    (convention 4; the world grader when None); None counts as not flagged."""
    grader = grader or get_grader("world")
    flags = [grader.degeneracy(t) for t in texts]
    n = max(1, len(flags))
    out = {"any": sum(any(f.values()) for f in flags) / n}
    out.update({k: sum(f[k] for f in flags) / n for k in grader.degeneracy_checks})
    return out


def _filled(result: ScoreResult, gold: Tensor, scale: float | None) -> tuple[Tensor, Tensor]:
    """Per-row (mse, cos) with failed samples charged per convention 1."""
    mse = charge_failures(result.mse_nrm, result.failed, failed_mse(gold, scale))
    cos = torch.where(result.failed, torch.zeros_like(result.cosine), result.cosine)
    return mse, cos


# ------------------------------------------------------------------ the evaluation
@dataclass
class _Eval:
    """What every row builder of one evaluation reads (and the report it appends to)."""

    client: NLAClient
    table: Any
    path: Path
    gold: Tensor  # [N, d] RAW
    dataset_rows: np.ndarray  # [N] parquet row of each evaluated row
    base: Any  # predict_mean_baselines at the AR's scale
    grader: DatasetGrader | None
    facts: list[list[str]] | None
    quote_truths: list[Any] | None  # per row what the text read ends with (the grader's quote_truths)
    batch_size: int
    max_new_tokens: int
    report: EvalReport
    blocks: list[int] | None = None  # [N] each row's block, for a pair of several blocks
    earlier: list[Any] | None = None  # per row what the text read named up to the token (the grader's earlier)
    per_row: dict[str, tuple[Tensor, list[str | None]]] = field(default_factory=dict)  # name -> (mse [N], texts)

    def graded(self, texts: list[str | None]) -> tuple[Faithfulness | None, dict[str, float] | None]:
        """Faithfulness (rows with facts) and degeneracy (any grader) of ``texts``."""
        if self.grader is None:
            return None, None
        faith = (faithfulness(texts, self.facts, self.grader, quotes=self.quote_truths, earlier=self.earlier)
                 if self.facts is not None else None)
        return faith, degeneracy_rates(texts, self.grader)

    def read(self, name: str, texts: list[str | None], reader: NLAClient | None = None,
             failure_rate: float | None = None,
             grades: tuple[Faithfulness | None, dict[str, float] | None] | None = None) -> None:
        """One row: ``reader``'s AR (the pair's by default) reconstructs ``texts``; failures charged
        per convention 1."""
        reader = reader or self.client
        res = reader.score(texts, self.gold, batch_size=self.batch_size, layer=self.blocks)
        mse, cos = _filled(res, self.gold, reader.ar_sidecar.mse_scale_value())
        self.per_row[name] = (mse, texts)
        faith, degen = grades if grades is not None else self.graded(texts)
        self.report.rows.append(row_stats(name, mse, cos, self.base.raw_mean,
                                          res.failure_rate if failure_rate is None else failure_rate, faith, degen))


def row_blocks(table: Any, path: Path, layers: Sequence[int]) -> list[int]:
    """The block of each row (``activation_layer``) of a dataset read by a pair for several blocks (``layers``);
    a dataset without the column is refused by name."""
    if "activation_layer" not in table.column_names:
        raise NLAClientError(f"dataset: {path} has no activation_layer column, but the pair reads several blocks "
                             f"({list(layers)}); evaluate on a dataset nla datagen built with those layers")
    return [int(k) for k in table.column("activation_layer").to_pylist()]


def load_eval_table(client: NLAClient, path: Path, max_rows: int | None, rng: np.random.Generator
                    ) -> tuple[Any, Tensor, np.ndarray]:
    """(table, RAW gold [N, d], parquet rows [N]) of the dataset, a seeded subset when ``max_rows``."""
    from nla.core.sidecar import sidecar_path_for
    from nla.datagen.io import read_parquet, read_vectors

    if not sidecar_path_for(path).is_file():
        raise FileNotFoundError(
            f"dataset: {path} has no sidecar {sidecar_path_for(path).name}; datasets are only usable with their "
            "sidecar (rebuild it with `nla datagen`)"
        )
    table = read_parquet(path)
    vectors = read_vectors(table)
    client.check_data(path, width=int(vectors.shape[1]))  # subject, layer, tokenizer: the pair's (nla.core.provenance)
    if vectors.shape[0] < 2:
        raise NLAClientError(f"dataset: {path} has {vectors.shape[0]} rows; FVE needs at least 2")
    if vectors.shape[1] != client.d_model:
        raise NLAClientError(
            f"dataset: {path} holds d={vectors.shape[1]} vectors but the checkpoints' sidecar says d_model="
            f"{client.d_model}; evaluate on data extracted from the same subject model"
        )
    dataset_rows = np.arange(vectors.shape[0])  # samples report rows of the parquet, not of the subset
    if max_rows is not None and max_rows < vectors.shape[0]:
        if max_rows < 2:
            raise NLAClientError(f"max_rows: FVE needs at least 2 rows, found {max_rows}")
        idx = np.sort(rng.choice(vectors.shape[0], size=max_rows, replace=False))
        table, vectors, dataset_rows = table.take(idx), vectors[idx], idx
    gold = torch.from_numpy(np.array(vectors, dtype=np.float32))  # a writable copy: arrow buffers are read-only
    return table, gold, dataset_rows


def _av_rows(ev: _Eval, frozen_ar: NLAClient | None, rng: np.random.Generator) -> tuple[list, ScoreResult]:
    """The AV's rows: the round trip, the frozen warm-start AR's reading of the same texts
    (convention 5) and the shuffled-vector control; returns (verbalizations, round-trip scores)."""
    client, gold, n = ev.client, ev.gold, ev.gold.shape[0]
    logger.info("eval: verbalizing %d rows", n)
    verbs, rt = client.round_trip(gold, max_new_tokens=ev.max_new_tokens, batch_size=ev.batch_size, layer=ev.blocks)
    texts = [v.explanation for v in verbs]
    mse, cos = _filled(rt, gold, client.ar_sidecar.mse_scale_value())
    ev.per_row[ROW_ROUND_TRIP] = (mse, texts)
    grades = ev.graded(texts)
    ev.report.rows.append(replace(row_stats(ROW_ROUND_TRIP, mse, cos, ev.base.raw_mean, rt.failure_rate, *grades),
                                  diversity=text_diversity(texts)))
    if frozen_ar is client:  # the pair's AR is the warm-start one (before RL): the same reading
        ev.report.rows.append(replace(ev.report.rows[-1], name=ROW_FROZEN))
    elif frozen_ar is not None:
        frozen_ar.require_ar("evaluate_pair(frozen_ar=...)")
        if frozen_ar.d_model != client.d_model:
            raise NLAClientError(f"frozen_ar: d_model {frozen_ar.d_model} differs from the pair's {client.d_model}")
        check_provenance([Provenance.of("the frozen AR", frozen_ar.ar_sidecar), *client.provenance()],
                         allow=client.allow_mixed_provenance, context="frozen_ar")
        ev.read(ROW_FROZEN, texts, reader=frozen_ar, grades=grades)  # same texts, same grades
    perm = torch.from_numpy(rng.permutation(n))
    logger.info("eval: verbalizing %d shuffled vectors", n)
    sverbs = client.verbalize(gold[perm], max_new_tokens=ev.max_new_tokens, batch_size=ev.batch_size,
                              layer=None if ev.blocks is None else [ev.blocks[int(i)] for i in perm])
    ev.read(ROW_SHUFFLED, [v.explanation for v in sverbs])
    return verbs, rt


def _text_rows(ev: _Eval, text_explainer_baseline: bool) -> tuple[list[str] | None, list[str] | None]:
    """Rows fed with texts, not the AV: the reference explanations, the dataset's text explainer
    (convention 7) and the oracle (convention 6); returns (reference, text-explainer texts)."""
    cols = ev.table.column_names
    reference = ev.table.column("explanation").to_pylist() if "explanation" in cols else None
    if reference is not None:
        ev.read("AR on reference explanations", reference)
    te = None
    if text_explainer_baseline and ev.grader is not None:
        te = ev.grader.text_explainer(ev.table, ev.path)
    if te is not None:
        ev.read("text explainer → AR", te, failure_rate=0.0)
    words = ev.grader.quotes(ev.table, ev.path) if ev.grader is not None and ev.facts is not None else None
    if words is not None:
        # the oracle names what the data explainer names (world_explainer.fact_min_prob: the held facts
        # firmly, fact_unheld hedge: the others unsure)
        facts, unsure = ev.grader.oracle_facts(ev.table, ev.path, ev.facts)
        oracle = [ev.grader.oracle(list(fs or []), w, int(r), **({"hedged": unsure[i]} if unsure and unsure[i] else {}))
                  for i, (fs, w, r) in enumerate(zip(facts, words, ev.dataset_rows, strict=True))]
        if all(o is not None for o in oracle):
            ev.read(ROW_ORACLE, oracle)
    return reference, te


def _by_block(ev: _Eval) -> dict[int, dict[str, dict[str, float | None]]]:
    """Each block's rows alone, for every row read so far: FVE against the block's own raw-mean baseline
    (what predicting that block's mean gives: blocks differ in scale and direction, so the pooled baseline
    would credit telling the blocks apart), and fact recall / precision of its rows, overall and per kind."""
    scale = ev.client.ar_sidecar.mse_scale_value()
    blocks = np.asarray(ev.blocks)
    out: dict[int, dict[str, dict[str, float | None]]] = {}
    for k in sorted(set(ev.blocks)):
        idx = np.flatnonzero(blocks == k)
        if len(idx) < 2:
            continue  # FVE needs two rows
        base = predict_mean_baselines(ev.gold[idx], scale)
        out[k] = {}
        for name, (mse, texts) in ev.per_row.items():
            sub = [texts[int(i)] for i in idx]
            faith = (faithfulness(sub, [ev.facts[int(i)] for i in idx], ev.grader,
                                  earlier=None if ev.earlier is None else [ev.earlier[int(i)] for i in idx])
                     if ev.grader is not None and ev.facts is not None else None)
            out[k][name] = {"n": len(idx), "fve": fve_of_mse(mse[torch.from_numpy(idx)], base.raw_mean),
                            "recall": None if faith is None else faith.recall,
                            "precision": None if faith is None else faith.precision,
                            "claims_true": _claims_true(ev, sub, idx) if faith is not None else None,
                            # kind -> [recall, precision] of this block's rows (the report sets them beside
                            # the probe's top-1 at that block)
                            "by_kind": None if faith is None else {kd: list(rp) for kd, rp in faith.by_kind.items()},
                            # kind -> [claims of it named, share true]: precision over the claims made (issue 59's
                            # bar; None: a grader whose grades do not count claims per kind)
                            "said": None if faith is None or not faith.said else
                            {kd: list(ns) for kd, ns in faith.said.items()},
                            # kind -> share of those claims false but said earlier in the text read (an
                            # object put down; None: a grader that does not tell them)
                            "stale": None if faith is None or faith.stale is None else dict(faith.stale)}
    return out


def _claims_true(ev: _Eval, texts: list[str | None], idx: np.ndarray) -> float | None:
    """The share of the facts claimed in ``texts`` that are true (precision over the claims made; the
    per-row precision above counts a row that claims nothing where something holds as 0, so a short
    true explanation of a block that holds little reads as imprecise there). None: no claim, or a grader
    whose grades do not count claims."""
    made = right = 0
    for t, i in zip(texts, idx, strict=True):
        g = ev.grader.grade(t or "", list(ev.facts[int(i)] or []))
        if g is None or not hasattr(g, "n_pred"):
            return None
        made, right = made + g.n_pred, right + g.n_correct
    return right / made if made else None


def _mean_rows(ev: _Eval) -> None:
    """The two predict-the-mean baselines (convention 2: only the raw one is FVE's denominator)."""
    scale = ev.client.ar_sidecar.mse_scale_value()
    g = normalize_activation(ev.gold, scale)
    mu = g.mean(0, keepdim=True).expand_as(g)
    ev.report.rows.append(row_stats("predict the mean (raw)", ((g - mu) ** 2).mean(-1), cosine(mu, g),
                                    ev.base.raw_mean))
    ev.report.rows.append(row_stats("predict the mean (normalised)", mse_nrm(mu, g, scale), cosine(mu, g),
                                    ev.base.raw_mean))


def _samples(ev: _Eval, show: list[int], verbs: list | None, rt: ScoreResult | None,
             reference: list[str] | None, te: list[str] | None) -> None:
    """The shown rows beside their ground truth."""
    cols = ev.table.column_names
    contexts = ev.table.column("context").to_pylist() if "context" in cols else None
    for i in show:
        if verbs is not None:
            expl, status, m = verbs[i].explanation, str(verbs[i].status), float(rt.mse_nrm[i])
        else:
            expl, status, m = None, "not verbalized (no AV)", float("nan")
        ev.report.samples.append(Sample(row=int(ev.dataset_rows[i]), explanation=expl, status=status, mse_nrm=m,
                                        facts=list(ev.facts[i] or []) if ev.facts is not None else None,
                                        context=contexts[i] if contexts is not None else None,
                                        reference=reference[i] if reference is not None
                                        else (te[i] if te is not None else None)))


def evaluate_pair(
    client: NLAClient,
    dataset_path: str | os.PathLike,
    *,
    max_rows: int | None = None,
    seed: int = 0,
    text_explainer_baseline: bool = True,
    n_show: int = 8,
    max_new_tokens: int = 150,
    batch_size: int = 64,
    frozen_ar: NLAClient | None = None,
    grader: str | DatasetGrader | None = None,
) -> EvalReport:
    """Evaluate ``client`` (AR required; AV optional) on a held-out parquet. See module docstring.

    ``frozen_ar``: a client holding a second AR (the warm-start one) that also reads the AV's
    explanations (convention 5); ``client`` itself when the pair's AR is the warm-start one,
    and the round-trip row is that reading (no second pass).

    ``grader``: the dataset's grader (``nla.core.graders``: a name or an instance); None takes the one
    the dataset names (``grader_for_table``). Without one, faithfulness is not measured.

    ``max_rows`` takes a seeded random subset (kept in dataset order); ``seed`` also draws the
    shuffled-vector permutation.
    """
    path = Path(dataset_path)
    ar_side = client.require_ar("evaluate_pair")
    rng = np.random.default_rng(seed)
    table, gold, dataset_rows = load_eval_table(client, path, max_rows, rng)
    n = gold.shape[0]
    scale = ar_side.mse_scale_value()
    try:
        base = check_spread(gold, scale, f"dataset {path}")
    except ValueError as err:
        raise NLAClientError(str(err)) from None
    if isinstance(grader, str):
        grader = get_grader(grader)
    elif grader is None:
        grader = grader_for_table(table)
    facts = table.column("facts").to_pylist() if "facts" in table.column_names else None
    report = EvalReport(dataset=str(path), n_rows=n, d_model=client.d_model, mse_scale=scale,
                        baseline_raw_mean_mse=base.raw_mean, baseline_normalized_mean_mse=base.normalized_mean)
    quote_truths = grader.quote_truths(table, Path(path)) if grader is not None else None
    blocks = None if ar_side.layers is None else row_blocks(table, path, ar_side.layers)
    ev = _Eval(client, table, path, gold, dataset_rows, base, grader, facts, quote_truths, batch_size, max_new_tokens,
               report, blocks, grader.earlier(table) if grader is not None and facts is not None else None)
    verbs, rt = _av_rows(ev, frozen_ar, rng) if client.av_model is not None else (None, None)
    reference, te = _text_rows(ev, text_explainer_baseline)
    _mean_rows(ev)
    if blocks is not None:
        report.by_block = _by_block(ev)
    show = sorted(rng.choice(n, size=min(n_show, n), replace=False).tolist()) if n_show > 0 else []
    _samples(ev, show, verbs, rt, reference, te)
    return report
