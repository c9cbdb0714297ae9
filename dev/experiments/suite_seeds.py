"""The explanation suite ("Does it explain?") on quickstart runs, as mean ± half the range over them.

    python -m dev.experiments.suite_seeds runs/quickstart-default runs/quickstart-default-seed1 ... \
        [--max-rows N] [--parts claims,causal] [--out DIR]

Each run's RL'd pair (the newest ``rl/checkpoints/step_*``) is evaluated on the run's held-out
``datagen/eval.parquet`` (every row unless ``--max-rows``), with the run's warm-start AV
(the newest ``av/checkpoints/step_*``) as the confabulation baseline and the subject its sidecar
records. Prints one markdown table (the issue's targets and the figures behind them) and writes
each run's ``suite.json`` / ``suite.md`` under ``--out/<run name>/``. The suite's own seed is 0
for every run: the runs differ by their quickstart seed.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np


def _newest(d: Path) -> Path:
    steps = sorted(d.glob("step_*"))
    if not steps:
        raise SystemExit(f"{d}: no step_* checkpoint; is this a finished quickstart run?")
    return steps[-1]


ROWS = (  # (label, path into the report's sections)
    ("claims: FVE cost of deleting a true claim", ("claims", "fve_cost_true")),
    ("claims: FVE cost of deleting a false claim", ("claims", "fve_cost_false")),
    ("claims: ... a false claim once true in the story", ("claims", "fve_cost_false_stale")),
    ("claims: ... a false claim never true before", ("claims", "fve_cost_false_invented")),
    ("claims: FVE cost of deleting the quoted word", ("claims", "fve_cost_quotation")),
    ("claims: true / false cost", ("claims", "true_over_false")),
    ("hidden code: FVE as written", ("hidden_code", "fve")),
    ("hidden code: cost of re-phrasing", ("hidden_code", "paraphrase_cost")),
    ("hidden code: cost of re-ordering", ("hidden_code", "shuffle_cost")),
    ("hidden code: cost of dropping the quoted word", ("hidden_code", "drop_quotation_cost")),
    ("hidden code, oracle texts (control): FVE", ("hidden_code", "oracle_fve")),
    ("hidden code, oracle texts: cost of re-phrasing", ("hidden_code", "oracle_paraphrase_cost")),
    ("hidden code, oracle texts: cost of re-ordering", ("hidden_code", "oracle_shuffle_cost")),
    ("causal: recall slots edited", ("causal", "edits")),
    ("causal: edited explanation moves the prediction", ("causal", "edited_moves")),
    ("causal: unedited explanation keeps it", ("causal", "unedited_keeps")),
    ("causal: edit moves it where the unedited keeps it", ("causal", "edited_moves_where_unedited_keeps")),
    ("causal: random same-norm vector moves it", ("causal", "random_moves")),
    ("causal: difference of means moves it (no text)", ("causal", "means_moves")),
    ("directions: fact named (best strength)", ("directions", "named")),
    ("confabulation: false-claim rate, warm-start AV", ("confabulation", "baseline", "false_rate")),
    ("confabulation: false-claim rate, RL'd AV", ("confabulation", "pair", "false_rate")),
    ("confabulation: recurring claims true (RL)", ("confabulation", "pair", "recurring", "true_rate")),
    ("confabulation: lone claims true (RL)", ("confabulation", "pair", "lone", "true_rate")),
    ("confabulation: false claims true earlier in the story (RL)", ("confabulation", "pair", "false_stale")),
    ("confabulation: false claims true earlier in the story (warm)", ("confabulation", "baseline", "false_stale")),
    ("best-of: FVE greedy", ("best_of", "greedy", "fve")),
    ("best-of: FVE best of 1 (one sample)", ("best_of", "1", "fve")),
    ("best-of: FVE best of 4", ("best_of", "4", "fve")),
    ("best-of: FVE best of 8", ("best_of", "8", "fve")),
    ("best-of: precision greedy", ("best_of", "greedy", "precision")),
    ("best-of: precision best of 8", ("best_of", "8", "precision")),
    ("best-of: recall greedy", ("best_of", "greedy", "recall")),
    ("best-of: recall best of 8", ("best_of", "8", "recall")),
)


def _get(d: dict, path: tuple[str, ...]):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--max-rows", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench_out/suite"))
    ap.add_argument("--parts", default=None, help="comma-separated suite parts (default: all)")
    ap.add_argument("--temperature", type=float, default=0.7, help="best-of-N's sampling temperature")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from nla.client import NLAClient
    from nla.eval.suite import run_suite

    reports = []
    for run in args.runs:
        t0 = time.perf_counter()
        rl = _newest(run / "rl" / "checkpoints")
        client = NLAClient(rl / "av", rl / "ar")
        warm = NLAClient(_newest(run / "av" / "checkpoints"), None)
        parts = {"parts": args.parts.split(",")} if args.parts else {}
        rep = run_suite(client, run / "datagen" / "eval.parquet", baseline_av=warm, max_rows=args.max_rows,
                        max_new_tokens=64, temperature=args.temperature, **parts)
        out = args.out / run.name
        out.mkdir(parents=True, exist_ok=True)
        (out / "suite.json").write_text(rep.to_json())
        (out / "suite.md").write_text(rep.to_markdown())
        reports.append(rep.to_dict())
        print(f"{run}: {rep.n_rows} rows in {time.perf_counter() - t0:.0f} s -> {out}", flush=True)
    names = [r.name for r in args.runs]
    print(f"\n{len(reports)} runs; mean ± half the range (max − min) / 2\n")
    print("| measure | mean ± half range | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for label, path in ROWS:
        vals = [_get(r["sections"], path) for r in reports]
        ok = [float(v) for v in vals if v is not None]
        summary = f"{np.mean(ok):.3f} ± {(max(ok) - min(ok)) / 2:.3f}" if ok else "-"
        cells = ["-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v) for v in vals]
        print(f"| {label} | {summary} | " + " | ".join(cells) + " |")
    print("\n| target | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for i, t in enumerate(reports[0]["targets"]):
        cells = []
        for r in reports:
            tt = r["targets"][i]
            v = tt["note"] or ("-" if tt["value"] is None else f"{tt['value']:.3f}")
            cells.append(f"{v} ({'met' if tt['met'] else 'not met' if tt['met'] is not None else '-'})")
        print(f"| {t['what']} ({t['target']}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
