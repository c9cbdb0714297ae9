"""`nla quickstart --set STAGE.KEY=VALUE`: a preset changed from the command line, checked before any
stage runs, in its own run directory, named in its report."""

from __future__ import annotations

import pytest

import nla.quickstart as qs
from nla.cli import main


@pytest.mark.parametrize("text, path, value", [
    ("av.max_steps=1000", ("av", "max_steps"), 1000),
    ("rl.optimiser.lr=3e-4", ("rl", "optimiser", "lr"), 3e-4),  # YAML 1.1 reads 3e-4 as text; a number here
    ("rl.loss.kl_coef=0.0", ("rl", "loss", "kl_coef"), 0.0),
    ("suite.best_of=[1, 8]", ("suite", "best_of"), [1, 8]),
    ("eval_max_rows=null", ("eval_max_rows",), None),
    ("ar.shuffle_sentences=false", ("ar", "shuffle_sentences"), False),
    ("world=default-d64", ("world",), "default-d64"),
    (" av.lr = 2e-3 ", ("av", "lr"), 2e-3),
])
def test_a_setting_is_read_as_a_path_and_a_yaml_value(text, path, value):
    got_path, got = qs.parse_setting(text)
    assert got_path == path and got == value and type(got) is type(value)


@pytest.mark.parametrize("text, message", [
    ("av.max_steps", "expected STAGE.KEY=VALUE"),
    ("av.max_steps=", "expected STAGE.KEY=VALUE"),
    ("av..lr=1", "expected STAGE.KEY=VALUE"),
    ("av=3", "av is a stage; name one of its settings"),
    ("eval_max_rows.x=3", "eval_max_rows is a single value"),
    ("trainer.lr=1", "unknown stage or field 'trainer'; expected a stage (datagen, ar, av, rl, suite, probe, "
                     "cross_model) or a field (world, eval_fraction, eval_max_rows, max_new_tokens)"),
    ("suite.best_of=[1", "the value is not valid YAML"),
])
def test_a_malformed_setting_is_named(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        qs.parse_setting(text)


def test_settings_change_a_copy_nested_and_in_order():
    default = qs.PRESETS["default"]
    before = (default.av["max_steps"], dict(default.rl["rollout"]), default.eval_max_rows)
    p = qs.with_settings(default, ["av.max_steps=1000", "rl.rollout.n_samples_per_prompt=4", "rl.steps=50",
                                   "rl.steps=60", "eval_max_rows=800", "rl.checkpointing.save_every=60"])
    assert p.av["max_steps"] == 1000 and p.av["lr"] == default.av["lr"]  # the rest of the stage kept
    assert p.rl["rollout"] == {**default.rl["rollout"], "n_samples_per_prompt": 4}
    assert p.rl["steps"] == 60 and p.rl["checkpointing"]["save_every"] == 60  # a later setting wins
    assert p.eval_max_rows == 800 and p.ar == default.ar
    assert (default.av["max_steps"], default.rl["rollout"], default.eval_max_rows) == before  # the preset untouched
    p.check("default with ...")  # every stage's config builds
    with pytest.raises(ValueError, match="rl.steps is a value, not a group of settings"):
        qs.with_settings(default, ["rl.steps.x=3"])


def test_a_wrong_field_is_named_with_the_stage_and_its_settings():
    with pytest.raises(ValueError, match=r"preset 'default with av.max_step=9', stage av: .*'max_step'; "
                                         r"its settings are .*max_steps"):
        qs.run_quickstart("default", "unused", settings=["av.max_step=9"])
    with pytest.raises(ValueError, match=r"stage rl: RLConfig.rollout: unknown config key\(s\) \['n_sample'\]"):
        qs.run_quickstart("default", "unused", settings=["rl.rollout.n_sample=4"])
    with pytest.raises(ValueError, match=r"stage suite: unknown setting 'rows'"):
        qs.run_quickstart("default", "unused", settings=["suite.rows=4"])
    with pytest.raises(ValueError, match=r"world: expected one of .*found 'huge'"):
        qs.run_quickstart("default", "unused", settings=["world=huge"])


def test_the_cli_passes_settings_to_the_run_and_gives_it_its_own_directory(monkeypatch, tmp_path, capsys):
    seen = {}

    def stages(out, p, label, *args):  # the run, stopped after the preset was changed and checked
        seen.update(out=out, preset=p, label=label)
        raise ValueError("stopped here")

    monkeypatch.setattr(qs, "_run_stages", stages)
    monkeypatch.chdir(tmp_path)
    assert main(["quickstart", "--set", "av.max_steps=1000", "--set", "rl.steps=50", "--seed", "2"]) == 2
    assert "stopped here" in capsys.readouterr().err
    assert seen["preset"].av["max_steps"] == 1000 and seen["preset"].rl["steps"] == 50
    assert seen["label"] == "default with av.max_steps=1000 rl.steps=50"  # the report's title names them
    digest = seen["out"].name.removeprefix("quickstart-default-set-").removesuffix("-seed2")
    assert len(digest) == 8 and seen["out"].name == f"quickstart-default-set-{digest}-seed2"
    assert main(["quickstart", "--set", "rl.steps=50", "--set", "av.max_steps=1000"]) == 2
    assert seen["out"].name != f"quickstart-default-set-{digest}"  # other settings (in order): another dir
    assert main(["quickstart"]) == 2
    assert seen["out"].name == "quickstart-default" and seen["label"] == "default"  # no --set: as before
    assert main(["quickstart", "--set", "av.max_steps"]) == 2
    assert "expected STAGE.KEY=VALUE" in capsys.readouterr().err


def test_autocast_sets_the_three_training_stages_and_a_later_set_wins(monkeypatch, tmp_path, capsys):
    """``--autocast`` sets the three stages; a later ``--set`` of one wins; and every stage with autocast is
    prepared (the CPU checked, the pin's oneDNN cap lifted) before the first stage runs: torch settles its
    bf16 kernels at the process's first matmul (nla.util.precision.lift_onednn_cap)."""
    from nla.util import precision

    seen, prepared = {}, []

    def stages(out, p, label, *args):
        seen.update(preset=p, label=label, prepared_before=list(prepared))
        raise ValueError("stopped here")

    monkeypatch.setattr(qs, "_run_stages", stages)
    monkeypatch.setattr(precision, "prepare_autocast", lambda name, device, field="autocast", flags=None:
                        prepared.append((name, device.type, field)))
    monkeypatch.chdir(tmp_path)
    assert main(["quickstart", "--autocast", "bfloat16", "--set", "rl.autocast=null"]) == 2
    p = seen["preset"]
    assert (p.ar["autocast"], p.av["autocast"], p.rl["autocast"]) == ("bfloat16", "bfloat16", None)
    assert seen["prepared_before"] == [("bfloat16", "cpu", "ar.autocast"), ("bfloat16", "cpu", "av.autocast")]
    assert seen["label"] == "default with ar.autocast=bfloat16 av.autocast=bfloat16 rl.autocast=bfloat16 rl.autocast=null"
