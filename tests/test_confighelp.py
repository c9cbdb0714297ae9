"""Every config field carries its help, `nla config describe` lists every field of every section with
it, and the errors that name a field quote it (nla.util.confighelp, nla.commands.config)."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from nla.cli import main
from nla.commands.config import CONFIGS, config_class
from nla.util.confighelp import describe, field_help, option, with_help


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """A plain walk of the dataclass: (dotted name, field) of every field that is not a section, the
    top-level ones first, then each section's (the YAML layout)."""
    out, later = [], []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            assert f.metadata.get("help", "").strip(), f"{cls.__name__}.{f.name}: a section without help"
            later += leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f))
    return out + later


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_field_of_every_config_has_its_help(name):
    # A field added without help fails here: declare it with nla.util.confighelp.option(default, help=...).
    cls = config_class(name)
    missing = [n for n, f in leaf_fields(cls) if len(f.metadata.get("help", "").strip()) < 10]
    assert not missing, f"{cls.__name__}: fields without help: {missing}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_describe_lists_every_field_once_top_level_then_each_section(name, capsys):
    assert main(["config", "describe", name]) == 0
    out = capsys.readouterr().out
    shown = re.findall(r"^(\S+) \(.*, default .*\)$", out, flags=re.M)
    assert shown == [n for n, _ in leaf_fields(config_class(name))]


def test_describe_shows_type_default_and_help_of_a_section(capsys):
    assert main(["config", "describe", "rl", "loss"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "RLConfig (nla rl --config FILE --set SECTION.KEY=VALUE)"
    assert lines[2] == "[loss] advantages and the policy loss (nla.rl.algorithms)."
    i = lines.index("loss.eps_high (float, default 0.2)")
    assert lines[i + 1:i + 3] == [
        "    upper clip of the policy ratio: the surrogate clips it at 1 + eps_high; eps_high > eps_low is",
        "    DAPO's clip-higher. Range: a number >= 0.",
    ]
    assert "loss.dual_clip_c (float | None, default null)" in lines
    assert all(not ln.startswith(("reward.", "rollout.", "steps")) for ln in lines)  # only the section


def test_describe_one_field_and_an_unknown_name(capsys):
    assert main(["config", "describe", "rl", "reward.overlong_buffer_len"]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "reward.overlong_buffer_len (int, default 0)",
        "    DAPO's soft overlong punishment: a response longer than rollout.max_response_len - this many",
        "    tokens loses up to overlong_penalty_factor, linearly up to the cap; 0 = off. Range: an integer",
        "    in [0, rollout.max_response_len).",
    ]
    assert main(["config", "describe", "datagen", "provider"]) == 0
    assert "provider.api_key_env (str | None, default null)" in capsys.readouterr().out
    assert main(["config", "describe", "rl", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nla config: error: RLConfig: no section or field 'nope'; sections: ['rollout', 'loss', ")


def test_errors_that_name_a_field_quote_its_help():
    from nla.datagen.config import DatagenConfig
    from nla.rl.config import RLConfig
    from nla.train.config import AVTrainConfig
    from nla.world.build import WorldConfig

    base = {"av": "a", "ar": "b", "dataset": "c"}
    with pytest.raises(ValueError, match=re.escape(
            "RLConfig.reward.overlong_buffer_len: expected an integer in [0, rollout.max_response_len=150), found 150 "
            "(reward.overlong_buffer_len: DAPO's soft overlong punishment:")):
        RLConfig.from_dict({**base, "reward": {"overlong_buffer_len": 150}})
    # a check of two fields quotes both
    with pytest.raises(ValueError, match=re.escape("(loss.eps_low: lower clip of the policy ratio: the surrogate clips "
                                                   "it at 1 - eps_low. Range: [0, 1); loss.eps_high: upper clip")):
        RLConfig.from_dict({**base, "loss": {"eps_low": 1.5}})
    with pytest.raises(ValueError, match=re.escape("--set smoke_num=... (smoke_num: held-out vectors decoded greedily")):
        AVTrainConfig(dataset="d.parquet", smoke_num=-1)
    with pytest.raises(ValueError, match=re.escape("(lora.r: LoRA rank: the adapters' inner width; 0 = off")):
        AVTrainConfig(dataset="d.parquet", lora={"r": -2})
    with pytest.raises(ValueError, match=re.escape("provider.max_concurrency: expected an integer >= 1, found 0 "
                                                   "(provider.max_concurrency: requests in flight at once.")):
        DatagenConfig.from_dict({"provider": {"max_concurrency": 0}})
    with pytest.raises(ValueError, match=re.escape("(n_layers: the subject's decoder blocks. Range: an integer >= 3")):
        WorldConfig(n_layers=2)


@dataclasses.dataclass(frozen=True)
class Inner:
    k: int = option(1, help="k's meaning. Range: >= 1.")


@dataclasses.dataclass(frozen=True)
class Outer:
    a: float = option(0.5, help="a's meaning.")
    inner: Inner = option(default_factory=Inner, help="the inner section.")


def test_the_help_helpers():
    assert field_help(Outer, "inner.k") == "k's meaning. Range: >= 1." and field_help(Outer, "inner.x") is None
    assert with_help("bad", Outer, "a") == "bad (a: a's meaning)"
    assert with_help("bad", Outer, "inner.k", label="x.k") == "bad (x.k: k's meaning. Range: >= 1)"
    assert with_help("bad", Outer, "a/nope") == "bad (a: a's meaning)" and with_help("bad", Outer, "zz") == "bad"
    assert describe(Outer) == ("Outer\n\na (float, default 0.5)\n    a's meaning.\n\n[inner] the inner section.\n"
                               "inner.k (int, default 1)\n    k's meaning. Range: >= 1.\n")
    with pytest.raises(ValueError, match="every config field needs its help"):
        option(1, help=" ")
