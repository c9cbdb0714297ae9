"""End to end: `nla quickstart --preset tiny` (the CI smoke run of the main job)."""

import json
import math
import re

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tiny_quickstart_run):
    return tiny_quickstart_run


def test_report_has_every_section_with_finite_numbers(run_dir):
    md = (run_dir / "report.md").read_text()
    for section in ("## Evaluation (held-out documents)", "## Training", "## Example explanations",
                    "## Time per stage", "## Configs used", "![RL](rl_curves.png)", "![AR warm-start](ar_curves.png)",
                    "![AV warm-start](av_curves.png)", "## What is in the vector", "| 1 (extraction layer) |",
                    "Faithfulness (facts named", "## Does it explain?"):
        assert section in md, section
    rep = json.loads((run_dir / "report.json").read_text())
    head = rep["headline"]
    for key in ("round_trip_fve_warmstart", "round_trip_fve_rl", "ar_heldout_fve_warmstart", "av_vector_gap",
                "rl_final_reward_mean", "subject_heldout_loss", "total_seconds", "recall_warmstart", "recall_rl",
                "precision_rl", "frozen_ar_fve_warmstart", "frozen_ar_fve_rl", "degenerate_rl", "probe_mean_top1",
                "probe_mean_chance"):
        assert isinstance(head[key], float) and math.isfinite(head[key]), key
    for which in ("eval_warmstart", "eval_rl"):
        names = [r["name"] for r in rep[which]["rows"]]
        assert names[:4] == ["AV → AR round trip", "AV → frozen warm-start AR", "AV on shuffled vectors → AR",
                             "text explainer → AR"]
        for r in rep[which]["rows"]:
            assert math.isfinite(r["fve"]) and math.isfinite(r["mse_mean"]), (which, r["name"])
        rows = {r["name"]: r for r in rep[which]["rows"]}
        for name in names[:4]:  # every explanation row is graded and checked for degeneracy
            assert 0 <= rows[name]["faithfulness"]["recall"] <= 1 and 0 <= rows[name]["degenerate"]["any"] <= 1
        # the frozen reader grades the same texts as the round trip
        assert rows[names[1]]["faithfulness"] == rows[names[0]]["faithfulness"]
        assert rep[which]["samples"], which
    assert [s["name"] for s in rep["stages"]] == ["world", "probe", "datagen", "ar", "av", "eval_warmstart", "rl",
                                                  "eval_rl", "suite"]
    # in the warm-start eval the frozen AR *is* the live AR: identical numbers
    warm = {r["name"]: r for r in rep["eval_warmstart"]["rows"]}
    assert warm["AV → frozen warm-start AR"]["fve"] == pytest.approx(warm["AV → AR round trip"]["fve"], abs=1e-6)
    assert rep["headline"]["probe_mean_top1"] > rep["headline"]["probe_mean_chance"]
    # the code paths every numeric library ran are on record, read back in the run's own process
    # (nla.util.numerics): on an x86 CPU with AVX2, the pinned AVX2 ones, with no shortfall
    from nla.util.numerics import describe_cpu_paths, mkl_branch, pin_applies

    paths = rep["headline"]["cpu_paths"]
    assert f"CPU paths {describe_cpu_paths(paths)})" in md.splitlines()[0]
    assert rep["headline"]["cpu_pin_shortfalls"] == [] and "the CPU pin did not hold" not in md
    if pin_applies():
        assert rep["headline"]["cpu_kernels"] == paths["aten"] == "AVX2"
        assert (paths["mkl_dynamic"], paths["openblas"]) == ("FALSE", "Haswell")
        assert paths["mkl"].split(" ")[0] == mkl_branch()  # AVX2 on Intel, "AUTO (...)" elsewhere
    for png in rep["plots"].values():
        assert (run_dir / png).stat().st_size > 1000
    # --no-progress reached every stage that draws a bar, datagen's extraction too
    for name in ("datagen", "ar", "av", "rl"):
        assert json.loads((run_dir / f"{name}.stage_done.json").read_text())["config"]["progress"] is False, name


def test_eval_numbers_match_a_direct_computation(run_dir):
    """Re-derive the RL pair's sample rows by hand: greedy verbalization, AR prediction, mse_nrm."""
    from nla.client import NLAClient
    from nla.core.reconstructor import tokenize_ar_texts
    from nla.core.reward import extract_explanation
    from nla.core.vectors import fve, mse_nrm
    from nla.datagen.io import read_vectors

    rep = json.loads((run_dir / "report.json").read_text())
    rl = json.loads((run_dir / "rl.stage_done.json").read_text())
    client = NLAClient(rl["av"], rl["ar"])
    full = torch.from_numpy(read_vectors(run_dir / "datagen" / "eval.parquet").copy())
    # the eval's seeded subset (max_rows of the preset), in dataset order
    n = rep["eval_rl"]["n_rows"]
    subset = np.sort(np.random.default_rng(0).choice(full.shape[0], size=n, replace=False)) if n < full.shape[0] \
        else np.arange(full.shape[0])
    gold = full[subset]
    samples = rep["eval_rl"]["samples"][:4]
    rows = [int(np.searchsorted(subset, s["row"])) for s in samples]
    # the same batching as the eval (greedy argmax can flip on near-ties when batch shapes differ)
    allv = client.verbalize(gold, max_new_tokens=64, batch_size=64)
    verbs = [allv[r] for r in rows]
    ar = client.ar
    scale = client.ar_sidecar.mse_scale_value()
    for s, v, row in zip(samples, verbs, rows, strict=True):
        assert v.explanation == s["explanation"] == extract_explanation(v.text)
        enc = tokenize_ar_texts(client.ar_tokenizer, [client.ar_sidecar.ar_text(v.explanation)], 256)
        with torch.no_grad():
            pred = ar.predict(enc["input_ids"], enc["attention_mask"])
        assert float(mse_nrm(pred, gold[row : row + 1], scale)) == pytest.approx(s["mse_nrm"], abs=1e-4)
    # the round-trip FVE of the report equals nla.core.vectors.fve over all rows (no failures here)
    rt = rep["eval_rl"]["rows"][0]
    if rt["failure_rate"] == 0.0:
        pred = client.reconstruct([v.explanation for v in allv])
        assert fve(pred, gold, scale) == pytest.approx(rt["fve"], abs=1e-4)
    assert np.isfinite(rep["eval_rl"]["baseline_raw_mean_mse"])


def test_rl_step_bench_runs_on_a_quickstart_run(run_dir, tmp_path):
    """bench.bench_rl_step reads the run's own RL config and reports consistent figures:
    each ratio is the quotient of the two rates it names, and tokens/s = samples/s x mean length."""
    import sys

    from bench import bench_rl_step as bench

    out = tmp_path / "bench.json"
    argv = sys.argv
    sys.argv = ["bench_rl_step.py", "--run", str(run_dir), "--steps", "1", "--threads", "1", "--json", str(out),
                "--skip", "trl,ar,passes,rollout"]
    try:
        bench.main()
    finally:
        sys.argv = argv
    res = json.loads(out.read_text())
    from nla.rl.config import load_rl_config

    cfg = load_rl_config(run_dir / "rl" / "rl_config.yaml")  # the warm-started pair the RL stage started from
    assert (res["config"]["av"], res["config"]["ar"]) == (cfg.av, cfg.ar)
    assert res["config"]["steps"] == 2 and res["threads"] == 1
    rates, toks, ratios = res["samples_per_s"], res["response_tokens_per_s"], res["ratios"]
    assert set(rates) == set(toks) == {"loop", "stock"} and all(v > 0 for v in rates.values())
    assert ratios["loop_vs_stock_samples"] == pytest.approx(rates["loop"] / rates["stock"])
    assert ratios["loop_vs_stock_tokens"] == pytest.approx(toks["loop"] / toks["stock"])
    lens = {k: toks[k] / rates[k] for k in rates}  # mean response length of each trainer
    assert all(1 <= n <= res["config"]["rollout"]["max_response_len"] for n in lens.values())
    assert res["inline_vs_thread"] > 0 and 0 < res["policy_rate_share"]


def test_every_preset_builds_each_stages_config_and_a_bad_setting_is_named():
    import dataclasses

    from nla.quickstart import PRESETS

    for name, preset in PRESETS.items():
        preset.check(name)  # the stage config types accept every setting
    bad = dataclasses.replace(PRESETS["tiny"], ar={**PRESETS["tiny"].ar, "max_stepz": 3})
    with pytest.raises(ValueError, match=r"preset 'mine', stage ar: .*unexpected keyword argument 'max_stepz'"):
        bad.check("mine")
    bad = dataclasses.replace(PRESETS["tiny"], rl={**PRESETS["tiny"].rl, "steps": "30"})
    with pytest.raises(ValueError, match=r"preset 'mine', stage rl: .*steps"):
        bad.check("mine")
    bad = dataclasses.replace(PRESETS["tiny"], world="huge")
    with pytest.raises(ValueError, match=r"preset 'mine': world: expected one of \[.*'tiny'.*\], found 'huge'"):
        bad.check("mine")
    bad = dataclasses.replace(PRESETS["tiny"], suite={"max_row": 3})
    with pytest.raises(ValueError, match=r"preset 'mine', stage suite: unknown setting 'max_row'; expected one of "
                                         r"max_rows, "):
        bad.check("mine")


def test_a_cross_model_pair_warm_starts_longer_and_the_default_is_unchanged():
    import dataclasses

    from nla.quickstart import PRESETS

    default = PRESETS["default"]
    ar, av = default.warm_start_settings(None)
    assert ar == default.ar and av == default.av and (ar["max_steps"], av["max_steps"]) == (800, 2000)
    ar, av = default.warm_start_settings("default-d64")
    assert (ar["max_steps"], ar["save_every"], av["max_steps"], av["save_every"]) == (2400, 2400, 3000, 3000)
    assert av["lr"] == 2e-3 and ar["lr"] == default.ar["lr"]  # only the lengths change
    ar, av = default.warm_start_settings("default-d64", "av")  # the subject's own AR: its recipe as it is
    assert (ar["max_steps"], av["max_steps"]) == (800, 3000)
    assert PRESETS["tiny"].warm_start_settings("tiny") == (PRESETS["tiny"].ar, PRESETS["tiny"].av)
    bad = dataclasses.replace(default, cross_model={"rl": {"steps": 3}})
    with pytest.raises(ValueError, match=r"preset 'mine', cross_model: unknown stage 'rl'; expected ar, av"):
        bad.check("mine")
    bad = dataclasses.replace(default, cross_model={"av": {"max_step": 3}})
    with pytest.raises(ValueError, match=r"preset 'mine', stage cross_model av: .*'max_step'"):
        bad.check("mine")


def test_injection_adapter_choices_reach_the_av_warm_start(monkeypatch, capsys):
    """--injection-adapter: the CLI offers nla.quickstart's choices, each becomes the AV warm-start's
    settings (a cross-model pair always has the affine adapter), a bad one is named before any work."""
    import nla.quickstart as qs
    from nla.cli import main

    assert qs.pair_settings("none") == {}
    assert qs.pair_settings("affine") == {"injection_adapter": "affine"}
    assert qs.pair_settings("affine-mean-invariant") == {"injection_adapter": "affine",
                                                         "injection_adapter_mean_invariant": True}
    assert qs.pair_settings("affine-conformal") == {"injection_adapter": "affine", "injection_adapter_conformal": True}
    assert qs.pair_settings("affine-conformal-mean-invariant") == {
        "injection_adapter": "affine", "injection_adapter_mean_invariant": True, "injection_adapter_conformal": True}
    assert qs.pair_settings("none", "/w/d64") == {"base_model": "/w/d64", "injection_adapter": "affine"}
    assert qs.pair_settings("affine-mean-invariant", "/w/d64") == {
        "base_model": "/w/d64", "injection_adapter": "affine", "injection_adapter_mean_invariant": True}
    with pytest.raises(ValueError, match="injection_adapter: expected one of 'none', 'affine', "
                                         "'affine-mean-invariant', 'affine-conformal', "
                                         "'affine-conformal-mean-invariant', found 'mean'"):
        qs.run_quickstart("tiny", "unused", injection_adapter="mean")
    with pytest.raises(ValueError, match="'affine-conformal' is for a same-model pair .* found pair_world 'default-d64'"):
        qs.run_quickstart("tiny", "unused", injection_adapter="affine-conformal", pair_world="default-d64")
    seen = {}

    def stop(preset, out, **kw):  # the CLI's call, stopped before any stage runs
        seen.update(kw, out=out)
        raise ValueError("stopped here")

    monkeypatch.setattr(qs, "run_quickstart", stop)
    outs = {}
    for choice in qs.INJECTION_ADAPTERS:
        assert main(["quickstart", "--injection-adapter", choice]) == 2
        assert seen["injection_adapter"] == choice
        outs[choice] = seen["out"]
    # every choice its own run dir: two settings sharing one would resume each other's stages
    assert outs == {"none": "runs/quickstart-default", "affine": "runs/quickstart-default-adapter",
                    "affine-mean-invariant": "runs/quickstart-default-adapter-mean-invariant",
                    "affine-conformal": "runs/quickstart-default-adapter-conformal",
                    "affine-conformal-mean-invariant": "runs/quickstart-default-adapter-conformal-mean-invariant"}
    assert main(["quickstart", "--pair-world", "default-d64", "--injection-adapter", "affine-mean-invariant"]) == 2
    assert seen["out"] == "runs/quickstart-default-pair-default-d64-mean-invariant"
    with pytest.raises(SystemExit):
        main(["quickstart", "--injection-adapter", "mean"])
    assert "invalid choice: 'mean'" in capsys.readouterr().err


def test_mean_shift_augment_reaches_the_av_warm_start(monkeypatch, capsys):
    """--mean-shift-augment M: 0 leaves the AV's settings (and so the default's stage hashes) as they
    were, M > 0 becomes AVTrainConfig.mean_shift_augment with either injection, a bad value is
    named before any stage runs."""
    import nla.quickstart as qs
    from nla.cli import main

    assert qs.pair_settings("none", mean_shift_augment=0.0) == {}
    assert qs.pair_settings("none", mean_shift_augment=1) == {"mean_shift_augment": 1.0}
    assert qs.pair_settings("affine", "/w/d64", 0.5) == {"base_model": "/w/d64", "injection_adapter": "affine",
                                                          "mean_shift_augment": 0.5}
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=r"mean_shift_augment: expected a finite number >= 0 \(0: off\), "
                                             rf"found {re.escape(repr(bad))}"):
            qs.run_quickstart("tiny", "unused", mean_shift_augment=bad)
    seen = {}

    def stop(preset, out, **kw):
        seen.update(kw, out=out)
        raise ValueError("stopped here")

    monkeypatch.setattr(qs, "run_quickstart", stop)
    assert main(["quickstart", "--injection-adapter", "affine", "--mean-shift-augment", "1"]) == 2
    assert seen["mean_shift_augment"] == 1.0
    assert seen["out"].endswith("runs/quickstart-default-adapter-augment1")
    assert main(["quickstart"]) == 2
    assert seen["mean_shift_augment"] == 0.0 and seen["out"].endswith("runs/quickstart-default")
    for bad in ("-0.5", "inf", "lots"):
        with pytest.raises(SystemExit):
            main(["quickstart", "--mean-shift-augment", bad])
    err = capsys.readouterr().err
    assert "expected a finite number >= 0, found -0.5" in err and "expected a number >= 0, found 'lots'" in err


def test_injection_draw_keeps_the_run_and_changes_only_the_av(run_dir, tmp_path):
    """dev/experiments/injection_draws.py: a draw on a quickstart run retrains only the AV with the variant's
    settings and its seed, RLs it with the run's RL config and frozen AR, evaluates it as the
    quickstart does, resumes from its outputs, and the table reads the same figures back."""
    from pathlib import Path

    import yaml

    from dev.experiments import injection_draws as draws

    with pytest.raises(SystemExit, match="--variant: expected one of none, affine, .*found 'rotation'"):
        draws.run_draw(run_dir, "rotation", None, None, 0.0, tmp_path / "x", 8)
    with pytest.raises(SystemExit, match="not a finished quickstart run"):
        draws.run_draw(tmp_path, "none", None, None, 0.0, tmp_path / "x", 8)
    short = ({"max_steps": 40, "eval_every": 20, "save_every": 40},  # a short recipe keeps CI's time
             {"steps": 4, "eval_every": 2, "checkpointing.save_every": 4})
    out = draws.run_draw(run_dir, "affine-conformal", 5, 1, 0.0, tmp_path / "draw", 8, *short)
    av_dir = Path(json.loads((out / "av.json").read_text())["checkpoint"])
    side = yaml.safe_load((av_dir / "nla_meta.yaml").read_text())
    assert side["injection_adapter"]["conformal"] is True and "mean_invariant" not in side["injection_adapter"]
    av_cfg = yaml.safe_load((av_dir / "train_config.yaml").read_text())
    run_av = json.loads((run_dir / "av.stage_done.json").read_text())["config"]
    assert (av_cfg["seed"], av_cfg["threads"], av_cfg["injection_adapter"]) == (5, 1, "affine")
    assert av_cfg["max_steps"] == 40 and av_cfg["lr"] == run_av["lr"] and av_cfg["dataset"].endswith(
        run_av["dataset"])
    rl_cfg = yaml.safe_load((out / "rl" / "rl_config.yaml").read_text())
    run_rl = yaml.safe_load((run_dir / "rl" / "rl_config.yaml").read_text())
    assert rl_cfg["ar"] == run_rl["ar"] and rl_cfg["av"] == str(av_dir) and rl_cfg["steps"] == 4
    assert rl_cfg["rollout"] == run_rl["rollout"] and rl_cfg["loss"] == run_rl["loss"]
    draw = json.loads((out / "draw.json").read_text())
    assert draw["eval_rl"] == json.loads((out / "eval_rl" / "eval.json").read_text())
    assert set(draw["shifted"]) == {"centred", "offset"} and draw["train_seed"] == 5
    stamp = (av_dir / "model.safetensors").stat().st_mtime_ns
    draws.run_draw(run_dir, "affine-conformal", 5, 1, 0.0, tmp_path / "draw", 8, *short)  # resumes, retrains nothing
    assert (av_dir / "model.safetensors").stat().st_mtime_ns == stamp
    text, data = draws.table([run_dir, out], 8)
    # --recipe-from: a run with only its world, data and AR takes a finished run's AV, RL and eval
    # configs with its own data; applied to the recipe's own AR it gives the recipe run back
    import shutil

    from nla.rl.config import load_rl_config

    only_ar = tmp_path / "only-ar"
    only_ar.mkdir()
    shutil.copy(run_dir / "ar.stage_done.json", only_ar)
    with pytest.raises(SystemExit, match="not a finished quickstart run.*--recipe-from"):
        draws._stages(only_ar, None)
    stages, rl_yaml, rl_paths = draws._stages(only_ar, run_dir)
    assert stages["av"]["config"] == run_av and stages["eval_rl"] == json.loads(
        (run_dir / "eval_rl.stage_done.json").read_text())
    mine, theirs = load_rl_config(rl_yaml, rl_paths), load_rl_config(run_dir / "rl" / "rl_config.yaml")
    for got, want in ((mine.dataset, theirs.dataset), (mine.eval_dataset, theirs.eval_dataset),
                      (mine.reconstructor.replay_dataset, theirs.reconstructor.replay_dataset)):
        assert draws._resolve(run_dir, got) == draws._resolve(run_dir, want)
    assert mine.seed == theirs.seed and mine.loss == theirs.loss
    other = json.loads((run_dir / "ar.stage_done.json").read_text())
    other["config"]["max_steps"] += 1
    (only_ar / "ar.stage_done.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="not the same preset"):
        draws._stages(only_ar, run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    run_fig, draw_fig = data["figures"]
    assert run_fig["fve_rl"] == report["headline"]["round_trip_fve_rl"]
    assert run_fig["recall_rl"] == report["headline"]["recall_rl"]
    rt = next(r for r in draw["eval_rl"]["rows"] if r["name"] == "AV → AR round trip")
    assert draw_fig["fve_rl"] == rt["fve"] and draw_fig["recall_rl"] == rt["faithfulness"]["recall"]
    assert draw_fig["centred_recall"] == draw["shifted"]["centred"]["recall"]
    assert set(data["summary"]) == {"none", "affine-conformal"}
    assert f"| affine-conformal, world 0, S = 5, T = 1 | {draw_fig['fve_warm']:.3f} → {draw_fig['fve_rl']:.3f} |" in text


def test_the_quotation_is_graded_per_position_in_eval_report_and_suite(run_dir, capsys):
    """Issue 57: the quotation of the text's end graded unit by unit, beside the unchanged fact figures."""
    rep = json.loads((run_dir / "report.json").read_text())
    for which in ("eval_warmstart", "eval_rl"):
        rows = {r["name"]: r for r in rep[which]["rows"]}
        q = rows["AV → AR round trip"]["faithfulness"]["quote"]
        assert q["n"] == rep[which]["n_rows"] and {"quote[0]", "quote[1]", "quote[2]"} <= set(q["by_position"])
        for recall, precision in q["by_position"].values():
            assert recall is None or 0 <= recall <= 1
            assert precision is None or 0 <= precision <= 1
        # the oracle quotes the true end: every quoted unit true, exactly the end on every row
        oracle = rows["oracle: every true fact → AR"]["faithfulness"]["quote"]
        assert oracle["exact"] == 1.0 and oracle["all_true"] == 1.0
        assert all(p == 1.0 for _, p in oracle["by_position"].values())
        assert "## Quotation of the text's end, unit by unit" in (run_dir / which / "eval.md").read_text()
    head = rep["headline"]
    assert 0 <= head["quote_exact_rl"] <= 1 and head["oracle_quote_exact_rl"] == 1.0
    assert set(head["quote_by_position_rl"]) >= {"quote[0]", "quote[1]", "quote[2]"}
    md = (run_dir / "report.md").read_text()
    assert "### The quotation of the text's end (AV → AR round trip)" in md and "| quote[0] (the token read) |" in md
    conf = rep["suite"]["sections"]["confabulation"]["pair"]["quotation"]
    assert conf["false_rate"] is None or 0 <= conf["false_rate"] <= 1
    from dev.experiments.quote_positions import main as quote_positions

    assert quote_positions([str(run_dir), "--from-report"]) == 0
    # the run's row (the header's first cell is "run" too, as the fixture's directory may be named)
    line = [ln for ln in capsys.readouterr().out.splitlines()
            if ln.startswith(f"| {run_dir.name} |") and ln.split(" | ")[1].isdigit()]
    assert line and line[0].split(" | ")[1] == str(rep["eval_rl"]["n_rows"])
