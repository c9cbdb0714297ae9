"""One AV injection on one warm-start draw of a quickstart run, and the table over draws (issue 24).

Which kinds a warm-started AV learns to read is a draw (dev/LOG.md "The warm-start is a per-kind
lottery"), so an injection (the fixed scale, a learned adapter) is judged over several draws:
worlds (the quickstart's --seed) times training seeds of the AV warm-start. A draw keeps the run's
world, data, AR warm-start and RL config and changes only the AV's injection and training seed:

    python -m dev.experiments.injection_draws RUN --variant affine-conformal-mean-invariant [--train-seed S] [--threads T]
        [--av-set KEY=VALUE ...] [--rl-set KEY=VALUE ...] [--recipe-from RUN0]
    python -m dev.experiments.injection_draws --table RUN_OR_DRAW [RUN_OR_DRAW ...] [--json F]

RUN: a quickstart run directory (`nla quickstart --seed W`). --variant: one of
nla.quickstart.INJECTION_ADAPTERS ("none" is the fixed scale); --train-seed: the AV warm-start's
seed (default: the run's); --threads: torch threads of every step (default: the run's; the count
changes the last bits, so a draw names it). The steps, each resumed from its output when it is
there: the AV warm-start (the run's own config with the variant's settings), the warm-started
pair's eval, RL (the run's config with that AV), the RL'd pair's eval (the run's warm-start AR as
the frozen reader; the quickstart's held-out rows and new tokens), and the RL'd pair on
shifted vectors (dev/experiments/shifted_vectors.py's centred and offset, --max-rows rows). It writes
DRAW/draw.json (out: RUN/draws/<variant>-s<S>-t<T>[-aug<M>]).

--table prints a row per run or draw (a quickstart run is its own draw: the fixed scale at its
seed): FVE warm-start -> RL, the frozen warm-start AR and the oracle (every true fact) after RL,
recall / precision, recall per kind, centred and offset vectors, the kinds the warm-started AV
does not read (nla.eval.report.unread_kinds) and degenerate outputs; and per variant, mean ± sample sd
over the draws given.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

SHIFTED = ("centred", "offset")
KINDS = ("person", "place", "activity", "object", "mood", "time")


def _resolve(run: Path, p: str | Path) -> Path:
    # a quickstart run's recorded paths are relative to the directory it ran in (two levels up)
    p = Path(p)
    return p if p.is_absolute() else run.resolve().parent.parent / p


def _done(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


_PER_RUN = ("dataset", "out_dir", "seed", "threads", "progress")  # what differs between two runs of one preset


def _stages(run: Path, recipe_from: Path | None) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    """The run's ar, av, rl and eval_rl stage records, the RL config file and the RL settings that
    point at the run's own data. recipe_from: a finished run of the same preset whose AV, RL and
    eval configs are taken, with this run's data and seed, when RUN has only its world, data and AR
    (a draw does not need the run's own AV and RL: that is its fixed scale at its own seed)."""
    names = ("ar", "av", "rl", "eval_rl")
    stages = {s: json.loads((run / f"{s}.stage_done.json").read_text()) for s in names
              if (run / f"{s}.stage_done.json").is_file()}
    if len(stages) == 4:
        return stages, _resolve(run, stages["rl"]["checkpoint"]).parent.parent / "rl_config.yaml", {}
    if recipe_from is None or "ar" not in stages:
        raise SystemExit(f"{run}: not a finished quickstart run (its ar, av, rl and eval_rl stages must be done; "
                         "with --recipe-from a finished run of the same preset, its ar stage is enough)")
    base, rl_yaml, _ = _stages(recipe_from, None)
    same = [{k: v for k, v in st["ar"]["config"].items() if k not in _PER_RUN} for st in (stages, base)]
    if same[0] != same[1]:
        raise SystemExit(f"--recipe-from {recipe_from}: not the same preset as {run} (their AR warm-starts differ "
                         f"beyond data, seed and threads: {same[1]} vs {same[0]})")
    seed = stages["ar"]["config"].get("seed", 0)
    datagen = Path(stages["ar"]["config"]["dataset"]).parent  # recorded as the run recorded its own
    av = {k: v for k, v in base["av"]["config"].items() if k != "seed"}
    av.update(dataset=str(datagen / "av_sft.parquet"), **({"seed": seed} if seed else {}))
    stages = {**base, "ar": stages["ar"], "av": {**base["av"], "config": av}}
    rl_paths = {"dataset": str(_resolve(run, datagen / "rl_train.parquet")),
                "eval_dataset": str(_resolve(run, datagen / "eval.parquet")),
                "reconstructor.replay_dataset": str(_resolve(run, datagen / "ar_sft.parquet")), "seed": seed}
    return stages, rl_yaml, rl_paths


def run_draw(run: Path, variant: str, train_seed: int | None, threads: int | None, augment: float,
             out: Path | None, max_rows: int, av_set: dict[str, Any] | None = None,
             rl_set: dict[str, Any] | None = None, recipe_from: Path | None = None) -> Path:
    from nla.quickstart import INJECTION_ADAPTERS, evaluate_stage, pair_settings, rl_stage, train_stage
    from nla.rl.config import load_rl_config
    from nla.rl.loop import run_rl
    from nla.train.av import train_av
    from nla.train.config import AVTrainConfig, load_config
    from nla.util.threads import apply_threads

    if variant not in INJECTION_ADAPTERS:
        raise SystemExit(f"--variant: expected one of {', '.join(INJECTION_ADAPTERS)}, found {variant!r}")
    stages, rl_yaml, rl_paths = _stages(run, recipe_from)
    av_cfg = dict(stages["av"]["config"])
    seed = av_cfg.get("seed", 0) if train_seed is None else train_seed
    threads = av_cfg["threads"] if threads is None else threads
    if av_cfg.get("base_model") or av_cfg.get("injection_adapter", "none") != "none":
        raise SystemExit(f"{run}: a same-model fixed-scale run is the base of a draw (its AV has "
                         f"base_model {av_cfg.get('base_model')!r}, injection_adapter {av_cfg.get('injection_adapter')!r})")
    name = f"{variant}-s{seed}-t{threads}" + (f"-aug{augment:g}" if augment else "")
    if av_set or rl_set:  # another recipe: its own dir, named by what changed
        name += "-" + hashlib.sha256(json.dumps([av_set, rl_set], sort_keys=True).encode()).hexdigest()[:8]
    out = out or run / "draws" / name
    out.mkdir(parents=True, exist_ok=True)
    apply_threads(threads)
    datagen = run / "datagen"
    eval_ds, frozen = datagen / "eval.parquet", str(_resolve(run, stages["ar"]["checkpoint"]))
    kw = {k: stages["eval_rl"]["config"][k] for k in ("max_rows", "max_new_tokens")}  # the quickstart's evals

    av_cfg.update(pair_settings(variant, mean_shift_augment=augment), seed=seed, threads=threads, progress=True,
                  dataset=str(_resolve(run, av_cfg["dataset"])), out_dir=str(out / "av"))
    av_cfg.update(av_set or {})
    av = _done(out / "av.json")
    if av is None:
        print(f"[{name}] AV warm-start", file=sys.stderr, flush=True)
        av = train_stage(train_av, load_config(AVTrainConfig, None, av_cfg))
        (out / "av.json").write_text(json.dumps(av, default=str))
    warm = _done(out / "eval_warmstart" / "eval.json")
    if warm is None:
        print(f"[{name}] eval of the warm-started pair", file=sys.stderr, flush=True)
        warm = evaluate_stage(av["checkpoint"], frozen, eval_ds, out / "eval_warmstart", kw, frozen)["report"]
    rl = _done(out / "rl.json")
    if rl is None:
        print(f"[{name}] RL", file=sys.stderr, flush=True)
        cfg = load_rl_config(rl_yaml, {**rl_paths, **(rl_set or {}), "av": av["checkpoint"], "ar": frozen,
                                       "out_dir": str(out / "rl"), "threads": threads})
        rl = rl_stage(run_rl, cfg)
        (out / "rl.json").write_text(json.dumps(rl, default=str))
    after = _done(out / "eval_rl" / "eval.json")
    if after is None:
        print(f"[{name}] eval of the RL'd pair", file=sys.stderr, flush=True)
        after = evaluate_stage(rl["av"], rl["ar"], eval_ds, out / "eval_rl", kw, frozen)["report"]
    shifted = _done(out / "shifted.json")
    if shifted is None:
        shifted = shifted_rows(rl["av"], rl["ar"], eval_ds, max_rows, kw["max_new_tokens"])
        (out / "shifted.json").write_text(json.dumps(shifted, indent=1))
    draw = {"run": str(run), "variant": variant, "train_seed": seed, "threads": threads, "mean_shift_augment": augment,
            "world_seed": stages["av"]["config"].get("seed", 0), "eval_warmstart": warm, "eval_rl": after,
            "shifted": shifted, "shifted_rows": max_rows, "av_set": av_set or {}, "rl_set": rl_set or {}}
    (out / "draw.json").write_text(json.dumps(draw, indent=1, default=str))
    print(f"[{name}] done: {out / 'draw.json'}", file=sys.stderr)
    return out


def shifted_rows(av: str, ar: str, eval_ds: Path, max_rows: int,
                 max_new_tokens: int) -> dict[str, dict[str, float | None]]:
    """The RL'd pair on the centred and offset held-out vectors (dev/experiments/shifted_vectors.py's shifts;
    a norm shift reads exactly as the vector as it is: the injection rescales first)."""
    import tempfile

    from dev.experiments.shifted_vectors import write_shifted
    from nla.client import NLAClient
    from nla.eval.evaluate import ROW_ROUND_TRIP, evaluate_pair

    client, res = NLAClient(av, ar), {}
    with tempfile.TemporaryDirectory() as tmp:
        for how in SHIFTED:
            rep = evaluate_pair(client, write_shifted(eval_ds, how, Path(tmp)), max_rows=max_rows,
                                text_explainer_baseline=False, max_new_tokens=max_new_tokens).to_dict()
            row = next(r for r in rep["rows"] if r["name"] == ROW_ROUND_TRIP)
            faith = row.get("faithfulness") or {}
            res[how] = {"fve": row.get("fve"), "recall": faith.get("recall"), "precision": faith.get("precision")}
    return res


def load_draw(path: Path, max_rows: int) -> dict[str, Any]:
    """A draw's figures; a quickstart run dir is the fixed scale's draw at its own seeds (its shifted
    rows are computed once and kept in RUN/draws/shifted-<rows>.json)."""
    if (path / "draw.json").is_file():
        return json.loads((path / "draw.json").read_text())
    rep = path / "report.json"
    if not rep.is_file():
        raise SystemExit(f"--table {path}: neither a draw (draw.json) nor a quickstart run (report.json)")
    report = json.loads(rep.read_text())
    av_cfg = json.loads((path / "av.stage_done.json").read_text())["config"]
    rl = json.loads((path / "rl.stage_done.json").read_text())
    new_tokens = json.loads((path / "eval_rl.stage_done.json").read_text())["config"]["max_new_tokens"]
    cache = path / "draws" / f"shifted-{max_rows}.json"
    if not cache.is_file():
        from nla.util.threads import apply_threads

        apply_threads(av_cfg["threads"])
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(shifted_rows(str(_resolve(path, rl["av"])), str(_resolve(path, rl["ar"])),
                                                 path / "datagen" / "eval.parquet", max_rows, new_tokens),
                                    indent=1))
    variant = "none" if av_cfg.get("injection_adapter", "none") == "none" else "quickstart adapter run"
    return {"run": str(path), "variant": variant, "train_seed": av_cfg.get("seed", 0), "threads": av_cfg["threads"],
            "mean_shift_augment": av_cfg.get("mean_shift_augment", 0.0), "world_seed": av_cfg.get("seed", 0),
            "eval_warmstart": report["eval_warmstart"], "eval_rl": report["eval_rl"],
            "shifted": json.loads(cache.read_text()), "shifted_rows": max_rows}


def figures(draw: dict[str, Any]) -> dict[str, Any]:
    from nla.eval.evaluate import ROW_ROUND_TRIP
    from nla.eval.report import faithfulness_summary, kind_summary, unread_kinds

    w, a = draw["eval_warmstart"], draw["eval_rl"]
    rt = lambda rep: next(r for r in rep["rows"] if r["name"] == ROW_ROUND_TRIP)  # noqa: E731
    warm_kinds = kind_summary(w)
    fig = {"fve_warm": rt(w)["fve"], "fve_rl": rt(a)["fve"], **faithfulness_summary(w, a),
           "kinds_rl": {k: v[0] for k, v in kind_summary(a).items()},
           "kinds_warm": {k: v[0] for k, v in warm_kinds.items()}, "unread": sorted(unread_kinds(w))}
    for how in SHIFTED:
        for key in ("fve", "recall", "precision"):
            fig[f"{how}_{key}"] = draw["shifted"][how][key]
    return fig


def _f(v: float | None, nd: int = 3) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def _ms(vals: list[float | None]) -> str:
    vals = [v for v in vals if v is not None]
    if len(vals) < 2:
        return _f(vals[0]) if vals else "–"
    return f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals):.3f}"


def _variant(d: dict[str, Any]) -> str:
    return d["variant"] + (f" + augment {d['mean_shift_augment']:g}" if d["mean_shift_augment"] else "")


def table(paths: list[Path], max_rows: int) -> tuple[str, dict[str, Any]]:
    draws = [load_draw(p, max_rows) for p in paths]
    figs = [figures(d) for d in draws]
    head = ("| draw (variant, world seed, training seed, threads) | FVE warm → RL | frozen AR / oracle | recall / precision "
            "| recall after RL: " + " / ".join(KINDS) + " | centred FVE / recall / precision | offset FVE / recall "
            "/ precision | not read at warm-start | degenerate |")
    lines = [head, "|" + "---|" * 9]
    for d, f in zip(draws, figs, strict=True):
        label = f"{_variant(d)}, world {d['world_seed']}, S = {d['train_seed']}, T = {d['threads']}"
        kinds = " / ".join(_f(f["kinds_rl"].get(k), 2) for k in KINDS)
        unread = ", ".join(f"{k} ({_f(f['kinds_warm'].get(k), 2)} → {_f(f['kinds_rl'].get(k), 2)})"
                           for k in f["unread"]) or "–"
        lines.append(f"| {label} | {_f(f['fve_warm'])} → {_f(f['fve_rl'])} | {_f(f['frozen_ar_fve_rl'])} / "
                     f"{_f(f['oracle_fve_rl'])} | {_f(f['recall_rl'])} / {_f(f['precision_rl'])} | {kinds} | "
                     + " | ".join(" / ".join(_f(f[f"{h}_{k}"]) for k in ("fve", "recall", "precision"))
                                  for h in SHIFTED)
                     + f" | {unread} | {_f(100 * (f['degenerate_rl'] or 0), 1)} % |")
    groups: dict[str, list[dict[str, Any]]] = {}
    for d, f in zip(draws, figs, strict=True):
        groups.setdefault(_variant(d), []).append(f)
    lines += ["", f"Mean ± sample sd over the draws of each variant (centred / offset on {max_rows} rows):", "",
              "| variant (draws) | FVE warm | FVE RL | frozen AR | recall RL | precision RL | worst kind after RL "
              "(min over draws) | centred recall / precision | offset recall / precision |", "|" + "---|" * 9]
    summary = {}
    for key, fs in groups.items():
        worst = min(((k, f["kinds_rl"].get(k)) for f in fs for k in KINDS if f["kinds_rl"].get(k) is not None),
                    key=lambda kv: kv[1], default=("–", None))
        cols = {name: [f[name] for f in fs] for name in ("fve_warm", "fve_rl", "frozen_ar_fve_rl", "recall_rl",
                                                          "precision_rl", "centred_recall", "centred_precision",
                                                          "offset_recall", "offset_precision")}
        summary[key] = cols
        col = cols.__getitem__
        lines.append(f"| {key} ({len(fs)}) | {_ms(col('fve_warm'))} | {_ms(col('fve_rl'))} | "
                     f"{_ms(col('frozen_ar_fve_rl'))} | {_ms(col('recall_rl'))} | {_ms(col('precision_rl'))} | "
                     f"{worst[0]} {_f(worst[1], 2)} | {_ms(col('centred_recall'))} / {_ms(col('centred_precision'))} | "
                     f"{_ms(col('offset_recall'))} / {_ms(col('offset_precision'))} |")
    return "\n".join(lines), {"draws": [str(p) for p in paths], "figures": figs, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="RUN (a draw on it), or with --table runs and draw dirs")
    ap.add_argument("--variant", default="none", help="nla.quickstart.INJECTION_ADAPTERS (none: the fixed scale)")
    ap.add_argument("--train-seed", type=int, default=None, help="the AV warm-start's seed (default: the run's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the run's)")
    ap.add_argument("--mean-shift-augment", type=float, default=0.0, metavar="M")
    ap.add_argument("--out", type=Path, default=None, help="the draw's dir (default RUN/draws/<name>)")
    ap.add_argument("--av-set", action="append", default=[], metavar="KEY=VALUE",
                    help="another AV warm-start setting (e.g. max_steps=3000); the draw's name gets a hash of them")
    ap.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="another RL setting, section keys dotted (e.g. steps=200)")
    ap.add_argument("--max-rows", type=int, default=400, help="rows of the shifted-vector evals")
    ap.add_argument("--recipe-from", type=Path, default=None, metavar="RUN0",
                    help="a finished run of the same preset: its AV, RL and eval configs (with RUN's data and "
                         "seed) when RUN has only its world, data and AR")
    ap.add_argument("--table", action="store_true", help="print the table over the runs and draws given")
    ap.add_argument("--json", type=Path, default=None, help="with --table: also write the figures here")
    args = ap.parse_args(argv)
    if args.table:
        text, data = table(args.paths, args.max_rows)
        print(text)
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
        return 0
    if len(args.paths) != 1:
        ap.error("a draw takes one RUN (or use --table)")
    from nla.util.overrides import parse_overrides

    run_draw(args.paths[0], args.variant, args.train_seed, args.threads, args.mean_shift_augment, args.out,
             args.max_rows, parse_overrides(args.av_set), parse_overrides(args.rl_set), args.recipe_from)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
