"""Thread control: the resolution rules of ``nla.threads`` and the stages that apply them."""

import numpy as np
import pytest
import torch
from train_helpers import dataset_sidecar, write_ar_dataset

from nla.threads import ENV_VAR, apply_threads, resolve_threads


@pytest.fixture()
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_explicit_setting_wins_over_the_environment():
    assert resolve_threads(3, env={ENV_VAR: "5"}, cores=16) == 3


def test_environment_wins_over_the_default():
    assert resolve_threads(None, env={ENV_VAR: "5"}, cores=16) == 5
    assert resolve_threads(None, env={ENV_VAR: " 2 "}, cores=16) == 2
    # an empty variable is unset
    assert resolve_threads(None, env={ENV_VAR: ""}, cores=16) == 8


def test_default_is_half_the_cores_shared_among_processes():
    # cores // 2 // processes, never below 1
    assert resolve_threads(None, env={}, cores=2) == 1
    assert resolve_threads(None, env={}, cores=1) == 1
    assert resolve_threads(None, env={}, cores=16) == 8
    assert resolve_threads(None, env={}, cores=16, processes=3) == 2  # 8 // 3
    assert resolve_threads(None, env={}, cores=16, processes=20) == 1
    # processes divide only the default: an explicit or environment value is per process
    assert resolve_threads(4, env={}, cores=16, processes=4) == 4
    assert resolve_threads(None, env={ENV_VAR: "4"}, cores=16, processes=4) == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_explicit_setting_is_named(bad):
    with pytest.raises(ValueError, match="threads: expected a positive integer"):
        resolve_threads(bad, env={})


@pytest.mark.parametrize("bad", ["0", "-2", "many"])
def test_bad_environment_value_is_named(bad):
    with pytest.raises(ValueError, match=f"{ENV_VAR}: expected a positive integer, found '{bad}'"):
        resolve_threads(None, env={ENV_VAR: bad})


def test_apply_sets_torch(restore_threads, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "3")
    assert apply_threads(None) == 3 and torch.get_num_threads() == 3
    assert apply_threads(2) == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -3, True])
def test_configs_refuse_bad_threads(bad):
    from nla.datagen.config import DatagenConfig
    from nla.rl.config import RLConfig
    from nla.train.config import ARTrainConfig

    with pytest.raises(ValueError, match="threads"):
        ARTrainConfig(dataset="x.parquet", out_dir="o", threads=bad)
    with pytest.raises(ValueError, match="threads"):
        RLConfig(av="a", ar="b", dataset="d", out_dir="o", threads=bad)
    with pytest.raises(ValueError, match="threads"):
        DatagenConfig(threads=bad)


def test_train_stage_sets_threads(restore_threads, tmp_path, tiny_model_dir, tiny_tokenizer):
    from nla.train.ar import train_ar
    from nla.train.config import ARTrainConfig

    base = tiny_model_dir("llama")
    side = dataset_sidecar(tiny_tokenizer, base, d_model=32, layer_index=1)
    vec = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32)
    ds = write_ar_dataset(tmp_path / "ar_sft.parquet", side, vec)
    torch.set_num_threads(1)
    train_ar(ARTrainConfig(dataset=str(ds), out_dir=str(tmp_path / "run"), max_steps=1, batch_size=8,
                           warmup_steps=0, eval_fraction=0.0, tensorboard=False, progress=False, threads=3))
    assert torch.get_num_threads() == 3


def test_datagen_sets_threads_before_any_work(restore_threads, monkeypatch):
    from nla.datagen import pipeline
    from nla.datagen.config import DatagenConfig

    class Stop(Exception):
        pass

    def stop(cfg):
        raise Stop

    monkeypatch.setattr(pipeline, "resolve", stop)
    torch.set_num_threads(1)
    with pytest.raises(Stop):
        pipeline.run(DatagenConfig(threads=2))
    assert torch.get_num_threads() == 2


def test_ray_actor_threads_share_the_default():
    pytest.importorskip("ray")
    from nla.rl.config import RLConfig
    from nla.rl.ray_backend import actor_threads

    cfg = RLConfig(av="a", ar="b", dataset="d", out_dir="o", threads=2)
    assert actor_threads(cfg) == 2
    cfg = RLConfig.from_dict(dict(av="a", ar="b", dataset="d", out_dir="o",
                                  backend=dict(num_policy_workers=2, num_reconstructor_workers=2)))
    assert actor_threads(cfg) == resolve_threads(None, processes=4)


def test_cli_flags_reach_the_configs():
    from nla.cli import build_parser

    parser = build_parser()
    for argv in (["rl", "--threads", "2"], ["train", "ar", "--threads", "2"],
                 ["datagen", "run", "--config", "x.yaml", "--threads", "2"], ["quickstart", "--threads", "2"]):
        assert parser.parse_args(argv).threads == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["rl", "--threads", "0"])
