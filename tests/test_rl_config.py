"""RLConfig validation: every refusal names the field, the expected value and the found one."""

import pytest

from nla.rl.config import RLConfig
from nla.rl.workers import PolicyLossSettings

PATHS = dict(av="av_dir", ar="ar_dir", dataset="rl.parquet")


def test_dynamic_sampling_needs_groups_of_two_or_more():
    # A group of one sample has zero reward spread, so dynamic sampling would drop every
    # group and never update: refused up front, for any estimator.
    with pytest.raises(ValueError, match=r"n_samples_per_prompt: expected >= 2 with dynamic_sampling: true.*found 1"):
        RLConfig(**PATHS, advantage="reinforce_baseline", n_samples_per_prompt=1, dynamic_sampling=True)
    RLConfig(**PATHS, advantage="reinforce_baseline", n_samples_per_prompt=1)  # without it: fine
    RLConfig(**PATHS, n_samples_per_prompt=2, dynamic_sampling=True)


def test_drgrpo_normaliser_is_the_generation_cap():
    cfg = RLConfig(**PATHS, loss_agg="seq-mean-token-sum-norm", max_response_len=37)
    assert PolicyLossSettings.from_config(cfg).norm_len == 37
