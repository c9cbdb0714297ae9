"""Pairs on vectors unlike their training data: scaled norms and a shifted mean (issue 24).

Users bring vectors whose norm and offset differ from the training data (steering vectors,
difference-of-means directions). For each run given, the RL'd pair (``rl/checkpoints/step_*``)
explains the held-out vectors as they are, scaled by 0.25 and 4, centred (the mean of the
held-out vectors removed: what a difference of means looks like) and offset (the mean added
once more), and is graded against the same rows' ground truth. FVE is against the shifted
vector (mse_nrm normalises both sides, so a scaled vector's gold is the same direction).

    python -m dev.experiments.shifted_vectors RUN [RUN ...] [--max-rows 400] [--pair NAME=AV,AR ...]

RUN: a quickstart run directory (runs/quickstart-default, runs/quickstart-default-adapter, ...).
--pair: any other AV and AR checkpoints (a warm-start, an `nla rl` run of your own), scored on
the first RUN's held-out rows (or --eval's parquet).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

SHIFTS = ("as is", "x0.25", "x4", "centred", "offset")


def shifted(vectors: np.ndarray, how: str) -> np.ndarray:
    mean = vectors.mean(0, keepdims=True)
    return {"as is": vectors, "x0.25": 0.25 * vectors, "x4": 4.0 * vectors, "centred": vectors - mean,
            "offset": vectors + mean}[how].astype(np.float32)


def write_shifted(src: Path, how: str, out: Path) -> Path:
    from nla.core.sidecar import load_sidecar, write_sidecar
    from nla.datagen.io import read_parquet, read_vectors, vectors_to_arrow, write_parquet_atomic

    table = read_parquet(src)
    vec = shifted(read_vectors(table, source=src), how)
    i = table.column_names.index("activation_vector")
    table = table.set_column(i, "activation_vector", vectors_to_arrow(vec))
    path = out / f"eval-{how.replace(' ', '_').replace('.', '')}.parquet"
    write_sidecar(path, load_sidecar(src), shift=how)
    write_parquet_atomic(table, path)
    return path


def rl_pair(run: Path) -> tuple[Path, Path]:
    info = json.loads((run / "rl.stage_done.json").read_text())
    # a run's paths are relative to the directory the quickstart ran in (two levels up)
    return tuple(p if p.is_absolute() else run.resolve().parent.parent / p for p in (Path(info["av"]), Path(info["ar"])))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--pair", action="append", default=[], metavar="NAME=AV,AR",
                    help="another pair: a name, its AV and AR checkpoint dirs")
    ap.add_argument("--eval", type=Path, default=None, help="held-out parquet for --pair (default: the first RUN's)")
    ap.add_argument("--max-rows", type=int, default=400)
    ap.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    pairs: list[tuple[str, Path, Path, Path]] = []
    for run in args.runs:
        av, ar = rl_pair(run)
        pairs.append((run.name, av, ar, run / "datagen" / "eval.parquet"))
    for spec in args.pair:
        name, eq, rest = spec.partition("=")
        paths = rest.split(",")
        if not eq or len(paths) != 2 or not name:
            ap.error(f"--pair {spec!r}: expected NAME=AV_DIR,AR_DIR")
        eval_ds = args.eval or (args.runs[0] / "datagen" / "eval.parquet" if args.runs else None)
        if eval_ds is None:
            ap.error("--pair needs --eval PARQUET (or a RUN whose held-out rows to use)")
        pairs.append((name, Path(paths[0]), Path(paths[1]), eval_ds))
    if not pairs:
        ap.error("give at least one RUN or --pair")
    from nla.client import NLAClient
    from nla.eval.evaluate import ROW_ROUND_TRIP, evaluate_pair
    from nla.util.threads import apply_threads, resolve_threads

    apply_threads(resolve_threads(None))
    results: dict[str, dict[str, dict[str, float | None]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run, av, ar, eval_ds in pairs:
            client = NLAClient(av, ar)
            results[str(run)] = {}
            for how in SHIFTS:
                ds = write_shifted(eval_ds, how, Path(tmp))
                rep = evaluate_pair(client, ds, max_rows=args.max_rows, text_explainer_baseline=False,
                                    max_new_tokens=64).to_dict()
                row = next(r for r in rep["rows"] if r["name"] == ROW_ROUND_TRIP)
                faith = row.get("faithfulness") or {}
                results[str(run)][how] = {"fve": row.get("fve"), "recall": faith.get("recall"),
                                          "precision": faith.get("precision")}
                r = results[str(run)][how]
                print(f"{run:40s} {how:8s} fve {r['fve']:.3f} recall {r['recall']:.3f} "
                      f"precision {r['precision']:.3f}", file=sys.stderr, flush=True)
    print(f"| run | {' | '.join(SHIFTS)} |")
    print("|---|" + "---|" * len(SHIFTS))
    for run, by in results.items():
        cells = [f"{by[h]['fve']:.3f} / {by[h]['recall']:.3f} / {by[h]['precision']:.3f}" for h in SHIFTS]
        print(f"| {Path(run).name} | {' | '.join(cells)} |")
    print("\n(cells: round-trip FVE / fact recall / fact precision)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
