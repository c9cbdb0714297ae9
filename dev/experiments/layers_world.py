"""One pair for several blocks on the world (issue 59): the stages by hand, from a finished quickstart run.

The quickstart refuses ``datagen.layers`` until its report takes a block; this script runs the same stages
with the run's own settings (its datagen config, its AR / AV / RL configs, read from RUN) on data read at
``--layers`` blocks, with ``--fact-min-prob`` (a fact named only where a probe of its kind, fitted a block at
a time, holds it), the AR's, the AV's and RL's steps times ``--steps-scale``. It evaluates the held-out quarter
of the RL documents at warm-start and after RL (``nla eval``'s per-block table: each block against its own
baseline) and writes ``eval_warmstart.{md,json}``, ``eval_rl.{md,json}`` and ``times.json`` in OUT.

    NLA_CACHE=<RUN's cache> python -m dev.experiments.layers_world RUN --out OUT [--layers 0 1 2 3]
        [--fact-min-prob 0.5] [--steps-scale 1.6] [--datagen-from OTHER_OUT]

RUN: a finished ``nla quickstart`` run of the default preset (issue 59's first measures: seed 0's).
``--datagen-from``: reuse another OUT's datagen (the same rows; only the steps change).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import yaml


def _one(path: Path, pattern: str) -> Path:
    found = sorted(path.glob(pattern))
    if not found:
        raise SystemExit(f"{path}: no {pattern}; RUN must be a finished nla quickstart run directory")
    return found[-1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--fact-min-prob", type=float, default=0.5)
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--datagen-from", type=Path, default=None)
    args = ap.parse_args(argv)

    from nla.client import NLAClient
    from nla.datagen.config import DatagenConfig
    from nla.datagen.pipeline import run as run_datagen
    from nla.eval.evaluate import evaluate_pair
    from nla.quickstart import split_rl_for_eval
    from nla.rl.config import RLConfig
    from nla.rl.loop import run_rl
    from nla.train.ar import train_ar
    from nla.train.av import train_av
    from nla.train.config import ARTrainConfig, AVTrainConfig, load_config

    out, src, k = args.out, args.run, args.steps_scale
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    dg = out / "datagen"
    if args.datagen_from is not None and not dg.exists():
        shutil.copytree(args.datagen_from / "datagen", dg)
    d = yaml.safe_load((src / "datagen" / "datagen_config.yaml").read_text())
    d.update(out_dir=str(dg), layer_index=None, layers=list(args.layers), model_dir=None)
    d["world_explainer"]["fact_min_prob"] = args.fact_min_prob
    t = time.time()
    run_datagen(DatagenConfig.from_dict(d))
    times["datagen"] = time.time() - t
    rl_train, eval_ds = split_rl_for_eval(dg / "rl.parquet", dg, 0.25, seed=int(d["seed"]))  # the run's held-out docs

    def warm_start(train, cls, role: str, split: str):
        """The run's own ``role`` warm-start config on the new rows, its steps (and eval) scaled."""
        src_cfg = _one(src / role / "checkpoints", "step_*") / "train_config.yaml"
        cfg = yaml.safe_load(src_cfg.read_text())
        n, every = int(round(cfg["max_steps"] * k)), int(round(cfg["eval_every"] * k))
        t = time.time()
        result = train(load_config(cls, src_cfg, dict(dataset=str(dg / f"{split}.parquet"), out_dir=str(out / role),
                                                     tensorboard=False, max_steps=n, eval_every=every, save_every=n)))
        times[role] = time.time() - t
        return result

    ar = warm_start(train_ar, ARTrainConfig, "ar", "ar_sft")
    av = warm_start(train_av, AVTrainConfig, "av", "av_sft")

    def evaluate(av_dir: Path, ar_dir: Path, name: str, frozen: NLAClient | None = None) -> None:
        client = NLAClient(str(av_dir), str(ar_dir))
        report = evaluate_pair(client, eval_ds, max_new_tokens=64, frozen_ar=frozen or client)
        (out / f"{name}.md").write_text(report.to_markdown())
        (out / f"{name}.json").write_text(report.to_json())

    t = time.time()
    evaluate(av.checkpoint_dir, ar.checkpoint_dir, "eval_warmstart")
    times["eval_warm"] = time.time() - t
    rc = yaml.safe_load((src / "rl" / "rl_config.yaml").read_text())
    rc.update(dataset=str(rl_train), eval_dataset=str(eval_ds), out_dir=str(out / "rl"), av=str(av.checkpoint_dir),
              ar=str(ar.checkpoint_dir), tensorboard=False, steps=int(round(rc["steps"] * k)))
    rc["reconstructor"]["replay_dataset"] = str(dg / "ar_sft.parquet")
    rc["checkpointing"]["save_every"] = rc["steps"]
    t = time.time()
    rl = run_rl(RLConfig.from_dict(rc))
    times["rl"] = time.time() - t
    t = time.time()
    evaluate(rl.checkpoint_dir / "av", rl.checkpoint_dir / "ar", "eval_rl", frozen=NLAClient(None, str(ar.checkpoint_dir)))
    times["eval_rl"] = time.time() - t
    (out / "times.json").write_text(json.dumps(times, indent=1))
    print(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
