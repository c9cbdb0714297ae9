"""Stage 3, explain: fill `explanation` for the SFT splits with a pluggable explainer.

Every explainer implements `explain_batch(rows) -> list[str | None]`; `None`
means the row is dropped, and the explainer records why in `drops` (a Counter
of reason -> rows). Explainers are looked up by name in `EXPLAINERS`:
`world` (ground truth facts -> the world's TextExplainer), `context`
(offline, deterministic, for arbitrary text), `anthropic` and `openai`
(HTTP, in `nla.datagen.providers`). The interface and the registry live one layer down,
in `nla.datagen.explainer_base`, which both modules import.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

import nla.datagen.providers  # noqa: F401 - registers the HTTP explainers
import nla.datagen.wiki  # noqa: F401 - registers the wiki explainer
from nla.datagen.config import DatagenConfig
from nla.datagen.explainer_base import (  # noqa: F401 - re-exported: the stage's public names
    EXPLAINERS,
    Explainer,
    ExplainerFactory,
    extract_tagged,
    register_explainer,
    row_key,
)
from nla.datagen.io import DatagenError

log = logging.getLogger(__name__)


def make_explainer(name: str, cfg: DatagenConfig) -> Explainer:
    if name not in EXPLAINERS:
        raise DatagenError(f"explainer {name!r} is not registered; valid names: {sorted(EXPLAINERS)}")
    return EXPLAINERS[name](cfg)


class WorldExplainer(Explainer):
    """The world's TextExplainer over the row's revealed facts; key = hash of (doc_id, position)."""

    name = "world"

    def __init__(self, seed: int, min_facts: int, max_facts: int, wrong_rate: float, word_rate: float = 1.0,
                 fact_rate: float | None = None, quote_units: int | None = None, quote_unheld: str = "omit",
                 fact_unheld: str = "omit") -> None:
        super().__init__()
        from nla.world import TextExplainer

        self.quote_unheld = quote_unheld
        self.fact_unheld = fact_unheld

        self._text = TextExplainer(seed=seed, min_facts=min_facts, max_facts=max_facts, wrong_rate=wrong_rate,
                                   word_rate=word_rate, fact_rate=fact_rate, quote_units=quote_units)

    def explain_batch(self, rows: list[dict[str, Any]]) -> list[str | None]:
        from nla.world import Fact
        from nla.world.explain import QUOTE_HELD, row_quote, unheld_quote

        out: list[str | None] = []
        for r in rows:
            if "facts" not in r or r["facts"] is None:
                raise DatagenError(
                    f"world explainer: row doc_id={r.get('doc_id')} position={r.get('position')} has no 'facts' "
                    "column; the world explainer needs world activations (source: world)"
                )
            facts = frozenset(Fact(*s.split("=", 1)) for s in r["facts"])
            unsure: frozenset = frozenset()
            held = r.get(FACTS_HELD)
            if held is not None:  # fact_min_prob: only the facts the row's vector holds (add_facts_held)
                held = set(held)
                kept = frozenset(f for f in facts if f"{f.kind}={f.value}" in held)
                # fact_unheld hedge: the true facts the probe does not read said unsure, not left out (with
                # fact_omit_below only those of the kinds the row's block holds on enough rows: facts_unsure)
                unsure = facts - kept if self.fact_unheld == "hedge" else frozenset()
                if unsure and r.get(FACTS_UNSURE) is not None:
                    listed = set(r[FACTS_UNSURE])
                    unsure = frozenset(f for f in unsure if f"{f.kind}={f.value}" in listed)
                facts = kept
            # quote_held False: the probe says the vector does not hold the token read; quote nothing,
            # or say it unsure (quote_unheld: hedge)
            quote = unheld_quote(row_quote(r), r.get(QUOTE_HELD, True) is not False, self.quote_unheld)
            text = self._text.explain(facts, row_key(r["doc_id"], r["position"]), quote, hedged=unsure)
            if not text or not text.strip():
                self.drops["world_no_explanation"] += 1
                out.append(None)
            else:
                out.append(text.strip())
        return out


def by_block(tables: dict[str, pa.Table], fn: Any) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    """``fn(tables)`` on each block's rows alone when the rows come from several blocks (a probe fitted
    per block: what a vector holds differs with depth), the tables put back in their row order and the
    summaries given per block; ``fn(tables)`` itself for one block."""
    import numpy as np

    col = "activation_layer"
    if any(col not in t.column_names for t in tables.values()):
        return fn(tables)
    blocks = sorted({k for t in tables.values() for k in t.column(col).to_pylist()})
    if len(blocks) <= 1:
        return fn(tables)
    rows = {k: {n: np.flatnonzero(t.column(col).to_numpy() == k) for n, t in tables.items()} for k in blocks}
    done, summary = {}, {}
    for k in blocks:
        done[k], summary[k] = fn({n: t.take(pa.array(rows[k][n])) for n, t in tables.items()})
    out = {}
    for n in tables:
        order = np.concatenate([rows[k][n] for k in blocks])
        out[n] = pa.concat_tables([done[k][n] for k in blocks]).take(pa.array(np.argsort(order, kind="stable")))
    return out, {"by_block": summary}


FACTS_HELD = "facts_held"
# the row's true facts said unsure (world_explainer.fact_omit_below): the unheld facts of the kinds its block holds
# on enough rows; without the column every unheld fact is said unsure (fact_unheld hedge)
FACTS_UNSURE = "facts_unsure"


def add_facts_held(tables: dict[str, pa.Table], min_prob: float, every_own: bool = False,
                   gate_below: float | None = None, omit_below: float | None = None
                   ) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    """Each table with a ``facts_held`` column: the row's true facts its vector holds, a kind at a time: a
    linear probe of the kind (``nla.core.probing.held_labels``: a softmax over its facts and "none") ranks one
    of the row's own facts first, and the row's own facts of the kind have probability >= ``min_prob``.
    Cross-fitted over the warm-start splits' documents as ``add_quote_held``; the ``rl`` rows read by the probe fitted on all of them. The world explainer then
    names only held facts (``world_explainer.fact_min_prob``): a block that holds little gets a short, true
    explanation, not a confident wrong one (issue 59). ``every_own``: a row's every own fact of a kind the
    probe ranks among its first (two persons both; ``held_labels``), the rule of ``fact_unheld: hedge``;
    without it one fact a kind (the rule the layers preset was measured with). ``gate_below``: only a kind
    the probe holds on fewer than this share of the warm-start rows where it is true is gated row by row; a
    kind held more often counts as held wherever it is true (``world_explainer.fact_gate_below``).
    ``omit_below``: also a ``facts_unsure`` column, the row's true facts not held of the kinds the probe holds
    on at least this share of those rows (said unsure; the other unheld facts are left out:
    ``world_explainer.fact_omit_below``). Returns the tables and a summary: the share of each kind's rows
    (where the kind is true) whose fact is held, per split, the kinds gated row by row and the kinds whose
    unheld facts are left out."""
    import numpy as np

    from nla.core.probing import held_labels
    from nla.datagen.io import read_vectors, require_split_columns
    from nla.world.facts import KINDS

    fit = [n for n in ("av_sft", "ar_sft") if n in tables]
    require_split_columns(tables, ("facts", "doc_id", "activation_vector"), "fact_min_prob",
                          "the probe needs world activations with their facts (source: world)")
    facts = {n: [list(f or []) for f in t.column("facts").to_pylist()] for n, t in tables.items()}
    x = np.concatenate([read_vectors(tables[n]) for n in fit]) if fit else np.zeros((0, 0), np.float32)
    groups = [d for n in fit for d in tables[n].column("doc_id").to_pylist()]
    others = [n for n in tables if n not in fit]
    x_other = np.concatenate([read_vectors(tables[n]) for n in others]) if others else None
    held_fit: list[list[str]] = [[] for _ in groups]
    held_other: list[list[str]] = [[] for _ in range(0 if x_other is None else len(x_other))]
    fit_facts = [f for n in fit for f in facts[n]]
    other_facts = [f for n in others for f in facts[n]]
    share: dict[str, dict[str, float | None]] = {n: {} for n in tables}
    gated: list[str] = []
    probe_share: dict[str, float] = {}  # the probe's held share of each kind on the warm-start rows
    for kind in KINDS:
        prefix = f"{kind}="
        labels = [[f for f in fs if f.startswith(prefix)] for fs in fit_facts]
        if sum(bool(lab) for lab in labels) < 2:
            continue  # a kind the splits hardly hold: never said where a probe cannot learn it
        labels_other = [[f for f in fs if f.startswith(prefix)] for fs in other_facts] if x_other is not None else None
        a, b = held_labels(x, labels, groups, min_prob, x_other=x_other, labels_other=labels_other,
                           every_own=every_own)
        has = [bool(lab) for lab in labels]
        fit_share = sum(bool(h) for h, t in zip(a, has, strict=True) if t) / max(1, sum(has))
        probe_share[kind] = round(fit_share, 4)
        if gate_below is not None and fit_share >= gate_below:
            # a kind the vectors hold on most rows: its rare misread rows are not gated (measured: gating them
            # cost recall and precision both, the AV leaving out facts it would have named right)
            a = [list(lab) for lab in labels]
            b = [list(lab) for lab in labels_other] if labels_other is not None else None
        else:
            gated.append(kind)
        for rows_held, verdicts in ((held_fit, a), (held_other, b or [])):
            for i, h in enumerate(verdicts):
                if isinstance(h, list):
                    rows_held[i].extend(h)
                elif h is not None:
                    rows_held[i].append(h)
    # the kinds said unsure where unheld (omit_below): those the probe holds on enough rows; a kind it never
    # learnt (too few rows) is in none, so its facts are left out as they always were
    unsure_kinds = None if omit_below is None else {k for k, v in probe_share.items() if v >= omit_below}
    out, start, start_o = dict(tables), 0, 0
    for n in tables:
        k = tables[n].num_rows
        if n in fit:
            rows, start = held_fit[start:start + k], start + k
        else:
            rows, start_o = held_other[start_o:start_o + k], start_o + k
        out[n] = tables[n].append_column(FACTS_HELD, pa.array([sorted(r) for r in rows], pa.list_(pa.string())))
        if unsure_kinds is not None:
            unsure = [sorted(f for f in fs if f not in r and f.partition("=")[0] in unsure_kinds)
                      for fs, r in zip(facts[n], rows, strict=True)]
            out[n] = out[n].append_column(FACTS_UNSURE, pa.array(unsure, pa.list_(pa.string())))
        for kind in KINDS:
            has = [any(f.startswith(f"{kind}=") for f in fs) for fs in facts[n]]
            held = [any(f.startswith(f"{kind}=") for f in r) for r in rows]
            n_has = sum(has)
            share[n][kind] = round(sum(h for h, t in zip(held, has, strict=True) if t) / n_has, 4) if n_has else None
        log.info("explain: the probes read the facts at p >= %.2f: %s of %s's rows where each kind is true",
                 min_prob, share[n], n)
    if gate_below is not None:
        log.info("explain: the probe holds each kind on %s of the warm-start rows where it is true; gated row by "
                 "row (< %.2f): %s", probe_share, gate_below, ", ".join(gated) or "none")
    if unsure_kinds is not None:
        log.info("explain: unheld facts said unsure for %s; left out for the kinds held on fewer than %.2f of rows",
                 ", ".join(sorted(unsure_kinds)) or "no kind", omit_below)
    return out, {"min_prob": min_prob, "share": share, "probe_share": probe_share, "gated": gated,
                 "gate_below": gate_below, "omit_below": omit_below,
                 "omitted": None if unsure_kinds is None else sorted(set(probe_share) - unsure_kinds)}


def add_quote_held(tables: dict[str, pa.Table], min_prob: float) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    """Each table with a ``quote_held`` column: whether a linear probe reads the row's token read (the last
    unit of its ``text_end``) from its vector with probability >= ``min_prob``
    (``nla.core.probing.held_units``). The probe learns from the warm-start splits (``av_sft`` and
    ``ar_sft``), each row read by the probe fitted on the other half of their documents; the ``rl``
    rows (held-out documents, eval among them) by the probe fitted on all of them. The world
    explainer quotes firmly only where it is true (elsewhere nothing, or the quotation said unsure:
    ``world_explainer.quote_unheld``), so what the AV learns to claim is what the vector holds.
    Returns the tables and a summary (the share held per split)."""
    import numpy as np

    from nla.core.probing import held_units
    from nla.datagen.io import read_vectors, require_split_columns

    # the world's modules are imported here, not at the top: the RL loop imports this module, not the world
    from nla.world.explain import QUOTE_HELD
    from nla.world.facts import text_units

    fit = [n for n in ("av_sft", "ar_sft") if n in tables]
    require_split_columns(tables, ("text_end", "doc_id", "activation_vector"), "quote_min_prob",
                          "the probe needs world activations written by this version of datagen (rerun extract)")

    def unit(end: str | None) -> str | None:
        units = text_units(end) if end else []
        return units[-1] if units else None

    units = {n: [unit(e) for e in t.column("text_end").to_pylist()] for n, t in tables.items()}
    x = np.concatenate([read_vectors(tables[n]) for n in fit]) if fit else np.zeros((0, 0), np.float32)
    u = [w for n in fit for w in units[n]]
    groups = [d for n in fit for d in tables[n].column("doc_id").to_pylist()]
    # a row without a unit (no text_end) quotes nothing: it is never held, and never fits the probe
    has = np.array([w is not None for w in u], dtype=bool)
    if has.sum() < 2:
        raise DatagenError(f"quote_min_prob: the warm-start splits have {int(has.sum())} rows with a text_end; "
                           "the probe needs some to learn from")
    x_other = {n: read_vectors(t) for n, t in tables.items() if n not in fit}
    other_names = list(x_other)
    other_x = np.concatenate([x_other[n] for n in other_names]) if other_names else None
    other_u = [w or "" for n in other_names for w in units[n]] if other_names else None
    held_fit, held_other = held_units(x[has], [w for w, h in zip(u, has, strict=True) if h],
                                      [g for g, h in zip(groups, has, strict=True) if h], min_prob,
                                      x_other=other_x, units_other=other_u)
    flags = np.zeros(len(u), dtype=bool)
    flags[has] = held_fit
    out, summary, start = dict(tables), {}, 0
    for n in fit:
        k = tables[n].num_rows
        out[n] = tables[n].append_column(QUOTE_HELD, pa.array(flags[start:start + k].tolist(), pa.bool_()))
        start += k
    start = 0
    for n in other_names:
        k = tables[n].num_rows
        f = [bool(h) and w is not None for h, w in zip(held_other[start:start + k], units[n], strict=True)]
        out[n] = tables[n].append_column(QUOTE_HELD, pa.array(f, pa.bool_()))
        start += k
    for n, t in out.items():
        col = t.column(QUOTE_HELD).to_pylist()
        summary[n] = round(sum(col) / len(col), 4) if col else None
        log.info("explain: the probe reads the token read at p >= %.2f on %.1f%% of %s's rows", min_prob,
                 100 * (summary[n] or 0.0), n)
    return out, {"min_prob": min_prob, "share": summary}


@register_explainer("world")
def _world(cfg: DatagenConfig) -> Explainer:
    w = cfg.world_explainer
    return WorldExplainer(cfg.seed, w.min_facts, w.max_facts, w.wrong_rate, w.word_rate, w.fact_rate, w.quote_units,
                          w.quote_unheld, w.fact_unheld)


_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'-]*")
_STOP = frozenset(
    "the a an and or but of to in on at for with from by is was were are be been it its this that these those "
    "he she they we you i his her their our your my me him them as so then than there here not no yes do did "
    "has have had will would can could should about into over after before when while where which who what".split()
)


class ContextExplainer(Explainer):
    """Offline and deterministic: names the current token, the words just before it and the main topics.

    A baseline for arbitrary text when no API is at hand; it sees the same
    context an API explainer would and says only what is literally there.
    """

    name = "context"

    def __init__(self, n_recent: int = 6, n_topics: int = 3) -> None:
        super().__init__()
        self.n_recent = n_recent
        self.n_topics = n_topics

    def explain_one(self, context: str, token: str) -> str | None:
        words = _WORD_RE.findall(context or "")
        if not words:
            return None
        current = (token or "").strip() or words[-1]
        recent = " ".join(words[-self.n_recent - 1 : -1]) if len(words) > 1 else ""
        counts = Counter(w.lower() for w in words if len(w) > 2 and w.lower() not in _STOP)
        first_seen = {w: i for i, w in reversed(list(enumerate(w.lower() for w in words)))}
        topics = sorted(counts, key=lambda w: (-counts[w], first_seen[w]))[: self.n_topics]
        parts = [f'The current token is "{current}"']
        parts[0] += f', right after "{recent}".' if recent else ", at the start of the text."
        if topics:
            listed = topics[0] if len(topics) == 1 else ", ".join(topics[:-1]) + " and " + topics[-1]
            parts.append(f"The text so far is mostly about {listed}.")
        return " ".join(parts)

    def explain_batch(self, rows: list[dict[str, Any]]) -> list[str | None]:
        out = []
        for r in rows:
            text = self.explain_one(r.get("context", ""), r.get("token", ""))
            if text is None:
                self.drops["empty_context"] += 1
            out.append(text)
        return out


@register_explainer("context")
def _context(cfg: DatagenConfig) -> Explainer:
    return ContextExplainer()


def explain_table(
    table: pa.Table, explainer: Explainer, batch_size: int = 64, desc: str = "explain"
) -> tuple[pa.Table, Counter]:
    """Add an `explanation` column; rows the explainer returns None for are dropped and counted by reason."""
    needed = [c for c in ("doc_id", "position", "context") if c not in table.column_names]
    if needed:
        raise DatagenError(
            f"explain: columns {needed} missing from the activations table; found {table.column_names}"
        )
    light = [c for c in table.column_names if c != "activation_vector"]  # never materialise vectors as lists
    before = Counter(explainer.drops)
    explanations: list[str | None] = []
    with tqdm(total=table.num_rows, desc=desc, unit="row") as bar:
        for start in range(0, table.num_rows, batch_size):
            rows = table.slice(start, batch_size).select(light).to_pylist()
            got = explainer.explain_batch(rows)
            if len(got) != len(rows):
                raise RuntimeError(
                    f"explainer {explainer.name!r} returned {len(got)} results for {len(rows)} rows; expected one per row"
                )
            explanations += got
            bar.update(len(rows))
    dropped = Counter(explainer.drops)
    dropped.subtract(before)
    dropped = +dropped
    n_none = sum(e is None for e in explanations)
    if sum(dropped.values()) < n_none:  # an explainer that forgot to give a reason still gets counted
        dropped["unspecified"] += n_none - sum(dropped.values())
    keep = pa.array([e is not None for e in explanations])
    out = table.append_column("explanation", pa.array(explanations, pa.string())).filter(keep)
    return out, dropped
