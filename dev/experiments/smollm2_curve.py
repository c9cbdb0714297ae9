"""What more compute buys on the real model (issue 56, item 5): the reader's ceiling against training rows.

The AR's held-out FVE on the data explainer's texts (every claim true) is the oracle row of the
round trip: the most any explanation in the claim language reaches with that reader. This script
trains the smollm2 quickstart's AR again, from the same config, for longer, and evaluates it every
``--eval-every`` steps; with ``--av`` it then scores the round trip of that AV (greedy, the held-out
rows) with the longer-trained AR. It writes ``curve.json`` and ``curve.png`` (FVE against rows seen,
the quickstart run's own AR points and its AV's real-vs-shuffled gap beside them).

With ``--role av`` it trains the quickstart's AV warm-start again, from the same config, for
``--steps`` (checkpoints every ``--eval-every``), and reads each checkpoint's explanations of the
held-out rows (greedy) with the run's own AR: round-trip FVE, claim recall / precision per kind,
distinct explanations, the AV's real-vs-shuffled gap: what more AV steps buy with the reader fixed.
It writes ``av_curve.json`` and ``av_curve.png``.

    python -m dev.experiments.smollm2_curve RUN --steps 1200 --eval-every 200 --out OUT [--av RUN/rl/.../av]
    python -m dev.experiments.smollm2_curve RUN --role av --steps 750 --eval-every 125 --out OUT

RUN is a finished ``nla quickstart --preset smollm2`` run directory (its datagen and AR config are reused).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import yaml


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--av", help="an AV checkpoint whose round trip to score with the longer-trained AR")
    ap.add_argument("--eval-rows", type=int, default=256)
    ap.add_argument("--role", choices=["ar", "av"], default="ar", help="which warm-start to train longer")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.role == "av":
        av_curve(args)
        return

    from nla.train.ar import train_ar
    from nla.train.config import ARTrainConfig

    cfg_path = sorted((args.run / "ar" / "checkpoints").glob("step_*/train_config.yaml"))[-1]
    cfg = yaml.safe_load(cfg_path.read_text())
    batch = int(cfg["batch_size"])
    cfg.update(max_steps=args.steps, eval_every=args.eval_every, save_every=args.steps, out_dir=str(args.out / "ar"),
               progress=True)
    res = train_ar(ARTrainConfig(**cfg))
    longer = [{"step": r["step"], "rows": r["step"] * batch, "eval_fve": r["eval_fve"]}
              for r in _jsonl(args.out / "ar" / "ar.jsonl") if "eval_fve" in r]
    run_ar = [{"step": r["step"], "rows": r["step"] * batch, "eval_fve": r["eval_fve"]}
              for r in _jsonl(args.run / "ar" / "ar.jsonl") if "eval_fve" in r]
    av_gap = [{"step": r["step"], "eval_loss": r.get("eval_loss"), "gap": r.get("eval_vector_gap")}
              for r in _jsonl(args.run / "av" / "av.jsonl") if "eval_vector_gap" in r]
    out = {"batch_size": batch, "ar_longer": longer, "ar_quickstart": run_ar, "av_gap_quickstart": av_gap,
           "ar_checkpoint": str(res.checkpoint_dir)}
    if args.av:
        from nla.client import NLAClient
        from nla.eval.evaluate import evaluate_pair

        report = evaluate_pair(NLAClient(args.av, str(res.checkpoint_dir)), args.run / "datagen" / "eval.parquet",
                               max_rows=args.eval_rows, max_new_tokens=64).to_dict()
        out["round_trip_with_longer_ar"] = {r["name"]: {"fve": r["fve"], "faithfulness": r["faithfulness"]}
                                            for r in report["rows"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curve.json").write_text(json.dumps(out, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["rows"] for p in longer], [p["eval_fve"] for p in longer], "o-", label=f"AR, {args.steps} steps")
    ax.plot([p["rows"] for p in run_ar], [p["eval_fve"] for p in run_ar], "s--", label="AR, the quickstart's")
    ax.set_xlabel("training rows seen (steps x batch)")
    ax.set_ylabel("held-out FVE on the data's explanations (the oracle)")
    ax.set_title("SmolLM2-135M block 10: what the reader reaches")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "curve.png", dpi=120)
    print(json.dumps({k: v for k, v in out.items() if k != "ar_checkpoint"}, indent=2))


def av_curve(args: argparse.Namespace) -> None:
    """``--role av``: the AV warm-start trained again for ``--steps``, each checkpoint read by the run's AR."""
    from nla.client import NLAClient
    from nla.eval.evaluate import evaluate_pair
    from nla.train.av import train_av
    from nla.train.config import AVTrainConfig

    cfg_path = sorted((args.run / "av" / "checkpoints").glob("step_*/train_config.yaml"))[-1]
    cfg = yaml.safe_load(cfg_path.read_text())
    batch = int(cfg["batch_size"])
    if args.steps % args.eval_every:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --eval-every {args.eval_every}")
    n_ckpt = args.steps // args.eval_every
    cfg.update(max_steps=args.steps, eval_every=args.eval_every, save_every=args.eval_every, keep_last=n_ckpt,
               out_dir=str(args.out / "av"), progress=True, smoke_num=0)
    train_av(AVTrainConfig(**cfg))
    ar = sorted((args.run / "ar" / "checkpoints").glob("step_*"))[-1]
    gaps = {r["step"]: r.get("eval_vector_gap") for r in _jsonl(args.out / "av" / "av.jsonl") if "eval_vector_gap" in r}
    points = []
    for ckpt in sorted((args.out / "av" / "checkpoints").glob("step_*")):
        step = int(ckpt.name.split("_")[1])
        rep = evaluate_pair(NLAClient(str(ckpt), str(ar)), args.run / "datagen" / "eval.parquet",
                            max_rows=args.eval_rows, max_new_tokens=64).to_dict()
        rows = {r["name"]: r for r in rep["rows"]}
        rt = rows["AV → AR round trip"]
        f = rt["faithfulness"]
        points.append({"step": step, "rows": step * batch, "fve": rt["fve"], "gap": gaps.get(step),
                       "recall": f["recall"], "precision": f["precision"],
                       "by_kind": {k: v for k, v in f["by_kind"].items()},
                       "distinct": (rt.get("diversity") or {}).get("distinct"), "oracle": rows["oracle: every true fact → AR"]["fve"],
                       "shuffled": rows["AV on shuffled vectors → AR"]["fve"]})
        logging.getLogger(__name__).info("step %d: FVE %.3f, recall %.3f", step, rt["fve"], f["recall"])
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"batch_size": batch, "ar": str(ar), "points": points,
           "av_quickstart": [{"step": r["step"], "gap": r.get("eval_vector_gap")}
                             for r in _jsonl(args.run / "av" / "av.jsonl") if "eval_vector_gap" in r]}
    (args.out / "av_curve.json").write_text(json.dumps(out, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["rows"] for p in points]
    ax.plot(xs, [p["fve"] for p in points], "o-", label="round-trip FVE (the run's AR)")
    ax.plot(xs, [p["recall"] for p in points], "s--", label="claim recall")
    ax.plot(xs, [p["gap"] for p in points], "^:", label="AV real-vs-shuffled gap")
    ax.set_xlabel("AV training rows seen (steps x batch)")
    ax.set_title(f"{args.run.name}: what more AV steps buy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "av_curve.png", dpi=120)
    print(json.dumps(points, indent=2))


if __name__ == "__main__":
    main()
