"""The generic config type check: expected types read from dataclass annotations (nla.util.configcheck)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from nla.cli import main
from nla.datagen.config import DatagenConfig
from nla.rl.config import load_rl_config
from nla.train.config import ARTrainConfig, load_config
from nla.util.configcheck import ConfigTypeError, check_config_types
from nla.world.build import WorldConfig


@dataclass(frozen=True)
class Inner:
    k: int = 1


@dataclass(frozen=True)
class Toy:
    n: int = 0
    x: float = 0.0
    name: str = ""
    flag: bool = False
    maybe: int | None = None
    scale: float | str | None = None
    mode: Literal["a", "b"] = "a"
    pair: tuple[float, float] = (0.0, 1.0)
    ids: tuple[int, ...] = ()
    inner: Inner = field(default_factory=Inner)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"n": 3, "x": 2}, {"n": 3, "x": 2}),  # float accepts int
        ({"x": "1e-4"}, {"x": 1e-4}),  # YAML 1.1 reads 1e-4 as a string: converted
        ({"maybe": None, "scale": "sqrt_d_model"}, {"maybe": None, "scale": "sqrt_d_model"}),
        ({"scale": 2.5, "mode": "b"}, {"scale": 2.5, "mode": "b"}),
        ({"pair": [0.9, 1], "ids": [1, 2, 3]}, {"pair": [0.9, 1], "ids": [1, 2, 3]}),
        ({"inner": {"k": 4}}, {"inner": {"k": 4}}),
        ({"unknown": "left to the caller"}, {"unknown": "left to the caller"}),
    ],
)
def test_accepted_values(data, expected):
    assert check_config_types(Toy, data) == expected


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"n": "3"}, r"Toy.n: expected an integer, found '3' \(str\); fix it in the YAML or with --set n=..."),
        ({"n": True}, r"Toy.n: expected an integer, found True \(bool\)"),  # bool is not an int here
        ({"n": 2.0}, r"Toy.n: expected an integer, found 2.0 \(float\)"),
        ({"x": False}, r"Toy.x: expected a number, found False"),
        ({"x": "nan"}, r"Toy.x: expected a number, found 'nan'"),  # not converted: no range check would catch it
        ({"x": [1.0]}, r"Toy.x: expected a number, found \[1.0\] \(list\)"),
        ({"name": 5}, r"Toy.name: expected a string, found 5"),
        ({"flag": "yes please"}, r"Toy.flag: expected true or false"),
        ({"maybe": "x"}, r"Toy.maybe: expected an integer or null, found 'x'"),
        ({"scale": [1]}, r"Toy.scale: expected a number or a string or null"),
        ({"mode": "c"}, r"Toy.mode: expected one of 'a', 'b', found 'c'"),
        ({"pair": [0.9]}, r"Toy.pair: expected a list of 2 \(a number, a number\), found \[0.9\]"),
        ({"pair": [0.9, "x"]}, r"Toy.pair: expected a list of 2"),
        ({"ids": [1, True]}, r"Toy.ids: expected a list of an integer"),
        ({"inner": {"k": "four"}}, r"Inner.k: expected an integer, found 'four' .*--set inner.k=..."),
        ({"inner": 3}, r"Toy.inner: expected a mapping of Inner fields, found 3"),
    ],
)
def test_refused_values_name_field_expected_and_found(data, message):
    with pytest.raises(ConfigTypeError, match=message):
        check_config_types(Toy, data)


@pytest.mark.parametrize(
    ("key", "owner", "value", "expected"),
    [("rollout.top_p", "RolloutConfig", "abc", "a number"),
     ("optimiser.warmup_steps", "OptimiserConfig", "ten", "an integer"),
     ("loss.gamma", "LossConfig", "one", "a number"), ("seed", "RLConfig", "x", "an integer"),
     ("optimiser.weight_decay", "OptimiserConfig", "none", "a number"), ("steps", "RLConfig", True, "an integer")],
)
def test_rl_config_strings_where_numbers_belong(key, owner, value, expected):
    # Section fields are checked too (RLConfig.from_dict runs the check over the nested sections);
    # the message names the section's class and the dotted key to --set, then says what the field is.
    field_name = key.rsplit(".", 1)[-1]
    with pytest.raises(ConfigTypeError, match=rf"^{owner}.{field_name}: expected {expected}, found {value!r} .*"
                                              rf"--set {key}=\.\.\. \({key}: .+\)$"):
        load_rl_config(None, {"av": "a", "ar": "b", "dataset": "c", key: value})
    # the nested YAML layout gives the same refusal as the dotted --set key
    section, _, sub = key.rpartition(".")
    if section:
        with pytest.raises(ConfigTypeError, match=rf"^{owner}.{field_name}: expected {expected}"):
            load_rl_config(None, {"av": "a", "ar": "b", "dataset": "c", section: {sub: value}})


def test_every_stage_config_checks_types():
    with pytest.raises(ConfigTypeError, match=r"ARTrainConfig.weight_decay: expected a number, found 'lots'"):
        load_config(ARTrainConfig, None, {"dataset": "d.parquet", "weight_decay": "lots"})
    assert load_config(ARTrainConfig, None, {"dataset": "d.parquet", "lr": "3e-4"}).lr == 3e-4
    with pytest.raises(ConfigTypeError, match=r"DatagenConfig.seed: expected an integer, found 'x'"):
        DatagenConfig.from_dict({"seed": "x"})
    with pytest.raises(ConfigTypeError, match=r"ProviderConfig.max_tokens: .*--set provider.max_tokens=..."):
        DatagenConfig.from_dict({"provider": {"max_tokens": "many"}})
    with pytest.raises(ConfigTypeError, match=r"WorldConfig.n_layers: expected an integer, found '6'"):
        WorldConfig.from_dict({"n_layers": "6"})


def test_cli_type_error_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["rl", "--set", "av=a", "--set", "ar=b", "--set", "dataset=c", "--set", "rollout.top_p=abc",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == ("nla rl: error: RolloutConfig.top_p: expected a number, found 'abc' (str); fix it in the YAML or "
                   "with --set rollout.top_p=... (rollout.top_p: nucleus sampling: keep the smallest set of tokens "
                   "holding this much probability; 1 = off. Range: (0, 1])\n")
    assert not (tmp_path / "run").exists()


def test_rl_reward_timeout_field():
    base = {"av": "a", "ar": "b", "dataset": "c"}
    assert load_rl_config(None, base).reward.reward_timeout_seconds == 600.0
    assert load_rl_config(None, {**base, "reward.reward_timeout_seconds": None}).reward.reward_timeout_seconds is None
    assert load_rl_config(None, {**base, "reward": {"reward_timeout_seconds": "1e3"}}).reward.reward_timeout_seconds \
        == 1000.0  # YAML 1.1 reads 1e3 as a string
    with pytest.raises(ValueError, match=r"RLConfig.reward.reward_timeout_seconds: expected a positive finite number "
                                         r"of seconds or null \(no timeout\), found 0"):
        load_rl_config(None, {**base, "reward.reward_timeout_seconds": 0})
    with pytest.raises(ConfigTypeError, match=r"RewardConfig.reward_timeout_seconds: expected a number or null"):
        load_rl_config(None, {**base, "reward.reward_timeout_seconds": "soon"})
    with pytest.raises(ValueError, match=r"key 'reward_timeout_seconds' belongs to section 'reward'"):
        load_rl_config(None, {**base, "reward_timeout_seconds": 60})


# Issue 48: duplicate YAML keys, non-finite numbers and seeds outside the RNGs' range.
@pytest.mark.parametrize(
    ("text", "key", "first", "again"),
    [("av: a\nloss:\n  kl_coef: 0.1\nsteps: 3\nloss:\n  eps_low: 0.2\n", "loss", 2, 5),  # a second section
     ("steps: 3\nav: a\nsteps: 4\n", "steps", 1, 3),
     ("loss:\n  kl_coef: 0.1\n  kl_coef: 0.2\n", "kl_coef", 2, 3)],  # nested
)
def test_a_repeated_yaml_key_is_refused_with_both_lines(tmp_path, capsys, text, key, first, again):
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(text)
    assert main(["rl", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        f"nla rl: error: {cfg}:{again}: the RLConfig config repeats the key {key!r} (first at line {first}, again at "
        f"line {again}); YAML would keep only the last one silently: delete or merge one of them\n")
    assert not (tmp_path / "run").exists()


def test_every_config_loader_refuses_repeated_keys(tmp_path):
    from nla.util.validation import InputError, load_yaml, safe_load_unique

    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 1\nprovider:\n  model: a\n  model: b\n")
    for load in (lambda: DatagenConfig.from_yaml(cfg), lambda: WorldConfig.from_yaml(cfg),
                 lambda: load_config(ARTrainConfig, cfg), lambda: load_yaml(cfg, "sidecar")):
        with pytest.raises(InputError, match=r"c.yaml:4: the .* repeats the key 'model' \(first at line 3, again at "
                                             r"line 4\)"):
            load()
    # a merge key may still be overridden by an explicit key: that is not a repetition
    assert safe_load_unique("base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  x: 3\n")["use"] == {"x": 3, "y": 2}
    with pytest.raises(ValueError, match=r"^--set 'loss=\{a: 1, a: 2\}': the key 'a' appears twice in one mapping "
                                         r"\(line 1 and line 1\); give each key once$"):
        load_rl_config(None, ["loss={a: 1, a: 2}"])


@pytest.mark.parametrize("raw", [".nan", ".inf", "-.inf", ".NaN"])
def test_non_finite_numbers_are_refused_in_every_config(tmp_path, capsys, raw):
    assert main(["rl", "--set", "av=a", "--set", "ar=b", "--set", "dataset=c", "--set", f"loss.kl_coef={raw}",
                 "--out", str(tmp_path / "run")]) == 2
    value = {".nan": "nan", ".NaN": "nan", ".inf": "inf", "-.inf": "-inf"}[raw]
    assert capsys.readouterr().err == (
        f"nla rl: error: LossConfig.kl_coef: expected a finite number (NaN and infinities are refused), found {value} "
        "(float); fix it in the YAML or with --set loss.kl_coef=... (loss.kl_coef: weight of the KL to the reference "
        "AV (the warm-started one), added to the policy loss, never to the reward; 0 = no KL term. Range: a number "
        ">= 0)\n")
    assert not (tmp_path / "run").exists()
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"dataset: d.parquet\nlr: {raw}\n")
    with pytest.raises(ConfigTypeError, match=r"^ARTrainConfig.lr: expected a finite number \(NaN and infinities "
                                              r"are refused\)"):
        load_config(ARTrainConfig, yaml_file)
    with pytest.raises(ConfigTypeError, match=r"^ProviderConfig.temperature: expected a finite number"):
        DatagenConfig.from_dict({"provider": {"temperature": float(value)}})
    with pytest.raises(ConfigTypeError, match=r"^Toy.pair: expected a list of 2 \(a number, a number\) \(item 1: a "
                                              r"finite number"):
        check_config_types(Toy, {"pair": [0.0, float(value)]})
    with pytest.raises(ConfigTypeError, match=r"^Toy.scale: expected a finite number"):  # a float | str field
        check_config_types(Toy, {"scale": float(value)})


def test_mappings_and_untyped_fields_are_searched_for_non_finite_numbers():
    @dataclass(frozen=True)
    class Loose:
        extra: dict = field(default_factory=dict)

    with pytest.raises(ConfigTypeError, match=r"^Loose.extra: expected finite numbers only \(NaN and infinities are "
                                              r"refused; at a.b\[1\]\), found"):
        check_config_types(Loose, {"extra": {"a": {"b": [1.0, float("nan")]}}})
    assert check_config_types(Loose, {"extra": {"a": [1.0, "nan"]}}) == {"extra": {"a": [1.0, "nan"]}}


@pytest.mark.parametrize("seed", [-1, 2**32, 10**23])
def test_a_seed_outside_the_rngs_range_names_the_field_before_anything_is_written(tmp_path, capsys, seed):
    out = tmp_path / "run"
    assert main(["rl", "--set", "av=a", "--set", "ar=b", "--set", "dataset=c", "--set", f"seed={seed}",
                 "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"nla rl: error: RLConfig.seed: expected an integer seed in 0..4294967295 (the range numpy's and torch's "
        f"seeds share), found {seed} (int); fix it in the YAML or with --set seed=... (seed: seeds every random "
        "draw of the run (data order, sampling, dropout, held-out split): the same seed and config give the same run "
        "on the same machine. Range: an integer in 0..2**32-1)\n")
    assert not out.exists()  # no rl.jsonl, nothing
    with pytest.raises(ConfigTypeError, match=rf"^DatagenConfig.world_seed: expected an integer seed in 0..4294967295 "
                                              rf".*found {seed}"):
        DatagenConfig.from_dict({"world_seed": seed})
    with pytest.raises(ConfigTypeError, match=r"^WorldConfig.seed: expected an integer seed"):
        WorldConfig.from_dict({"seed": seed})
    assert load_rl_config(None, {"av": "a", "ar": "b", "dataset": "c", "seed": 2**32 - 1}).seed == 2**32 - 1


@pytest.mark.parametrize("command", [["quickstart"], ["verbalize", "--av", "a", "--vectors", "v.npy"],
                                     ["eval", "--ar", "b", "--dataset", "d.parquet"]])
@pytest.mark.parametrize("seed", ["-1", "100000000000000000000000", "4294967296"])
def test_seed_flags_give_the_allowed_range(tmp_path, capsys, command, seed):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--seed", seed, "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"nla {command[0]}: error: argument --seed: expected an integer seed in 0..4294967295 (the range "
                   f"numpy's and torch's seeds share), found {int(seed)}; pick a seed in that range; see "
                   f"nla {command[0]} --help")
    assert not (tmp_path / "o").exists()


def test_paths_are_spelled_one_way_so_resume_compares_alike(tmp_path):
    from nla.train.config import normalise_paths
    from nla.train.rundir import _differences

    rl = [normalise_paths(load_rl_config(None, {"av": av, "ar": "runs//ar", "dataset": "d.parquet",
                                                "out_dir": "runs/rl/"})) for av in ("runs/av/", "./runs/av", "runs/av")]
    assert {(c.av, c.ar, c.out_dir) for c in rl} == {("runs/av", "runs/ar", "runs/rl")}
    assert rl[0].loss == rl[2].loss  # the sections survive the rebuild
    # runs/av does not exist here, so only the one spelling makes the resume comparison agree
    assert _differences(rl[0].to_dict(), rl[1].to_dict()) == []
    ar = normalise_paths(load_config(ARTrainConfig, None, {"dataset": "./data/ar.parquet",
                                                           "base_model": "Qwen/Qwen2.5-0.5B"}))
    assert (ar.dataset, ar.base_model) == ("data/ar.parquet", "Qwen/Qwen2.5-0.5B")  # a hub id is unchanged
