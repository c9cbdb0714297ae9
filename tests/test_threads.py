"""Thread control: the resolution rules of ``nla.util.threads`` and the stages that apply them."""

import numpy as np
import pytest
import torch
from train_helpers import dataset_sidecar, write_ar_dataset

from nla.util.threads import ENV_VAR, apply_threads, resolve_threads


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
    assert resolve_threads(None, env={ENV_VAR: ""}, cores=16) == 16


def test_default_is_fixed_by_the_machine_every_core_for_one_process():
    # one process: every core; several workers of one job: cores // 2 // processes, never below 1
    assert resolve_threads(None, env={}, cores=2) == 2
    assert resolve_threads(None, env={}, cores=1) == 1
    assert resolve_threads(None, env={}, cores=16) == 16
    assert resolve_threads(None, env={}, cores=16, processes=3) == 2  # 8 // 3
    assert resolve_threads(None, env={}, cores=16, processes=20) == 1
    # processes divide only the default: an explicit or environment value is per process
    assert resolve_threads(4, env={}, cores=16, processes=4) == 4
    assert resolve_threads(None, env={ENV_VAR: "4"}, cores=16, processes=4) == 4
    # "auto" starts the governor at half the cores (it wins over the environment, being explicit)
    assert resolve_threads("auto", env={ENV_VAR: "4"}, cores=16) == 8
    assert resolve_threads("auto", env={}, cores=2) == 1


def test_threads_flag_parses_integers_and_auto():
    import argparse

    from nla.util.threads import threads_flag

    assert threads_flag("3") == 3 and threads_flag("auto") == "auto" and threads_flag(" AUTO ") == "auto"
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer or 'auto'"):
            threads_flag(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", "Auto"])
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


def test_configs_accept_auto():
    from nla.datagen.config import DatagenConfig
    from nla.rl.config import RLConfig
    from nla.train.config import ARTrainConfig

    assert ARTrainConfig(dataset="x.parquet", out_dir="o", threads="auto").threads == "auto"
    assert RLConfig(av="a", ar="b", dataset="d", out_dir="o", threads="auto").threads == "auto"
    assert DatagenConfig(threads="auto").threads == "auto"


@pytest.mark.parametrize("bad", [0, -3, True, "two"])
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


class FakeMachine:
    """A clock and a /proc/stat reader the test drives: ``run(seconds, others, ours)`` advances
    time by ``seconds`` while other processes keep ``others`` cores busy and we use ``ours``."""

    def __init__(self):
        self.t, self.busy, self.own = 100.0, 5000.0, 10.0

    def run(self, seconds, others, ours):
        self.t += seconds
        self.busy += seconds * (others + ours)
        self.own += seconds * ours

    def clock(self):
        return self.t

    def reader(self):
        return self.busy, self.own


@pytest.mark.parametrize("others, cores, expected", [
    (0.0, 2, 2), (0.2, 2, 2),  # noise: keep every core
    (0.5, 2, 1), (1.0, 2, 1), (1.9, 2, 1), (3.0, 2, 1),  # never below 1
    (0.0, 16, 16), (4.0, 16, 12), (4.6, 16, 11), (4.7, 16, 11), (4.75, 16, 11),
])
def test_threads_for_idle_cores(others, cores, expected):
    # int(cores - others + 0.3): a core at least 70 % idle counts as free
    from nla.util.threads import threads_for_idle_cores

    assert threads_for_idle_cores(others, cores) == expected


def test_governor_follows_the_idle_cores(restore_threads):
    from nla.util.threads import ThreadGovernor

    m = FakeMachine()
    g = ThreadGovernor(cores=2, interval=2.0, reader=m.reader, clock=m.clock)
    assert g.threads == 1  # starts at half the cores
    m.run(1.0, others=0.0, ours=1.0)
    assert g.tick() == 1 and g.decisions == []  # interval not over: no re-read
    m.run(1.5, others=0.0, ours=1.0)  # 2.5 s since start, idle machine
    assert g.tick() == 2 and torch.get_num_threads() == 2
    assert g.decisions == [(pytest.approx(0.0), 2)]
    m.run(2.0, others=1.0, ours=1.0)  # another job takes a core; our 2 threads get 1 core between them
    assert g.tick() == 1 and torch.get_num_threads() == 1
    assert g.decisions[-1] == (pytest.approx(1.0), 1)
    m.run(2.0, others=0.9, ours=1.0)
    assert g.tick() == 1
    m.run(2.0, others=0.0, ours=1.0)  # the other job ended
    assert g.tick() == 2 and torch.get_num_threads() == 2


def test_governor_without_proc_stat_keeps_half_the_cores(restore_threads):
    from nla.util.threads import ThreadGovernor

    t = [0.0]
    g = ThreadGovernor(cores=8, interval=1.0, reader=lambda: None, clock=lambda: t[0])
    t[0] = 5.0
    assert g.tick() == 4 and g.decisions == []


def test_governor_adjusts_only_from_its_own_thread(restore_threads):
    import threading

    from nla.util.threads import ThreadGovernor

    m = FakeMachine()
    g = ThreadGovernor(cores=2, interval=1.0, reader=m.reader, clock=m.clock)
    m.run(3.0, others=0.0, ours=1.0)
    out = []
    th = threading.Thread(target=lambda: out.append(g.tick()))
    th.start()
    th.join()
    assert out == [1] and g.decisions == []  # a helper thread reads, never re-decides
    assert g.tick() == 2


def test_apply_threads_adapts_only_when_auto_is_asked_for(restore_threads, monkeypatch, caplog):
    from nla.util import threads as T

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(T, "_governor", None)
    # the default: every core, fixed for the run (no governor, adapt_threads changes nothing)
    assert T.apply_threads(None) == T.available_cores() and T._governor is None
    assert T.adapt_threads() == T.available_cores()
    with caplog.at_level("WARNING", logger="nla.util.threads"):
        n = T.apply_threads("auto")
    assert T._governor is not None and n == T._governor.threads == max(1, T.available_cores() // 2)
    assert "not reproducible" in caplog.text
    gov = T._governor
    T.apply_threads("auto")
    assert T._governor is gov  # kept across stages
    assert T.apply_threads(3) == 3 and T._governor is None  # an explicit setting is fixed
    assert T.adapt_threads() == 3 and torch.get_num_threads() == 3  # and adapt_threads leaves it
    monkeypatch.setenv(ENV_VAR, "2")
    assert T.apply_threads(None) == 2 and T._governor is None
    monkeypatch.delenv(ENV_VAR)
    assert T.apply_threads("auto", processes=2) == resolve_threads("auto", processes=2, env={})
    assert T._governor is None  # several workers of one job: a fixed share, even when auto


@pytest.mark.skipif(not __import__("os").path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_governor_sees_a_real_busy_process(restore_threads):
    """A real competing process that spins on one core: the governor leaves that core to it."""
    import time

    from conftest import busy_process

    from nla.util.threads import ThreadGovernor, available_cores, read_cpu_seconds

    busy0, own0 = read_cpu_seconds()
    assert busy0 > 0 and own0 > 0
    cores = available_cores()
    g = ThreadGovernor(interval=1.0)
    with busy_process(nice=None):
        time.sleep(1.2)
        n = g.tick()
    assert len(g.decisions) == 1
    others, decided = g.decisions[0]
    assert others >= 0.7  # the spinning process alone keeps about one core busy
    assert n == decided <= max(1, cores - 1)
