"""Issue 58: one check of sampling settings (``nla.util.validation.check_sampling``) everywhere a
temperature or a top_p comes in: ``nla verbalize``, ``nla eval --suite``, RL's config, the client
(``nla explore`` and ``nla serve`` go through it too; their HTTP tests are in test_serve.py).

A temperature of 1e-40 divided the logits into +-inf: every token drawn was the suppressed marker,
every rollout failed, and the commands exited 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_serve import D, build_random_pair
from test_validation import assert_one_error_line, cli

from nla.client import NLAClient, NLAClientError
from nla.rl.config import RLConfig
from nla.util.validation import MAX_TEMPERATURE, MIN_TEMPERATURE, InputError, check_sampling


def test_the_range_and_its_messages():
    assert (MIN_TEMPERATURE, MAX_TEMPERATURE) == (1e-4, 100.0)
    assert check_sampling(1e-4) == (1e-4, 1.0)
    assert check_sampling(100, 0.5) == (100.0, 0.5)
    assert check_sampling(0, zero_is_greedy=True) == (0.0, 1.0)
    for bad in (1e-40, 1e-45, 0.0, -1.0, math.inf, math.nan, 100.5):
        with pytest.raises(InputError, match=r"^temperature: expected a finite number in \[0.0001, 100\], found"):
            check_sampling(bad)
    with pytest.raises(InputError, match=r"^x: expected 0 \(greedy\) or a finite number in \[0.0001, 100\], found "
                                         r"1e-40; below 0.0001 the logits"):
        check_sampling(1e-40, what="x", zero_is_greedy=True)
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(InputError, match=r"^top_p: expected a number in \(0, 1\] \(1 = off\), found"):
            check_sampling(1.0, bad)
    with pytest.raises(InputError, match="temperature: expected a number, found str '0.5'"):
        check_sampling("0.5")


@pytest.mark.parametrize("value", ["1e-40", "inf", "nan", "0", "-1"])
def test_cli_verbalize_and_eval_refuse_the_temperature_before_any_work(capsys, tmp_path, value):
    code, lines = cli(capsys, "verbalize", "--av", tmp_path / "no_av", "--vectors", tmp_path / "v.npy", "--sample",
                      "--temperature", value)
    assert code == 2
    assert any("argument --temperature: expected a finite number in [0.0001, 100]" in ln for ln in lines), lines
    code, lines = cli(capsys, "eval", "--av", tmp_path / "a", "--ar", tmp_path / "b", "--dataset", tmp_path / "d",
                      "--suite", "best_of", "--temperature", value)
    assert code == 2
    assert any("argument --temperature: expected a finite number in [0.0001, 100]" in ln for ln in lines), lines


def test_rl_config_refuses_a_temperature_that_samples_garbage(tmp_path):
    base = dict(av=str(tmp_path), ar=str(tmp_path), dataset=str(tmp_path / "r.parquet"), out_dir=str(tmp_path / "o"))
    for value in (1e-45, 0.0, 101.0):
        with pytest.raises(ValueError, match=r"rollout.temperature: expected a finite number in \[0.0001, 100\]"):
            RLConfig.from_dict({**base, "rollout": {"temperature": value}})
    with pytest.raises(ValueError, match=r"RolloutConfig.temperature: expected a finite number .*found inf"):
        RLConfig.from_dict({**base, "rollout": {"temperature": math.inf}})
    with pytest.raises(ValueError, match=r"rollout.top_p: expected a number in \(0, 1\]"):
        RLConfig.from_dict({**base, "rollout": {"top_p": 0}})
    assert RLConfig.from_dict({**base, "rollout": {"temperature": 1e-4}}).rollout.temperature == 1e-4


def test_rl_cli_refuses_the_temperature(capsys, tmp_path):
    code, lines = cli(capsys, "rl", "--av", tmp_path, "--ar", tmp_path, "--dataset", tmp_path / "r.parquet",
                      "--out", tmp_path / "o", "--set", "rollout.temperature=1e-45")
    assert code == 2
    assert_one_error_line(lines, "rl", "rollout.temperature", "[0.0001, 100]", "1e-45")
    assert not (tmp_path / "o" / "rl.jsonl").exists()


def test_client_verbalize_refuses_and_samples_at_the_floor(tmp_path):
    av, ar = build_random_pair(tmp_path)
    client = NLAClient(av, ar, device="cpu")
    v = torch.randn(2, D, generator=torch.Generator().manual_seed(0)) * 3
    for kw in (dict(greedy=False, temperature=1e-40), dict(greedy=True, best_of=2, temperature=math.inf)):
        with pytest.raises(NLAClientError, match=r"temperature: expected a finite number in \[0.0001, 100\]"):
            client.verbalize(v, max_new_tokens=4, **kw)
    # at the floor sampling is greedy in effect: the same tokens as greedy decoding
    greedy = [x.text for x in client.verbalize(v, max_new_tokens=8)]
    floor = [x.text for x in client.verbalize(v, max_new_tokens=8, greedy=False, temperature=1e-4, seed=1)]
    assert floor == greedy
