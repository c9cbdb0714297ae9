"""How often the verbalizer's quotation of the text's end is true, position by position (issue 57).

    python -m dev.experiments.quote_positions RUN [RUN...] [--rows N] [--warm] [--from-report] [--json PATH]

For each quickstart run (``nla quickstart``), the RL'd AV (the newest ``rl/checkpoints/step_*``; with
``--warm`` the warm-start AV, the newest ``av/checkpoints/step_*``) explains held-out rows of
``RUN/datagen/eval.parquet`` greedily (every row, or a seeded subset of ``--rows``, the eval's draw,
at the run's ``max_new_tokens``), and each explanation's quotation is graded unit by unit against the
row's text (``nla.core.graders.quotation_summary`` with the world grader: ``quote[0]`` = the token read,
``quote[1]`` the unit before it, ...; recall over the rows whose ``text_end`` has a unit there, a row
without a quotation counting as not said; precision over the units quoted there). With
``--from-report`` no model is run: the figures are the ones ``nla eval`` put in the run's
``report.json`` (``eval_rl``, or ``eval_warmstart`` with ``--warm``; runs made since issue 57).

Prints one markdown table, a line per run, and with several runs the mean +- half the range over them.
Ground truth only grades here; it never enters training.

The three-seed measure of issue 57 (default preset, 1,600 held-out rows), as it is and with the data
explainer, the AV's warm-start data and the oracle quoting the token read only::

    for s in 0 1 2; do nla quickstart --seed $s --out runs/q57-s$s; done
    for s in 0 1 2; do nla quickstart --seed $s --out runs/q57-u1-s$s --set datagen.world_explainer.quote_units=1; done
    python -m dev.experiments.quote_positions runs/q57-s0 runs/q57-s1 runs/q57-s2 --rows 1600
    python -m dev.experiments.quote_positions runs/q57-u1-s0 runs/q57-u1-s1 runs/q57-u1-s2 --rows 1600

(each run's ``report.md`` has the same figures on the eval's rows, and FVE / the oracle beside them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

POSITIONS = ("quote[0]", "quote[1]", "quote[2]")


def _newest(d: Path) -> Path:
    steps = sorted(d.glob("step_*"), key=lambda p: int(p.name.split("_")[-1]))
    if not steps:
        raise SystemExit(f"{d}: no step_* checkpoint; is this a finished quickstart run?")
    return steps[-1]


def _av_dir(run: Path, warm: bool) -> Path:
    """The AV checkpoint the run's stage record names (else the newest step on disk)."""
    rec = run / ("av.stage_done.json" if warm else "rl.stage_done.json")
    if rec.is_file():
        data = json.loads(rec.read_text(encoding="utf-8"))
        found = data.get("checkpoint") if warm else data.get("av")
        if found and Path(found).is_dir():
            return Path(found)
    step = _newest(run / ("av" if warm else "rl") / "checkpoints")
    return step if warm else step / "av"


def _preset_settings(run: Path) -> dict[str, Any]:
    """The run's max_new_tokens (64, the preset default, when its record cannot be read)."""
    for name in ("eval_rl.stage_done.json", "eval_warmstart.stage_done.json"):
        p = run / name
        if p.is_file():
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except ValueError:
                continue
            found = _find(data, "max_new_tokens")
            if isinstance(found, int):
                return {"max_new_tokens": found}
    return {"max_new_tokens": 64}


def _find(data: Any, key: str) -> Any:
    if isinstance(data, dict):
        if key in data:
            return data[key]
        for v in data.values():
            hit = _find(v, key)
            if hit is not None:
                return hit
    return None


def grade_run(run: Path, rows: int | None, warm: bool, seed: int = 0) -> dict[str, Any]:
    """The ``Quotation`` of the run's greedy explanations on held-out rows, as a dict."""
    from dataclasses import asdict

    import torch

    from nla.client import NLAClient
    from nla.core.graders import get_grader, quotation_summary
    from nla.datagen.io import read_parquet, read_vectors

    av_dir = _av_dir(run, warm)
    path = run / "datagen" / "eval.parquet"
    if not path.is_file():
        raise SystemExit(f"{run}: no held-out rows at {path}; is this a quickstart run of the world?")
    table = read_parquet(path)
    if "text_end" not in table.column_names:
        raise SystemExit(f"{path}: no text_end column (written before the quotation of the text's end); nothing "
                         "to grade the quotation against")
    vectors = read_vectors(table)
    if rows is not None and rows < table.num_rows:
        keep = np.sort(np.random.default_rng(seed).choice(table.num_rows, size=rows, replace=False))
        table, vectors = table.take(keep), vectors[keep]
    client = NLAClient(av_dir, None)
    gold = torch.from_numpy(np.array(vectors, dtype=np.float32))
    texts = [v.explanation for v in client.verbalize(gold, max_new_tokens=_preset_settings(run)["max_new_tokens"],
                                                     batch_size=64)]
    grader = get_grader("world")
    q = quotation_summary(texts, grader.quote_truths(table, path), grader)
    return asdict(q) | {"av": str(av_dir)}


def from_report(run: Path, warm: bool) -> dict[str, Any]:
    rep = json.loads((run / "report.json").read_text(encoding="utf-8"))
    ev = rep["eval_warmstart" if warm else "eval_rl"]
    rt = next(r for r in ev["rows"] if r["name"] == "AV → AR round trip")
    q = (rt.get("faithfulness") or {}).get("quote")
    if q is None:
        raise SystemExit(f"{run}/report.json: no graded quotation (a run made before issue 57); drop --from-report "
                         "to verbalize the rows again")
    return q


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _spread(xs: list[float | None]) -> str:
    v = [x for x in xs if x is not None]
    if not v:
        return "-"
    return f"{np.mean(v):.3f} ± {(max(v) - min(v)) / 2:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--rows", type=int, default=None, help="a seeded subset of the held-out rows (default: all)")
    ap.add_argument("--warm", action="store_true", help="the warm-start AV instead of the RL'd one")
    ap.add_argument("--from-report", action="store_true", help="read the run's report.json instead of verbalizing")
    ap.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    args = ap.parse_args(argv)
    results = {str(r): (from_report(r, args.warm) if args.from_report else grade_run(r, args.rows, args.warm))
               for r in args.runs}
    cols = ["quotes", "exactly the end", "every unit true"] + [f"{p} recall / precision" for p in POSITIONS]
    print(f"Quotation of the text's end ({'warm-start' if args.warm else 'RL'} AV, greedy)\n")
    print("| run | rows | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for run, q in results.items():
        bp = q["by_position"]
        cells = [_cell(q["said"]), _cell(q["exact"]), _cell(q["all_true"])]
        cells += [" / ".join(_cell(v) for v in bp.get(p, (None, None))) for p in POSITIONS]
        print(f"| {Path(run).name} | {q['n']} | " + " | ".join(cells) + " |")
    if len(results) > 1:
        qs = list(results.values())
        cells = [_spread([q[k] for q in qs]) for k in ("said", "exact", "all_true")]
        cells += [" / ".join(_spread([(q["by_position"].get(p) or (None, None))[i] for q in qs]) for i in (0, 1))
                  for p in POSITIONS]
        print(f"| mean ± half range | {sum(q['n'] for q in qs)} | " + " | ".join(cells) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
