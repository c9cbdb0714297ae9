"""The quickstart report: one Markdown page (+ JSON) a researcher opens instead of the logs."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import yaml

# nla.eval.evaluate's row names (the oracle row is the reader's ceiling for true explanations).
from nla.eval.evaluate import ROW_FROZEN as FROZEN
from nla.eval.evaluate import ROW_ORACLE as ORACLE
from nla.eval.evaluate import ROW_ROUND_TRIP as ROUND_TRIP
from nla.eval.evaluate import ROW_SHUFFLED as SHUFFLED
from nla.eval.evaluate import shows_earlier
from nla.eval.suite import block_targets_table, targets_table
from nla.util.fsutil import copy_file_atomic
from nla.util.numerics import cpu_kernels, cpu_paths, describe_cpu_paths, pin_shortfalls

logger = logging.getLogger(__name__)



def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}" if isinstance(x, (int, float)) else str(x)


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in report["rows"]}


def comparison_table(warm: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Eval rows of the warm-started pair and the RL pair side by side."""
    w, a = _rows(warm), _rows(after)
    lines = ["| predictor | FVE warm | FVE RL | cosine warm | cosine RL | recall warm | recall RL | "
             "precision warm | precision RL | degenerate warm | degenerate RL | failed warm | failed RL |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in [r["name"] for r in warm["rows"]]:
        rw, ra = w[name], a.get(name, {})
        fw, fa = rw.get("faithfulness") or {}, ra.get("faithfulness") or {}
        lines.append(
            f"| {name} | {_f(rw.get('fve'))} | {_f(ra.get('fve'))} | {_f(rw.get('cosine'))} | {_f(ra.get('cosine'))} | "
            f"{_f(fw.get('recall'))} | {_f(fa.get('recall'))} | {_f(fw.get('precision'))} | {_f(fa.get('precision'))} | "
            f"{_f((rw.get('degenerate') or {}).get('any'), 2)} | {_f((ra.get('degenerate') or {}).get('any'), 2)} | "
            f"{_f(rw.get('failure_rate'), 2)} | {_f(ra.get('failure_rate'), 2)} |")
    return lines


def examples(warm: dict[str, Any], after: dict[str, Any], n: int = 6) -> list[str]:
    by_row = {s["row"]: s for s in warm.get("samples", [])}
    lines = []
    for s in after.get("samples", [])[:n]:
        w = by_row.get(s["row"], {})
        ctx = (s.get("context") or "").replace("\n", " ")
        lines += [f"**row {s['row']}** — context: “…{ctx[-120:]}”  ",
                  f"ground truth: `{', '.join(s.get('facts') or [])}`  ",
                  f"data explainer: {s.get('reference') or '–'}  ",
                  f"warm-start AV: {w.get('explanation') or '(' + str(w.get('status')) + ')'} "
                  f"(mse {_f(w.get('mse_nrm'))})  ",
                  f"after RL: {s.get('explanation') or '(' + str(s.get('status')) + ')'} (mse {_f(s.get('mse_nrm'))})",
                  ""]
    return lines


def extraction_layer(probe: dict[str, Any] | None) -> int | None:
    """The block the run's vectors were read at: ``extraction_layer`` where the quickstart set it (a one-block
    pair at ``datagen.layer_index``), else the world's ``default_layer`` (the datagen's default)."""
    probe = probe or {}
    return probe.get("extraction_layer", probe.get("default_layer"))


def probe_table(probe: dict[str, Any]) -> list[str]:
    """The per-layer probe (``nla.world.probe``) as Markdown, the extraction layer marked."""
    layers = probe.get("layers") or []
    if not layers:
        return []
    kinds = [k["kind"] for k in layers[0]["kinds"]]
    # the quotation's probes, at the layers probed for them (none in probes written before issue 57)
    quotes = list(dict.fromkeys(k["kind"] for r in layers for k in r.get("quotes") or []))
    lines = ["| layer | " + " | ".join(kinds) + " | mean top-1 | chance |" + "".join(f" {q} |" for q in quotes),
             "|---" * (len(kinds) + 3 + len(quotes)) + "|"]
    for r in layers:
        by = {k["kind"]: k["top1"] for k in r["kinds"] + (r.get("quotes") or [])}
        mark = " (extraction layer)" if r["layer"] == extraction_layer(probe) else ""
        lines.append(f"| {r['layer']}{mark} | " + " | ".join(_f(by.get(k), 2) for k in kinds)
                     + f" | **{_f(r['mean_top1'])}** | {_f(r['mean_chance'])} |"
                     + "".join(f" {_f(by.get(q), 2)} |" for q in quotes))
    return lines


def _faith(row: dict[str, Any] | None, key: str) -> float | None:
    return ((row or {}).get("faithfulness") or {}).get(key)


# Kinds nothing is ever true of: ``other``, the sentences in no claim form (nla.datagen.wiki). Their
# recall is 1.0 by the graders' convention (a kind said but not true misses nothing) and means
# nothing, so the report shows none and never calls such a kind unread.
NO_RECALL_KINDS = frozenset({"other"})


def kind_table(warm: dict[str, Any], after: dict[str, Any], probe: dict[str, Any] | None = None) -> list[str]:
    """Round-trip recall / precision per fact kind, warm-start and after RL, beside what the probe
    reads of that kind at the extraction layer (what a faithful verbalizer could name)."""
    rt_w = (_rows(warm).get(ROUND_TRIP) or {}).get("faithfulness") or {}
    rt_a = (_rows(after).get(ROUND_TRIP) or {}).get("faithfulness") or {}
    bw, ba = rt_w.get("by_kind") or {}, rt_a.get("by_kind") or {}
    if not bw and not ba:
        return []
    at = [r for r in (probe or {}).get("layers") or [] if r["layer"] == extraction_layer(probe)]
    top1 = {k["kind"]: k["top1"] for k in at[0]["kinds"]} if at else {}
    order = list(top1) if top1 else []  # the probe's order (the dataset's own), then any other kind
    kinds = [k for k in order if k in bw or k in ba] + sorted((set(bw) | set(ba)) - set(order))
    # facts said unsure (world_explainer.fact_unheld / wiki_explainer.unheld hedge): not in recall or
    # precision; the share of rows saying the kind unsure, and how often that is true anyway
    uw, ua = rt_w.get("hedged") or {}, rt_a.get("hedged") or {}
    unsure = bool(uw or ua)

    def _u(h: Any) -> str:
        return "–" if not h else f"{_f(h[0], 2)} ({_f(h[1], 2)})"

    lines = ["| kind | probe top-1 | recall warm | precision warm | recall RL | precision RL |"
             + (" unsure warm (true) | unsure RL (true) |" if unsure else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if unsure else "")]
    for k in kinds:
        w, a = bw.get(k) or (None, None), ba.get(k) or (None, None)
        if k in NO_RECALL_KINDS:
            w, a = (None, w[1]), (None, a[1])
        lines.append(f"| {k} | {_f(top1.get(k), 2)} | {_f(w[0], 2)} | {_f(w[1], 2)} | {_f(a[0], 2)} | {_f(a[1], 2)} |"
                     + (f" {_u(uw.get(k))} | {_u(ua.get(k))} |" if unsure else ""))
    # the quotation's positions the language quotes, beside what the unit probe reads there (issue 57)
    qw = ((rt_w.get("quote") or {}).get("by_position")) or {}
    qa = ((rt_a.get("quote") or {}).get("by_position")) or {}
    qprobe = {k["kind"]: k["top1"] for k in (at[0].get("quotes") or [])} if at else {}
    for q in sorted(set(qw) | set(qa)):
        w, a = qw.get(q) or (None, None), qa.get(q) or (None, None)
        if w[1] is None and a[1] is None and not (w[0] or a[0]):
            continue  # a position the language does not quote (no claim there, nothing recalled)
        lines.append(f"| {q} (quotation) | {_f(qprobe.get(q), 2)} | {_f(w[0], 2)} | {_f(w[1], 2)} | {_f(a[0], 2)} | "
                     f"{_f(a[1], 2)} |" + (" – | – |" if unsure else ""))
    return lines


def _blocks(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """An eval report's per-block figures (``by_block``), keyed by block number (a cached stage's JSON has
    them as strings)."""
    return {int(k): v for k, v in sorted((report.get("by_block") or {}).items(), key=lambda kv: int(kv[0]))}


def _probe_by_kind(kinds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One block's probe figures per kind, as ``block_summary`` keys them (None: a probe written before the figure)."""
    return {"probe_by_kind": {p["kind"]: p["top1"] for p in kinds},
            "probe_recall_top1_by_kind": {p["kind"]: p.get("recall_top1") for p in kinds},
            "probe_recall_p90_by_kind": {p["kind"]: p.get("recall_p90") for p in kinds}}


def block_summary(warm: dict[str, Any], after: dict[str, Any],
                  probe: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """Per block of a pair for several blocks (issue 59): the round trip's FVE (each block against its own
    baseline) warm-start and after RL, the oracle's after RL, recall / precision (overall and per kind) after
    RL, the claims of each kind made and the share true, and the probe at that block per kind: its top-1, that
    as fact recall, and the most of it a reader keeps at 0.90 of its claims true (``nla.world.probe``; None in
    a probe written before they were measured); {} for a pair of one block."""
    bw, ba = _blocks(warm), _blocks(after)
    layers = {r["layer"]: r for r in (probe or {}).get("layers") or []}
    out: dict[int, dict[str, Any]] = {}
    for k in sorted(set(bw) | set(ba)):
        w, a = (bw.get(k) or {}).get(ROUND_TRIP) or {}, (ba.get(k) or {}).get(ROUND_TRIP) or {}
        at = layers.get(k)
        kinds = at["kinds"] if at else []
        out[k] = {"rows": a.get("n", w.get("n")), "fve_warmstart": w.get("fve"), "fve_rl": a.get("fve"),
                  "oracle_fve_rl": ((ba.get(k) or {}).get(ORACLE) or {}).get("fve"),
                  "recall_rl": a.get("recall"), "precision_rl": a.get("precision"), "claims_true_rl": a.get("claims_true"),
                  "by_kind_rl": a.get("by_kind") or {},
                  "said_by_kind_rl": a.get("said") or {}, "stale_by_kind_rl": a.get("stale") or {},
                  "probe_mean_top1": at["mean_top1"] if at else None, **_probe_by_kind(kinds)}
    return out


def one_block_summary(after: dict[str, Any], probe: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """A pair of one block as ``block_summary``'s per-kind entries at its extraction layer (``kind_cells`` reads
    them): {} without a probe at that layer or per-kind figures."""
    at = [r for r in (probe or {}).get("layers") or [] if r["layer"] == extraction_layer(probe)]
    rt = (_rows(after).get(ROUND_TRIP) or {}).get("faithfulness") or {}
    if not at or not rt.get("by_kind"):
        return {}
    return {int(at[0]["layer"]): {"by_kind_rl": rt["by_kind"], "said_by_kind_rl": rt.get("said") or {},
                                  **_probe_by_kind(at[0]["kinds"])}}


def one_block_lines(one: dict[int, dict[str, Any]]) -> list[str]:
    """A pair of one block's per-kind measure (``one_block_summary``) as the report's lines: each kind's probe
    top-1 (as fact recall; the most a reader keeps at 0.90 true) and the share of the AV's claims of it that are
    true after RL, then ``kind_cells_line``; empty without it."""
    if not one:
        return []
    (k, b), = one.items()
    said = b["said_by_kind_rl"]
    cells = [f"{kind} {_f(top1, 2)} ({_f(b['probe_recall_top1_by_kind'].get(kind), 2)}; "
             f"{_f(b['probe_recall_p90_by_kind'].get(kind), 2)}) · {_f(said[kind][1], 2) if kind in said else '–'}"
             for kind, top1 in b["probe_by_kind"].items() if kind in b["by_kind_rl"]]
    return [f"At block {k}, each kind: the probe's top-1 (as fact recall; the most a reader keeps with 0.90 of its "
            f"claims true) · the share of the AV's claims of it true after RL (– where it names none): "
            + "; ".join(cells) + ".", "", *kind_cells_line(kind_cells(one)), ""]


def kind_cells_line(c: dict[str, Any]) -> list[str]:
    """``kind_cells`` as the report's sentences (empty without cells)."""
    if not c:
        return []

    def _n(rule: str) -> str:
        return "not measured (a probe written before it)" if c[rule] is None else f"**{c[rule]} of {c['cells']}**"
    out = [f"Issue 59's per-kind measure, a cell met where its recall is within {KIND_RECALL_MARGIN:.2f} of the probe "
           f"and at least {CLAIMS_TRUE_BAR:.2f} of its claims are true: against the probe's top-1, {_n('top1')}; "
           f"against it as fact recall, {_n('top1_recall')}; at least the reader's at 0.90 true less "
           f"{KIND_RECALL_MARGIN:.2f}, {_n('p90')}. Claims ≥ {CLAIMS_TRUE_BAR:.2f} true (or none made) in "
           f"{c['claims_true']} of {c['cells']} cells."]
    if c["misses"].get("p90"):
        out.append(f"Missed at 0.90 true: {', '.join(c['misses']['p90'])}.")
    return out


# Issue 59's per-kind measure: a kind's recall within this of what the probe reads at that block, and at least
# CLAIMS_TRUE_BAR of the claims of the kind made there true (a kind not named at all says nothing false).
KIND_RECALL_MARGIN = 0.10
CLAIMS_TRUE_BAR = 0.90


def kind_cells(blocks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Issue 59's per-kind measure over the (kind, block) cells of ``block_summary``, three ways, each with the
    claims of the kind ≥ ``CLAIMS_TRUE_BAR`` true (or none made):

    - ``top1``: recall within ``KIND_RECALL_MARGIN`` of the probe's top-1 either way (the issue's words; a kind
      with two true facts, the world's persons, has a top-1 of one guess against a recall of both);
    - ``top1_recall``: the same against the probe's top-1 as fact recall (``recall_top1``: the same units);
    - ``p90``: recall at least the probe's ``recall_p90`` less the margin (the most a reader of the probe keeps
      with 0.90 of its claims true; over it is met).

    Returns ``{"cells": n, rule: met, "claims_true": met, "misses": {rule: ["kind@block", ...]}}``; a rule whose
    probe figure is missing in a cell (a probe written before it) counts None. {} without per-kind figures."""
    rules = ("top1", "top1_recall", "p90")
    met = dict.fromkeys(rules, 0)
    misses: dict[str, list[str]] = {r: [] for r in rules}
    unknown: set[str] = set()
    n = true_ok = 0
    for k, b in blocks.items():
        for kind, top1 in (b.get("probe_by_kind") or {}).items():
            rp = (b.get("by_kind_rl") or {}).get(kind)
            if kind in NO_RECALL_KINDS or not rp or rp[0] is None or top1 is None:
                continue
            n += 1
            said = (b.get("said_by_kind_rl") or {}).get(kind)
            true_enough = said is None or said[1] >= CLAIMS_TRUE_BAR
            true_ok += true_enough
            bound = {"top1": top1, "top1_recall": (b.get("probe_recall_top1_by_kind") or {}).get(kind),
                     "p90": (b.get("probe_recall_p90_by_kind") or {}).get(kind)}
            for rule in rules:
                if bound[rule] is None:
                    unknown.add(rule)
                    continue
                near = (abs(rp[0] - bound[rule]) if rule != "p90" else bound[rule] - rp[0]) <= KIND_RECALL_MARGIN
                if near and true_enough:
                    met[rule] += 1
                else:
                    misses[rule].append(f"{kind}@{k}")
    if not n:
        return {}
    return {"cells": n, **{r: (None if r in unknown else met[r]) for r in rules}, "claims_true": true_ok,
            "misses": {r: v for r, v in misses.items() if r not in unknown}}


def block_tables(blocks: dict[int, dict[str, Any]]) -> list[str]:
    """``block_summary`` as two Markdown tables: the figures of each block, then per kind after RL the probe at
    that block (what a faithful verbalizer could name there) beside the AV's recall and its claims' truth, and
    the count of (kind, block) cells meeting issue 59's per-kind measure (``kind_cells``)."""
    if not blocks:
        return []
    lines = ["| block | rows | probe mean top-1 | FVE warm | FVE RL | oracle RL | recall RL | precision RL | "
             "claimed facts true RL |", "|---|---|---|---|---|---|---|---|---|"]
    for k, b in blocks.items():
        lines.append(f"| {k} | {b['rows']} | {_f(b['probe_mean_top1'], 2)} | {_f(b['fve_warmstart'])} | "
                     f"{_f(b['fve_rl'])} | {_f(b['oracle_fve_rl'])} | {_f(b['recall_rl'], 2)} | "
                     f"{_f(b['precision_rl'], 2)} | {_f(b['claims_true_rl'], 2)} |")
    kinds: list[str] = []  # the probe's order (the dataset's own), then any other kind, each once
    for b in blocks.values():
        for k in [*b["probe_by_kind"], *b["by_kind_rl"]]:
            if k not in kinds and k not in NO_RECALL_KINDS:
                kinds.append(k)
    if not kinds:
        return lines
    said_any = any(b.get("said_by_kind_rl") for b in blocks.values())
    lines += ["", "Per kind after RL, each block: the probe's top-1 (as fact recall; the most of that a reader keeps "
              "with 0.90 of its claims true) · the AV's recall / precision"
              + (" · the share of its claims of the kind that are true (– where it names none)" if said_any else "")
              + (" (in brackets, the share false but said earlier in the text read, no longer true at the token: "
                 "an object put down)" if any(shows_earlier(v) for b in blocks.values()
                                              for v in (b.get("stale_by_kind_rl") or {}).values()) else "")
              + ".", "", "| kind | " + " | ".join(f"block {k}" for k in blocks) + " |", "|---|" + "---|" * len(blocks)]
    for kind in kinds:
        cells = []
        for b in blocks.values():
            rp = b["by_kind_rl"].get(kind) or (None, None)
            said = (b.get("said_by_kind_rl") or {}).get(kind)
            extra = [b.get("probe_recall_top1_by_kind", {}).get(kind), b.get("probe_recall_p90_by_kind", {}).get(kind)]
            probe = _f(b["probe_by_kind"].get(kind), 2) + (
                f" ({_f(extra[0], 2)}; {_f(extra[1], 2)})" if any(v is not None for v in extra) else "")
            stale = (b.get("stale_by_kind_rl") or {}).get(kind)
            cells.append(f"{probe} · {_f(rp[0], 2)} / {_f(rp[1], 2)}"
                         + (f" · {_f(said[1], 2) if said else '–'}" if said_any else "")
                         + (f" ({_f(stale, 2)} earlier)" if said and shows_earlier(stale) else ""))
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    c = kind_cells(blocks)
    if c:
        lines += ["", *kind_cells_line(c)]
    return lines


# A kind the warm-started AV names no more often truly than it does from shuffled vectors (recall within
# this of the shuffled row's) is one it does not read; RL seldom adds such a kind (dev/LOG.md, "The
# warm-start is a per-kind lottery"). Graded against ground truth: a report line, never a reward.
UNREAD_MARGIN = 0.05
UNREAD_PROBE_MIN = 0.5  # a kind the probe reads on fewer rows than this is not warned about (not in the vector)


def unread_kinds(warm: dict[str, Any], margin: float = UNREAD_MARGIN) -> dict[str, list[float]]:
    """``{kind: [recall, shuffled recall]}`` of the kinds whose warm-start round-trip recall is
    less than ``margin`` above the same AV's on shuffled vectors (empty without per-kind rows)."""
    rows = _rows(warm)
    rt = ((rows.get(ROUND_TRIP) or {}).get("faithfulness") or {}).get("by_kind") or {}
    sh = ((rows.get(SHUFFLED) or {}).get("faithfulness") or {}).get("by_kind") or {}
    return {k: [float(rt[k][0]), float(sh[k][0])] for k in rt
            if k not in NO_RECALL_KINDS and k in sh and rt[k][0] is not None and sh[k][0] is not None and rt[k][0] - sh[k][0] < margin}


UNSURE_MOST = 0.5  # a kind said unsure on at least this share of rows is "said unsure", not "not said"


def hedged_read_kinds(warm: dict[str, Any], kinds: list[str], margin: float = UNREAD_MARGIN
                      ) -> dict[str, list[float]]:
    """``{kind: [share said unsure, true there, true there from shuffled vectors]}`` of those of ``kinds`` the
    warm-start round trip says unsure (``faithfulness.hedged``) on at least ``UNSURE_MOST`` of rows, true at
    least ``margin`` more often than the same AV's on shuffled vectors: a kind read, said unsure."""
    rows = _rows(warm)
    rt, sh = _faith(rows.get(ROUND_TRIP), "hedged") or {}, _faith(rows.get(SHUFFLED), "hedged") or {}
    out = {}
    for k in kinds:
        if k in rt and k in sh and None not in (rt[k][0], rt[k][1], sh[k][1]) and rt[k][0] >= UNSURE_MOST \
                and rt[k][1] - sh[k][1] >= margin:
            out[k] = [float(rt[k][0]), float(rt[k][1]), float(sh[k][1])]
    return out


def kind_summary(after: dict[str, Any]) -> dict[str, list[float]]:
    """``{kind: [recall, precision]}`` of the RL pair's round trip (the report.json headline)."""
    rt = (_rows(after).get(ROUND_TRIP) or {}).get("faithfulness") or {}
    return {k: list(v) for k, v in (rt.get("by_kind") or {}).items()}


def _quote(report: dict[str, Any], row: str = ROUND_TRIP) -> dict[str, Any]:
    """The graded quotation (``faithfulness.quote``) of one eval row ({} when not graded)."""
    if not report.get("rows"):  # no eval in this report (an explorer reading a partial run)
        return {}
    return ((_rows(report).get(row) or {}).get("faithfulness") or {}).get("quote") or {}


def quote_summary(warm: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Headline keys of the quotation of the text's end, graded unit by unit (``nla.core.graders.Quotation``):
    exactly the text's end, every quoted unit true, quoted at all, and recall / precision per position."""
    out: dict[str, Any] = {}
    for tag, rep in (("warmstart", warm), ("rl", after)):
        q = _quote(rep)
        for key in ("exact", "all_true", "said", "hedged", "hedged_true"):
            out[f"quote_{key}_{tag}"] = q.get(key)
        out[f"quote_by_position_{tag}"] = {k: list(v) for k, v in (q.get("by_position") or {}).items()}
    out["oracle_quote_exact_rl"] = _quote(after, ORACLE).get("exact")
    return out


def quote_table(warm: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The round trip's quotation graded per position, warm-start and after RL (empty when not graded)."""
    qw, qa = _quote(warm), _quote(after)
    if not qw and not qa:
        return []
    bw, ba = qw.get("by_position") or {}, qa.get("by_position") or {}
    positions = sorted(set(bw) | set(ba), key=lambda k: int(k[6:-1]))
    lines = ["| unit | recall warm | precision warm | recall RL | precision RL |", "|---|---|---|---|---|"]
    for p in positions:
        w, a = bw.get(p) or (None, None), ba.get(p) or (None, None)
        lines.append(f"| {p}{' (the token read)' if p == 'quote[0]' else ''} | {_f(w[0], 2)} | {_f(w[1], 2)} | "
                     f"{_f(a[0], 2)} | {_f(a[1], 2)} |")
    for key, what in (("exact", "exactly the text's end (share of rows)"),
                      ("all_true", "every quoted unit true (share of rows that quote)"),
                      ("said", "quotes the text's end at all (share of rows)")):
        lines.append(f"| {what} | {_f(qw.get(key), 2)} | | {_f(qa.get(key), 2)} | |")
    if qw.get("hedged") or qa.get("hedged"):  # quote_unheld: hedge: said unsure, counted as not said above
        lines += [f"| says it unsure, \"may end with\" (share of rows) | {_f(qw.get('hedged'), 2)} | | "
                  f"{_f(qa.get('hedged'), 2)} | |",
                  f"| ... and is right anyway (share of those) | {_f(qw.get('hedged_true'), 2)} | | "
                  f"{_f(qa.get('hedged_true'), 2)} | |"]
    return lines


def faithfulness_summary(warm: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The numbers that say whether RL made the explanations more true, not just the pair closer."""
    w, a = _rows(warm), _rows(after)
    rt_w, rt_a, fr_w, fr_a = w.get(ROUND_TRIP), a.get(ROUND_TRIP), w.get(FROZEN), a.get(FROZEN)
    return {
        "recall_warmstart": _faith(rt_w, "recall"), "recall_rl": _faith(rt_a, "recall"),
        "precision_warmstart": _faith(rt_w, "precision"), "precision_rl": _faith(rt_a, "precision"),
        "shuffled_recall_rl": _faith(a.get(SHUFFLED), "recall"),
        "frozen_ar_fve_warmstart": (fr_w or {}).get("fve"), "frozen_ar_fve_rl": (fr_a or {}).get("fve"),
        "degenerate_warmstart": ((rt_w or {}).get("degenerate") or {}).get("any"),
        "degenerate_rl": ((rt_a or {}).get("degenerate") or {}).get("any"),
        "oracle_fve_warmstart": (w.get(ORACLE) or {}).get("fve"), "oracle_fve_rl": (a.get(ORACLE) or {}).get("fve"),
    }


def ceiling_line(headline: dict[str, Any]) -> list[str]:
    """How close the RL'd round trip is to the most a faithful explanation gets from the same reader
    (the oracle row, read by the AR after RL); nothing when the eval had no oracle row (no world truth)."""
    oracle, fve = headline.get("oracle_fve_rl"), headline.get("round_trip_fve_rl")
    if oracle is None or fve is None:
        return []
    share = f" ({fve / oracle:.0%} of it)" if oracle > 0 else ""
    return [f"Ceiling: an explanation naming every true fact and quoting the text's end, read by the same AR, scores "
            f"FVE {_f(oracle)} after RL ({_f(headline.get('oracle_fve_warmstart'))} with the warm-start AR); the "
            f"RL'd verbalizer reaches {_f(fve)}{share}.", ""]


def suite_headline(suite: dict[str, Any] | None) -> dict[str, Any]:
    """The suite's targets as headline keys ``suite_<section>_<key>`` (None where not measured); a pair for
    several blocks: ``suite_block<K>_<section>_<key>`` for each block K."""
    if suite and "by_block" in suite:
        return {f"suite_block{k}_{t['section']}_{t['key']}": t["value"] for k, one in suite["by_block"].items()
                for t in one.get("targets", [])}
    return {f"suite_{t['section']}_{t['key']}": t["value"] for t in (suite or {}).get("targets", [])}


def suite_section(suite: dict[str, Any] | None) -> list[str]:
    """"Does it explain?": the explanation suite's targets (``nla.eval.suite``) and what it measured."""
    if not suite:
        return []
    if "by_block" in suite:  # a pair for several blocks: the suite a block at a time (run_suite_by_block)
        by = suite["by_block"]
        md = ["## Does it explain?", "",
              "The explanation suite (`nla eval --suite`; docs/suite.md) a block at a time, each on its own held-out "
              "rows, every call at that block (the causal edits patch the subject's block): whether the RL'd pair's "
              "explanations are a true, causal account of the vector, not only a text the AR can rebuild it from.",
              "", *block_targets_table(by, _f), ""]
        for k, one in by.items():
            md += [f"Block {k} ({one['n_rows']} rows):", *suite_lines(one.get("sections", {})), ""]
        return md
    md = ["## Does it explain?", "",
          f"The explanation suite (`nla eval --suite`, {suite['n_rows']} held-out rows; docs/suite.md): whether "
          "the RL'd pair's explanations are a true, causal account of the vector, not only a text the AR can "
          "rebuild it from.", "", *targets_table(suite.get("targets", []), _f)]
    return md + suite_lines(suite.get("sections", {})) + [""]


def suite_lines(s: dict[str, Any]) -> list[str]:
    """The suite's figures as the report says them, a line a part (``sections`` of one block's report)."""
    md: list[str] = []
    c, h, e = s.get("claims"), s.get("hidden_code"), s.get("causal")
    if c:
        md += ["", f"- Deleting one claim costs FVE {_f(c['fve_cost_true'])} when it is true, "
                   f"{_f(c['fve_cost_false'])} when false, {_f(c['fve_cost_quotation'])} for the quotation "
                   f"({c['n_true']} true, {c['n_false']} false claims)."]
    if h:
        md.append(f"- FVE {_f(h['fve'])} as written; re-phrased {_f(h['paraphrase_fve'])}, re-ordered "
                  f"{_f(h['shuffle_fve'])}, without the quotation {_f(h['drop_quotation_fve'])}.")
    if e:
        md.append(f"- Causal edits ({e['edits']} recall slots edited): the subject's prediction moves to the edited "
                  f"value {_f(e['edited_moves'])}, stays with the unedited reconstruction {_f(e['unedited_keeps'])}, "
                  f"moves with a random vector {_f(e['random_moves'])}.")
    conf = s.get("confabulation") or {}
    if "pair" in conf:
        before = _f(conf["baseline"]["false_rate"]) + " → " if "baseline" in conf else ""
        md.append(f"- False claims: {before}{_f(conf['pair']['false_rate'])} of claimed facts (warm-start → RL).")
        qp, qb = conf["pair"].get("quotation"), (conf.get("baseline") or {}).get("quotation")
        if qp:
            qbefore = _f(qb["false_rate"]) + " → " if qb else ""
            md.append(f"- False quotations (one quoted word or mark not the text's): {qbefore}"
                      f"{_f(qp['false_rate'])} of {qp['claims']} quotations (warm-start → RL).")
    b = s.get("best_of")
    if b:
        top = max(int(k) for k in b if k.isdigit())
        md.append(f"- Best-of-{top}: FVE {_f(b['greedy']['fve'])} → {_f(b[str(top)]['fve'])}, precision "
                  f"{_f(b['greedy']['precision'])} → {_f(b[str(top)]['precision'])}.")
    return md


def pair_lines(pair: dict[str, Any] | None) -> list[str]:
    """The pair's models (their bases, widths, parameters, the AV's injection), as a table."""
    if not pair:
        return []
    rows = ["## The pair", "", "| | base model | width | subject width | parameters | injection |", "|---|---|---|---|---|---|"]
    for role in ("av", "ar"):
        r = pair.get(role)
        if r:
            rows.append(f"| {role.upper()} | `{Path(str(r['base_model'])).name}`{' (another model)' if r['cross_model'] else ''} "
                        f"| {r['width']} | {r['subject_width']} | {r['parameters']:,} | {r.get('injection', '-')} |")
    return [*rows, ""]


def write_report(out: Path, *, preset: str, seed: int = 0, threads: int | str | None = None, stages: list, configs: dict[str, Any], world: dict[str, Any],
                 warm_eval: dict[str, Any], rl_eval: dict[str, Any], ar_info: dict[str, Any],
                 av_info: dict[str, Any], rl_info: dict[str, Any], probe: dict[str, Any] | None = None,
                 suite: dict[str, Any] | None = None, pair: dict[str, Any] | None = None,
                 truth: str = "the world's ground truth") -> Path:
    """Write ``report.md`` and ``report.json`` (+ copy curve PNGs beside them); returns report.md.

    truth: what the recall and precision grade against, as the report names it (a real model's
    run: the rows' claims, ``nla.datagen.wiki``); ``world`` then holds the subject's ``subject`` name."""
    plots = {}
    for name, src in (("world_loss", world.get("loss_curve_png")), ("ar_curves", out / "ar" / "ar_curves.png"),
                      ("av_curves", out / "av" / "av_curves.png"), ("rl_curves", out / "rl" / "rl_curves.png")):
        if src and Path(src).is_file():
            dst = out / f"{name}.png"
            if Path(src).resolve() != dst.resolve():
                copy_file_atomic(src, dst)  # a link at dst is replaced, not written through
            plots[name] = dst.name
    wr, rr = _rows(warm_eval), _rows(rl_eval)
    fve_warm, fve_rl = wr[ROUND_TRIP]["fve"], rr[ROUND_TRIP]["fve"]
    arm, avm, rlm = ar_info.get("metrics", {}), av_info.get("metrics", {}), rl_info.get("metrics", {})
    headline = {
        "preset": preset,
        "seed": seed,
        "threads": threads,
        "cpu_kernels": cpu_kernels(),
        # every numeric library's code path, read back (nla.util.numerics), and where the pin did not hold
        "cpu_paths": cpu_paths(),
        "cpu_pin_shortfalls": pin_shortfalls(),
        "round_trip_fve_warmstart": fve_warm,
        "round_trip_fve_rl": fve_rl,
        "rl_improved_fve": fve_rl > fve_warm,
        "ar_heldout_fve_warmstart": arm.get("eval_fve"),
        "av_vector_gap": avm.get("eval_vector_gap"),
        "rl_final_reward_mean": rlm.get("reward_mean"),
        "subject_heldout_loss": world.get("heldout_loss"),
        "subject_unigram_entropy": world.get("unigram_entropy"),
        "total_seconds": sum(s.seconds for s in stages if not s.cached),  # this run's work
        **faithfulness_summary(warm_eval, rl_eval),
        **quote_summary(warm_eval, rl_eval),
        "by_kind_rl": kind_summary(rl_eval),
        # distinct explanations / rows and the commonest text's share (None: an eval made before they were counted)
        "diversity_warmstart": wr[ROUND_TRIP].get("diversity"),
        "diversity_rl": rr[ROUND_TRIP].get("diversity"),
        "unread_kinds_warmstart": unread_kinds(warm_eval),
        **suite_headline(suite),
    }
    if pair:
        headline["pair"] = pair
    probe = probe or {}
    if probe.get("layers"):
        at = [r for r in probe["layers"] if r["layer"] == extraction_layer(probe)]
        headline["probe_mean_top1"] = at[0]["mean_top1"] if at else None
        headline["probe_mean_chance"] = at[0]["mean_chance"] if at else None
        headline["probe_by_kind"] = {k["kind"]: k["top1"] for k in at[0]["kinds"]} if at else {}
    # A stage whose gradient vanished or whose samples all failed for many steps says so at the top.
    stuck = [f"- **{name}**: {w}" for name, info in (("AR warm-start", ar_info), ("AV warm-start", av_info),
                                                    ("RL", rl_info))
             for w in (info.get("metrics", {}).get("stuck_warnings") or [])]
    blocks = block_summary(warm_eval, rl_eval, probe)
    if blocks:
        headline["by_block"] = blocks
        headline["kind_cells"] = kind_cells(blocks)
    one = one_block_summary(rl_eval, probe) if not blocks else {}
    if one:  # a pair of one block against the probe at its block, by the same measure
        headline["kind_cells"] = kind_cells(one)
    # a pair for several blocks pools its blocks' rows: each block against its own probe is "By block"
    kinds = kind_table(warm_eval, rl_eval, None if blocks else probe)
    quotes = quote_table(warm_eval, rl_eval)
    # a kind the probe reads on fewer than UNREAD_PROBE_MIN of rows at the extraction layer is not in the
    # vector to read: no warm-start would name it, so it is noted, not warned about (seed 2's object, 0.29)
    probe_top1 = headline.get("probe_by_kind") or {}
    absent = [k for k in headline["unread_kinds_warmstart"]
              if probe_top1.get(k) is not None and probe_top1[k] < UNREAD_PROBE_MIN]
    # a kind the AV says unsure on most rows (its data said it firmly only where a probe holds it) and whose
    # unsure values are truer than from shuffled vectors is read, not missed: retraining would not make it firm
    # (SmolLM2's topic: said unsure on every row, true on 0.33 against 0.18 from shuffled vectors)
    unsure = hedged_read_kinds(warm_eval, [k for k in headline["unread_kinds_warmstart"] if k not in absent])
    unread_k = [k for k in headline["unread_kinds_warmstart"] if k not in absent and k not in unsure]
    headline["unsure_read_kinds_warmstart"] = unsure
    unread = [f"- **{k}**: recall {_f(r, 2)}, on shuffled vectors {_f(sh, 2)}"
              for k, (r, sh) in headline["unread_kinds_warmstart"].items() if k in unread_k]
    if unread:
        logger.warning("the warm-started AV does not read %s (recall within %.2f of its shuffled-vector rate); RL "
                       "seldom adds such a kind: train the AV warm-start again with another seed or longer",
                       ", ".join(unread_k), UNREAD_MARGIN)
    absent_note = ([f"The warm-started AV names {', '.join(absent)} no more truly than from shuffled vectors, and "
                    f"the vectors hold little of it: a linear probe reads it on "
                    f"{', '.join(_f(probe_top1[k], 2) for k in absent)} of rows at this layer, so no explainer could "
                    "name it reliably.", ""] if absent else [])
    unsure_note = ([f"The warm-started AV says {', '.join(unsure)} unsure on most rows (\"may\": not counted as "
                    "said), as its data does where a probe does not hold them, and reads them all the same: true on "
                    + "; ".join(f"{k} {_f(t, 2)} of the rows that say it unsure, {_f(sh, 2)} from shuffled vectors"
                                for k, (_, t, sh) in unsure.items()) + ".", ""] if unsure else [])
    md = [f"# NLA quickstart report (preset `{preset}`, seed {seed}, {threads} torch threads, "
          f"CPU paths {describe_cpu_paths(headline['cpu_paths'])})", "",
          *(["> **Warning: the CPU pin did not hold**, so another machine gives other numbers "
             "(docs/index.md, \"CPU kernels\"):", "", *[f"- {w}" for w in headline["cpu_pin_shortfalls"]], ""]
            if headline["cpu_pin_shortfalls"] else []),
          *(["> **Warning: a stage looked stuck.**", "", *stuck, ""] if stuck else []),
          *(["> **Warning: the warm-started AV does not read every kind.** It names these no more truly than "
             "from shuffled vectors, and RL seldom adds such a kind (dev/LOG.md, \"The warm-start is a "
             "per-kind lottery\"): train the AV warm-start again with another seed or for longer.", "",
             *unread, ""] if unread else []),
          *absent_note,
          *unsure_note,
          f"Round-trip FVE on held-out vectors: **{_f(fve_warm)}** after warm-start → **{_f(fve_rl)}** after RL "
          f"({'improved' if fve_rl > fve_warm else 'did not improve'}). "
          f"This run took {headline['total_seconds']:.0f} s (cached stages not counted).", "",
          f"Faithfulness (facts named, graded against {truth}): recall "
          f"**{_f(headline['recall_warmstart'])} → {_f(headline['recall_rl'])}**, precision "
          f"{_f(headline['precision_warmstart'])} → {_f(headline['precision_rl'])}; the same explanations read by "
          f"the frozen warm-start AR: FVE {_f(headline['frozen_ar_fve_warmstart'])} → "
          f"{_f(headline['frozen_ar_fve_rl'])}; degenerate explanations {_f(headline['degenerate_warmstart'], 2)} → "
          f"{_f(headline['degenerate_rl'], 2)}.", "",
          *([f"Distinct explanations: {headline['diversity_warmstart']['distinct']:.1%} → "
             f"{headline['diversity_rl']['distinct']:.1%} of rows; the commonest text on "
             f"{headline['diversity_warmstart']['top_share']:.1%} → {headline['diversity_rl']['top_share']:.1%}.", ""]
            if headline["diversity_warmstart"] and headline["diversity_rl"] else []),
          *([f"The quotation of the text's end, graded word by word against the text: exactly right on "
             f"**{_f(headline['quote_exact_warmstart'])} → {_f(headline['quote_exact_rl'])}** of rows, every quoted "
             f"unit true on {_f(headline['quote_all_true_warmstart'])} → {_f(headline['quote_all_true_rl'])} of the "
             f"rows that quote, the token read right (quote[0] precision) "
             f"{_f((headline['quote_by_position_warmstart'].get('quote[0]') or [None, None])[1])} → "
             f"{_f((headline['quote_by_position_rl'].get('quote[0]') or [None, None])[1])}"
             + (f"; said unsure (\"may end with\", not counted as said) on {_f(headline.get('quote_hedged_warmstart'))} → "
                f"{_f(headline.get('quote_hedged_rl'))} of rows" if headline.get("quote_hedged_rl") else "") + ".", ""]
            if quotes else []),
          *ceiling_line(headline),
          *pair_lines(pair),
          "## Evaluation (held-out documents)", "",
          f"{warm_eval['n_rows']} rows, d_model {warm_eval['d_model']}; FVE = 1 − MSE / MSE of predicting the raw mean "
          f"of normalised golds ({warm_eval['baseline_raw_mean_mse']:.4f}). Fact recall/precision grade the "
          f"explanations against {truth}. See docs/report.md for every number.", "",
          *comparison_table(warm_eval, rl_eval), "",
          *(["### Per fact kind (AV → AR round trip)", "",
              ("Recall and precision of the facts of each kind, against what a linear probe reads of that kind "
               "from the same layer's vectors (the most a faithful verbalizer could name); a `quote[p]` row is the "
               "quotation's unit p from the end, beside what a probe reads of that unit." if probe.get("layers")
               and not blocks else
               "Recall and precision of the claims of each kind over every block's rows (each block beside its own "
               "probe: \"By block\" below)." if blocks else
               "Recall and precision of the claims of each kind (no probe was run: the truth is the rows' own).")
             + (" A fact said unsure (`Perhaps …`, `may`) is no claim: not in recall or precision; the unsure "
                "columns give the share of rows that say the kind so, and how often it is true all the same."
                if "unsure" in kinds[0] else ""), "",
              *kinds, "", *one_block_lines(one)] if kinds else []),
          *(["### By block", "",
             f"One pair reads blocks {', '.join(map(str, blocks))} (`datagen.layers`), each row's block named in "
             "its prompt. FVE of each block's rows against that block's own baseline (the mean of its normalised "
             "golds); recall / precision of its rows; the claimed facts true: precision over the facts claimed (a "
             "row that claims nothing is not counted); "
             + ("the probe: a linear probe of each kind at that block on held-out stories (`nla world probe`), the "
                "most a faithful verbalizer could name there." if any(b["probe_by_kind"] for b in blocks.values()) else
                "no probe column: no world probe was run (a real subject's claims are said firmly only where a probe "
                "fitted at the row's block reads them, in the data)."), "",
             *block_tables(blocks), ""] if blocks else []),
          *(["### The quotation of the text's end (AV → AR round trip)", "",
             "Each quoted word or mark is a claim about the text at its position from the end (quote[0] = the "
             "token read), graded against the row's text: recall over the rows whose text has a unit there (no "
             "quotation: not said), precision over the units quoted there. The fact recall / precision above do "
             "not count the quotation.", "", *quotes, ""] if quotes else []),
          *(["## What is in the vector", "",
              "Top-1 accuracy of a linear probe per fact kind on held-out stories (`nla world probe`): how much of "
              "the ground truth any verbalizer could read from the vectors at each layer, against chance; "
              "`quote[p]`: how often a probe names the word or mark p units from the end of the text read "
              "(not in the mean).", "",
              *probe_table(probe), ""] if probe.get("layers") else []),
          *suite_section(suite),
          "## Training", "",
          (f"- subject model: {world['subject']} ({world.get('subject_dir')})" if world.get("subject") else
           f"- subject model: held-out loss {_f(world.get('heldout_loss'))} nats/token vs unigram entropy "
           f"{_f(world.get('unigram_entropy'))}"),
          f"- AR warm-start: held-out FVE {_f(arm.get('eval_fve'))} (train fve_nrm {_f(arm.get('fve_nrm'))})",
          f"- AV warm-start: held-out loss {_f(avm.get('eval_loss'))}, with shuffled vectors "
          f"{_f(avm.get('eval_loss_shuffled'))} (gap {_f(avm.get('eval_vector_gap'), 4)}: > 0 means the vector is used)",
          f"- RL: final reward {_f(rlm.get('reward_mean'))}, rollout fve_nrm {_f(rlm.get('fve_nrm'))}, "
          f"KL {_f(rlm.get('kl'), 4)}, response length {_f(rlm.get('response_len'), 1)}", ""]
    for key, title in (("world_loss", "Subject model pretraining"), ("ar_curves", "AR warm-start"),
                       ("av_curves", "AV warm-start"), ("rl_curves", "RL")):
        if key in plots:
            md += [f"### {title}", "", f"![{title}]({plots[key]})", ""]
    md += ["## Example explanations (held-out)", "", *examples(warm_eval, rl_eval),
           "## Time per stage", "", "| stage | seconds | cached |", "|---|---|---|"]
    md += [f"| {s.name} | {s.seconds:.1f} | {'yes' if s.cached else 'no'} |" for s in stages]
    md += ["", "## Configs used", "", "```yaml", yaml.safe_dump(configs, sort_keys=False).rstrip(), "```", ""]
    path = out / "report.md"
    path.write_text("\n".join(md), encoding="utf-8")
    (out / "report.json").write_text(json.dumps({
        "headline": headline, "eval_warmstart": warm_eval, "eval_rl": rl_eval, "suite": suite, "plots": plots,
        "stages": [{"name": s.name, "seconds": s.seconds, "cached": s.cached} for s in stages],
        "configs": configs}, indent=2, default=str), encoding="utf-8")
    return path
