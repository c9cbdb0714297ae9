"""Datagen on the real world (tiny preset): builds the world subject model, so marked slow."""

from __future__ import annotations

import json

import pytest

from nla.datagen.build import load_dataset
from nla.datagen.config import DatagenConfig
from nla.datagen.pipeline import run
from nla.world import Fact, build_world, grade


@pytest.mark.slow
def test_world_tiny_end_to_end(tmp_path):
    cfg = DatagenConfig.from_yaml(
        "configs/datagen/world_tiny.yaml", {"out_dir": str(tmp_path / "out"), "n_docs": 60}
    )
    summary = run(cfg)
    arts = build_world("tiny")  # cached by the run above
    resolved = DatagenConfig.from_yaml(tmp_path / "out" / "datagen_config.yaml")
    assert resolved.layer_index == arts.config.default_layer
    assert resolved.model_dir == str(arts.subject_dir)
    assert summary["extract"]["rows"] == 60 * 4  # every tiny-world story is longer than skip_first + 4 tokens
    av, meta = load_dataset(tmp_path / "out" / "av_sft.parquet", model_dir=arts.subject_dir)
    assert meta.d_model == arts.config.d_model and meta.injection_char == "㈎"
    # world explanations name revealed facts: mean recall well above zero
    rows = av.drop_columns(["activation_vector"]).to_pylist()
    recalls = [
        grade(r["explanation"], [Fact.parse(s) for s in r["facts"]]).recall for r in rows if r["facts"]
    ]
    assert recalls and sum(recalls) / len(recalls) > 0.3
    saved = json.loads((tmp_path / "out" / "datagen_summary.json").read_text())
    assert saved["build"]["files"] == summary["build"]["files"]
