"""Issue 48: the quickstart's out dir holds one run. A stage that finished with another config is
refused (it used to be cleared without asking: ``--threads 1`` on a run made with another count
cleared ``ar/`` and ``av/``), ``--overwrite`` runs it again, and a rerun that is interrupted leaves
no report describing the old run. A second quickstart on the same dir is refused while one runs."""

from __future__ import annotations

import json
import subprocess
import sys

from nla.cli import main
from nla.quickstart import PRESETS

HOLDER = """
import sys, time
from nla.train.rundir import lock_run_dir
lock = lock_run_dir(sys.argv[1], "nla quickstart --out X")
print("locked", flush=True)
time.sleep(600)
"""


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def _finished_run(out):
    """A run dir whose world stage finished with threads=2, with a report and an AR stage dir."""
    out.mkdir()
    (out / "world.stage_done.json").write_text(json.dumps(
        {"config_hash": "0" * 12, "config": {"preset": PRESETS["tiny"].world, "threads": 2}, "seconds": 1.0}))
    (out / "report.json").write_text('{"old": true}')
    (out / "report.md").write_text("old report")
    (out / "ar").mkdir()
    (out / "ar" / "ar.jsonl").write_text("{}\n")


def test_a_finished_stage_of_another_config_is_refused_and_nothing_cleared(tmp_path, capsys):
    out = tmp_path / "qs"
    _finished_run(out)
    code, lines = _cli(capsys, "quickstart", "--preset", "tiny", "--out", out, "--threads", "1", "--no-progress")
    assert code == 2
    errors = [ln for ln in lines if ln.startswith("nla quickstart: error: ")]
    assert len(errors) == 1, lines
    assert "the world stage finished there with another config (threads: 2 then, 1 now)" in errors[0]
    assert "--overwrite" in errors[0]
    assert (out / "report.json").read_text() == '{"old": true}' and (out / "ar" / "ar.jsonl").is_file()


def test_overwrite_reruns_it_and_an_interrupted_rerun_leaves_no_old_report(tmp_path, capsys, monkeypatch):
    import nla.quickstart as qs

    out = tmp_path / "qs"
    _finished_run(out)

    def interrupted(*args, **kwargs):
        raise RuntimeError("interrupted while building the world")

    monkeypatch.setattr(qs, "_world", interrupted)
    code, lines = _cli(capsys, "quickstart", "--preset", "tiny", "--out", out, "--threads", "1", "--no-progress",
                       "--overwrite")
    assert code == 2 and any("interrupted while building the world" in ln for ln in lines)
    assert not (out / "report.json").exists() and not (out / "report.md").exists()


def test_a_second_quickstart_on_one_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "qs"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, lines = _cli(capsys, "quickstart", "--preset", "tiny", "--out", out, "--threads", "1", "--no-progress")
        assert code == 2
        assert any(f"is in use by another nla run (pid {holder.pid}, `nla quickstart --out X`" in ln for ln in lines)
        assert sorted(p.name for p in out.iterdir()) == [".nla.lock"]
    finally:
        holder.kill()
        holder.wait()


def test_injection_scale_setting_reaches_the_av_and_only_when_given(tmp_path, capsys):
    from nla.quickstart import pair_settings

    assert pair_settings("none") == {}  # the default's stage hashes do not change
    assert pair_settings("none", injection_scale=32) == {"injection_scale": 32.0}
    code, lines = _cli(capsys, "quickstart", "--preset", "tiny", "--out", tmp_path / "q", "--injection-scale", "0")
    assert code == 2
    assert any("injection_scale: expected a positive finite number" in ln for ln in lines)


# ---------------------------------------------------------------------------------------------- issue 58
def test_a_stage_whose_outputs_were_deleted_is_run_again_not_cached(tmp_path, caplog):
    """A finished stage whose outputs were deleted was still reported cached."""
    from nla.quickstart import _cached_stage, _mark_stage, finished_stage_conflict

    out = tmp_path / "qs"
    (out / "eval_rl").mkdir(parents=True)
    (out / "eval_rl" / "eval.json").write_text("{}")
    ckpt = out / "rl" / "checkpoints" / "step_00000030"
    (ckpt / "av").mkdir(parents=True)
    config = {"dataset": "d.parquet", "threads": 1}
    _mark_stage(out, "eval_rl", config, {"report": {}})
    _mark_stage(out, "rl", config, {"checkpoint": str(ckpt), "av": str(ckpt / "av"), "ar": str(ckpt / "ar")})
    assert _cached_stage(out, "eval_rl", config) is not None
    assert _cached_stage(out, "rl", config) is None  # its AR was never there
    (out / "eval_rl" / "eval.json").unlink()
    with caplog.at_level("WARNING", logger="nla.quickstart"):
        assert _cached_stage(out, "eval_rl", config) is None
    assert f"[eval_rl] finished before, but its outputs are gone ({out / 'eval_rl' / 'eval.json'}): running it again" \
        in caplog.text
    # the same config: no conflict, it simply runs again; another config is still a conflict
    assert finished_stage_conflict(out, "eval_rl", config) is None
    assert "threads: 1 then, 2 now" in finished_stage_conflict(out, "eval_rl", {**config, "threads": 2})


def test_settings_the_quickstart_makes_itself_are_refused_before_any_stage(tmp_path, capsys):
    """--set datagen.seed=5 was a TypeError after the world and probe stages had run."""
    for setting, said in (("datagen.seed=5", "stage datagen: seed is set by the quickstart itself (--seed), not by "
                                             "a stage setting; remove --set datagen.seed and use --seed"),
                          ("datagen.threads=2", "stage datagen: threads is set by the quickstart itself (--threads)"),
                          ("datagen.shuffled_baseline=false", "shuffled_baseline is set by the quickstart itself "
                                                              "(always on)"),
                          ("rl.out_dir=/tmp/x", "stage rl: out_dir is set by the quickstart itself (the run's own "
                                                "path)"),
                          ("av.seed=1", "stage av: seed is set by the quickstart itself (--seed)")):
        out = tmp_path / setting.split("=")[0]
        code, lines = _cli(capsys, "quickstart", "--preset", "tiny", "--out", out, "--set", setting, "--no-progress")
        assert code == 2
        errors = [ln for ln in lines if ln.startswith("nla quickstart: error: ")]
        assert len(errors) == 1 and said in errors[0], (setting, lines)
        assert not out.exists()  # refused before the world stage
    for preset in PRESETS.values():  # the presets themselves set none of them
        preset.check("preset")


def test_a_stage_runs_again_when_a_stage_it_reads_ran_again():
    """``--set ar.exits=true --overwrite`` on a finished run reran the AR and then took RL from its marker: RL's
    config names the AR's path, not its settings, so the RL'd pair was the old AR's. A stage now records the
    config hashes of the stages it reads and runs again where one ran since."""
    from nla.quickstart import stale_upstream

    now = {"datagen": "d1", "ar": "a2", "av": "v1"}
    # ran in this invocation: stale, whatever the marker says (a marker written before markers recorded it)
    assert stale_upstream({"config_hash": "r"}, now, fresh={"ar"}) == ["ar"]
    assert stale_upstream({"config_hash": "r"}, now, fresh=set()) == []
    # the marker's record against the stages' configs now (a run interrupted between the AR and RL)
    assert stale_upstream({"upstream": {"datagen": "d1", "ar": "a1", "av": "v1"}}, now, fresh=set()) == ["ar"]
    assert stale_upstream({"upstream": dict(now)}, now, fresh=set()) == []
    assert stale_upstream({"upstream": {"datagen": "d0", "ar": "a1", "av": "v1"}}, now, fresh={"ar"}) == ["ar", "datagen"]


def test_a_one_block_pair_from_the_layers_preset_names_the_settings_to_reset(tmp_path, capsys):
    """The layers preset's prompts name the block and its AR reads each row at its block: a one-block pair made
    from it (datagen.layers=null, the measure's one-block pairs) is refused before the world is built, each
    setting named with the --set that resets it; with them reset it passes the check."""
    out = tmp_path / "qs"
    code, lines = _cli(capsys, "quickstart", "--preset", "layers", "--out", out, "--no-progress", "--set",
                       "datagen.layers=null", "--set", "datagen.layer_index=2")
    assert code == 2
    (err,) = [ln for ln in lines if ln.startswith("nla quickstart: error: ")]
    assert "a pair for one block (datagen.layers null) with settings for several: datagen.av_template: " in err
    assert "ar.exits: true (reads each row at its own block); reset them (--set datagen.av_template=null --set " \
           "datagen.ar_template=null --set ar.exits=false) or give datagen.layers" in err
    assert not out.exists() or not any(out.iterdir())  # nothing built
    from nla.quickstart import with_settings

    p = with_settings(PRESETS["layers"], ["datagen.layers=null", "datagen.layer_index=2", "datagen.av_template=null",
                                          "datagen.ar_template=null", "ar.exits=false"])
    assert p.datagen["av_template"] is None and p.ar["exits"] is False
