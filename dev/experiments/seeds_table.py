"""Mean ± spread of quickstart runs over seeds: the tables BENCHMARKS.md and the README quote.

    python -m dev.experiments.seeds_table runs/quickstart-default runs/quickstart-default-seed1 runs/quickstart-default-seed2
    python -m dev.experiments.seeds_table RUN... --json seeds.json

Reads each run's ``report.json`` (``nla quickstart --seed S``) and prints Markdown: the overall
rows (round trip, frozen warm-start AR, oracle, text explainer, shuffled vectors) warm-start and
after RL, then recall / precision per fact kind with the probe's top-1 beside it, and the
targets of issue 25 with each run's value. "spread" is max − min over the runs (with 3 seeds, the
range says more than a standard deviation would).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean

ROWS = (("AV → AR round trip", "round trip"), ("AV → frozen warm-start AR", "frozen warm-start AR"),
        ("oracle: every true fact → AR", "oracle (every true fact)"), ("text explainer → AR", "data explainer"),
        ("AV on shuffled vectors → AR", "AV on other rows' vectors"))


def load(run: Path) -> dict:
    path = run / "report.json"
    if not path.is_file():
        raise SystemExit(f"seeds_table: {path} not found; pass run directories of `nla quickstart`")
    return json.loads(path.read_text())


def stat(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"{mean(vals):.3f} ± {(max(vals) - min(vals)) / 2:.3f}"


def row(report: dict, part: str, name: str) -> dict:
    return next((r for r in report[part]["rows"] if r["name"] == name), {})


def faith(r: dict, key: str) -> float | None:
    return (r.get("faithfulness") or {}).get(key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args(argv)
    reports = [load(r) for r in args.runs]
    seeds = [r["headline"].get("seed") for r in reports]
    out = {"runs": [str(r) for r in args.runs], "seeds": seeds, "rows": {}, "kinds": {}}
    lines = [f"{len(reports)} runs (seeds {', '.join(map(str, seeds))}); mean ± half the range (max − min) / 2", "",
             "| predictor | FVE warm | FVE RL | recall warm | recall RL | precision warm | precision RL |",
             "|---|---|---|---|---|---|---|"]
    for name, label in ROWS:
        cells, fig = [], {}
        for key, getter in (("fve", lambda r: r.get("fve")), ("recall", lambda r: faith(r, "recall")),
                            ("precision", lambda r: faith(r, "precision"))):
            for part in ("eval_warmstart", "eval_rl"):
                vals = [getter(row(rep, part, name)) for rep in reports]
                fig[f"{key}_{part}"] = vals
                cells.append(stat(vals))
        out["rows"][label] = fig
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    # per kind: recall / precision warm and RL, the probe's top-1 at the extraction layer
    kinds: list[str] = []
    for rep in reports:
        for part in ("eval_warmstart", "eval_rl"):
            for k in (faith(row(rep, part, ROWS[0][0]), "by_kind") or {}):
                if k not in kinds:
                    kinds.append(k)
    lines += ["", "| kind | probe top-1 | recall warm | precision warm | recall RL | precision RL | recall RL per seed |",
              "|---|---|---|---|---|---|---|"]
    for k in kinds:
        fig = {}
        for part in ("eval_warmstart", "eval_rl"):
            bk = [(faith(row(rep, part, ROWS[0][0]), "by_kind") or {}).get(k) for rep in reports]
            fig[f"recall_{part}"] = [b[0] if b else None for b in bk]
            fig[f"precision_{part}"] = [b[1] if b else None for b in bk]
        probe = [rep["headline"].get("probe_by_kind", {}).get(k) for rep in reports]
        fig["probe_top1"] = probe
        out["kinds"][k] = fig
        per_seed = " / ".join("–" if v is None else f"{v:.2f}" for v in fig["recall_eval_rl"])
        lines.append(f"| {k} | {stat(probe)} | {stat(fig['recall_eval_warmstart'])} | "
                     f"{stat(fig['precision_eval_warmstart'])} | {stat(fig['recall_eval_rl'])} | "
                     f"{stat(fig['precision_eval_rl'])} | {per_seed} |")
    # shares of the ceiling: the RL round trip and the frozen reader against the RL'd AR's oracle
    rt = out["rows"]["round trip"]["fve_eval_rl"]
    fr = out["rows"]["frozen warm-start AR"]["fve_eval_rl"]
    orc = out["rows"]["oracle (every true fact)"]["fve_eval_rl"]
    share_rt = [a / o if a is not None and o else None for a, o in zip(rt, orc, strict=True)]
    share_fr = [a / o if a is not None and o else None for a, o in zip(fr, orc, strict=True)]
    out["share_of_ceiling"] = {"round_trip": share_rt, "frozen": share_fr}
    times = [sum(s["seconds"] for s in rep.get("stages", []) if not s.get("cached")) for rep in reports]
    out["stage_seconds"] = times
    lines += ["", f"- RL round trip / oracle (RL'd AR): {stat(share_rt)}; frozen warm-start AR / oracle: {stat(share_fr)}",
              f"- degenerate after RL: {stat([rep['headline'].get('degenerate_rl') for rep in reports])}; "
              f"stage seconds (uncached): {', '.join(f'{t:.0f}' for t in times)}"]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
