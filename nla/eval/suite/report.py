"""The suite's report: every part's figures, each target met or missed, as JSON and markdown."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nla.eval.suite.common import TARGETS


# ------------------------------------------------------------------ the report
@dataclass
class SuiteReport:
    """What ``run_suite`` measured, by part (``PARTS``); ``targets``: each of ``TARGETS`` with its
    value and whether it is met (None: not measured); ``block``: the block of a pair for several blocks it
    was run at (None for a pair of one)."""

    dataset: str
    n_rows: int
    seed: int
    sections: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    block: int | None = None

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
        return {"dataset": self.dataset, "n_rows": self.n_rows, "seed": self.seed,
                **({} if self.block is None else {"block": self.block}), "sections": self.sections,
                "skipped": self.skipped, "targets": self.targets, "samples": self.samples}

    def to_json(self) -> str:
        from nla.util.fsutil import dumps_json

        return dumps_json(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        s = self.sections
        at = "" if self.block is None else f"block {self.block}: "
        lines = [f"# Does it explain? ({at}{self.n_rows} rows of {self.dataset}, seed {self.seed})", ""]
        lines += targets_table(self.targets)
        if "claims" in s:
            c = s["claims"]
            lines += ["", "## Claim attribution (FVE lost when one claim is deleted)", "",
                      "| claim | n | mean FVE cost |", "|---|---|---|"]
            lines += [f"| {g.replace('_', ': ')} | {c[f'n_{g}']} | {_f(c[f'fve_cost_{g}'])} |"
                      for g in ("true", "false", "false_stale", "false_invented", "quotation", "quotation_true",
                                "quotation_false", "other")
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
                              f"re-ordered {_f(h['oracle_shuffle_cost'])}, without the quotation "
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
                      + " recurring claims true | lone claims true | false claims once true | quotation |",
                      "|---|---|" + "---|" * (len(kinds) + 4)]
            for m in models:
                c = s["confabulation"][m]
                lines.append(f"| {m} | {_f(c['false_rate'])} |" + "".join(
                    f" {_f(c['by_kind'].get(k, {}).get('false_rate'))} |" for k in kinds)
                    + f" {_f(c.get('recurring', {}).get('true_rate'))} | {_f(c.get('lone', {}).get('true_rate'))} |"
                    + f" {_f(c.get('false_stale'))} | {_f((c.get('quotation') or {}).get('false_rate'))} |")
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


@dataclass
class SuiteByBlock:
    """``run_suite`` at each block of a pair for several blocks (``run_suite_by_block``): block -> report."""

    dataset: str
    reports: dict[int, SuiteReport] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "by_block": {str(k): r.to_dict() for k, r in self.reports.items()}}

    def to_json(self) -> str:
        from nla.util.fsutil import dumps_json

        return dumps_json(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        d = self.to_dict()["by_block"]
        lines = [f"# Does it explain? Each block of the pair ({self.dataset})", "",
                 "Each block's rows alone, every call at that block; the targets side by side, then each block's "
                 "report.", "", *block_targets_table(d), ""]
        for r in self.reports.values():  # each block's report, its headings a level down
            lines += [f"#{x}" if x.startswith("#") else x for x in r.to_markdown().splitlines()]
        return "\n".join(lines) + "\n"


def block_targets_table(by_block: dict[str, dict[str, Any]], fmt: Callable[[Any], str] | None = None) -> list[str]:
    """Markdown rows of each block's targets (the JSON of ``SuiteByBlock.to_dict()["by_block"]``): a test a row,
    its value at each block (met or **missed**), then the target."""
    fmt = fmt or _f
    blocks = list(by_block)
    lines = ["| test |" + "".join(f" block {k} ({by_block[k]['n_rows']} rows) |" for k in blocks) + " target |",
             "|---|" + "---|" * len(blocks) + "---|"]
    for i, t in enumerate(next(iter(by_block.values()))["targets"] if blocks else []):
        cells = []
        for k in blocks:
            u = by_block[k]["targets"][i]
            v = u.get("note") or fmt(u["value"])
            cells.append(v if u["met"] is None else f"{v} ({'met' if u['met'] else '**missed**'})")
        lines.append(f"| {t['what']} |" + "".join(f" {c} |" for c in cells) + f" {t['target']} |")
    return lines


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
