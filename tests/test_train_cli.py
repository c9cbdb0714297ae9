"""Smoke test of `nla train ar|av` with a tiny budget, including --resume and a bad --set."""

import numpy as np
import pytest
import yaml
from train_helpers import dataset_sidecar, write_ar_dataset, write_av_dataset

from nla.cli import main
from nla.util.metrics import read_metrics


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


def test_cli_ar_and_av_with_resume(capsys, tmp_path, tiny_tokenizer, tiny_model_dir):
    base = tiny_model_dir("llama")
    vec = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32)
    ar_ds = write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, base, 32, 1), vec)
    av_ds = write_av_dataset(tmp_path / "av.parquet", dataset_sidecar(tiny_tokenizer, base, 32, 1, 5.0), vec,
                             ["the cat is happy"] * 8)
    cfg = tmp_path / "ar.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": str(ar_ds), "max_steps": 4, "batch_size": 4, "warmup_steps": 1,
                                   "log_every": 1, "save_every": 2, "eval_fraction": 0.25, "tensorboard": False,
                                   "progress": False}))
    out = tmp_path / "ar_run"
    assert main(["train", "ar", "--config", str(cfg), "--out", str(out), "--set", "stop_after_steps=2"]) == 0
    assert main(["train", "ar", "--config", str(cfg), "--out", str(out), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out / "ar.jsonl")] == [1, 2, 3, 4]
    saved = yaml.safe_load((out / "checkpoints" / "step_00000004" / "train_config.yaml").read_text())
    assert saved["dataset"] == str(ar_ds) and saved["max_steps"] == 4
    assert main(["train", "ar", "--config", str(cfg), "--set", "lr=-1"]) == 2
    assert "'lr'" in capsys.readouterr().err
    assert main(["train", "av", "--dataset", str(av_ds), "--out", str(tmp_path / "av_run"), "--max-steps", "2",
                 "--set", "warmup_steps=1", "--set", "tensorboard=false", "--set", "smoke_num=1",
                 "--set", "eval_fraction=0.25", "--set", "batch_size=4"]) == 0
    assert (tmp_path / "av_run" / "checkpoints" / "step_00000002" / "nla_meta.yaml").is_file()
