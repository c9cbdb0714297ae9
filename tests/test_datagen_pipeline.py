"""End to end on a tiny model + text file: CLI, resume, summary, built parquets and sidecars."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import yaml

from nla.cli import main
from nla.core.templates import AV_PLACEHOLDER, DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE
from nla.datagen.build import load_dataset
from nla.datagen.config import DatagenConfig
from nla.datagen.io import DatagenError, read_parquet, read_vectors
from nla.datagen.pipeline import run

TEXT = "\n\n".join(
    f"{name} walks to the {place} in the {time} and {pron} is {mood} . the {animal} sings in the tree ."
    for name, pron in (("Alice", "she"), ("Bob", "he"), ("Carol", "she"), ("Dave", "he"), ("Eve", "she"))
    for place in ("market", "river", "school")
    for time, mood, animal in (("morning", "happy", "bird"), ("evening", "calm", "dog"))
)  # 30 documents


@pytest.fixture
def cfg_file(tmp_path, tiny_model_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    data = dict(
        out_dir=str(tmp_path / "out"), source="file", corpus_path=str(corpus), model_dir=str(tiny_model_dir("llama")),
        layer_index=1, positions_per_doc=3, skip_first=2, batch_size=4, max_len=64, batches_per_shard=2,
        explainer="context", split_fractions={"av_sft": 0.4, "ar_sft": 0.4, "rl": 0.2},
    )  # fmt: skip
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_run_all_then_resume(cfg_file, tmp_path, caplog):
    out = tmp_path / "out"
    assert main(["datagen", "run", "--config", str(cfg_file)]) == 0
    summary = json.loads((out / "datagen_summary.json").read_text())
    # 30 docs x 3 positions, nothing dropped; 12/12/6 docs by fraction
    assert summary["extract"]["rows"] == 90 and summary["extract"]["dropped"] == {}
    assert {k: v["docs"] for k, v in summary["split"].items()} == {"av_sft": 12, "ar_sft": 12, "rl": 6}
    assert summary["explain"]["av_sft"] == {"rows_in": 36, "rows": 36, "dropped": {}}

    av, cfg = load_dataset(out / "av_sft.parquet")
    assert cfg.kind == "nla_dataset" and cfg.d_model == 32 and cfg.layer_index == 1
    assert av.column("prompt")[0].as_py() == [
        {"role": "user", "content": DEFAULT_AV_TEMPLATE.format(injection_char=AV_PLACEHOLDER)}
    ]
    row = av.slice(0, 1).to_pylist()[0]
    assert row["response"] == f"<explanation>\n{row['explanation']}\n</explanation>"
    ar, _ = load_dataset(out / "ar_sft.parquet")
    r = ar.slice(0, 1).to_pylist()[0]
    assert r["prompt"] == DEFAULT_AR_TEMPLATE.format(explanation=r["explanation"])
    rl, _ = load_dataset(out / "rl.parquet")
    assert "explanation" not in rl.column_names and rl.num_rows == 18
    # no document in two splits
    docs = [set(t.column("doc_id").to_pylist()) for t in (av, ar, rl)]
    assert not (docs[0] & docs[1]) and not (docs[0] & docs[2]) and not (docs[1] & docs[2])
    # shuffled baseline: same multiset of vectors, different pairing
    sh, _ = load_dataset(out / "av_sft.shuffled.parquet")
    a, b = read_vectors(av), read_vectors(sh)
    assert not np.array_equal(a, b)
    assert np.array_equal(a[np.lexsort(a.T)], b[np.lexsort(b.T)])
    assert sh.drop_columns(["activation_vector"]).equals(av.drop_columns(["activation_vector"]))
    # resolved config written next to the outputs
    assert DatagenConfig.from_yaml(out / "datagen_config.yaml").layer_index == 1

    mtime = (out / "av_sft.parquet").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level("INFO"):
        assert main(["datagen", "run", "--config", str(cfg_file)]) == 0
    assert (out / "av_sft.parquet").stat().st_mtime_ns == mtime
    assert sum("already done" in m for m in caplog.messages) == 4

    # a changed build setting redoes build only
    caplog.clear()
    with caplog.at_level("INFO"):
        main(["datagen", "run", "--config", str(cfg_file), "--set", "injection_scale=2.5"])
    assert sum("already done" in m for m in caplog.messages) == 3
    assert load_dataset(out / "av_sft.parquet")[1].injection_scale == 2.5


def test_no_progress_hides_the_extraction_bar_and_changes_nothing_computed(cfg_file, tmp_path, capsys, caplog):
    """`--no-progress` (progress: false) hid nothing: the extraction's bar filled the quickstart's logs."""
    out = tmp_path / "out"
    assert main(["datagen", "extract", "--config", str(cfg_file), "--no-progress"]) == 0
    assert "extract:" not in capsys.readouterr().err
    assert DatagenConfig.from_yaml(out / "datagen_config.yaml").progress is False
    first = read_vectors(out / "activations.parquet")
    # the bar is on by default, and the setting is not part of what the stage computed: done, not redone
    with caplog.at_level("INFO"):
        assert main(["datagen", "extract", "--config", str(cfg_file)]) == 0
    assert sum("already done" in m for m in caplog.messages) == 1
    assert main(["datagen", "extract", "--config", str(cfg_file), "--force"]) == 0
    assert "extract: 100%" in capsys.readouterr().err
    assert np.array_equal(read_vectors(out / "activations.parquet"), first)


def test_single_steps_and_missing_upstream(cfg_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["datagen", "split", "--config", str(cfg_file)]) == 2
    assert "activations.parquet: parquet file not found; run the stage" in capsys.readouterr().err
    assert main(["datagen", "extract", "--config", str(cfg_file)]) == 0
    assert (out / "activations.parquet").exists() and not (out / "splits").exists()
    assert main(["datagen", "split", "--config", str(cfg_file)]) == 0
    assert sorted(p.name for p in (out / "splits").iterdir()) == [
        "ar_sft.parquet",
        "av_sft.parquet",
        "rl.parquet",
    ]


def test_corrupted_parquet_named(cfg_file, tmp_path):
    out = tmp_path / "out"
    cfg = DatagenConfig.from_yaml(cfg_file)
    run(cfg, stages=["extract", "split"])
    (out / "splits" / "av_sft.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(
        DatagenError, match=r"av_sft.parquet: not a readable parquet file.*delete it and rerun"
    ):
        run(cfg, stages=["explain"])
    assert not (out / ".done" / "explain.json").exists() and not (out / "explained").exists()


def test_build_refuses_model_with_other_width(cfg_file, tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = DatagenConfig.from_yaml(cfg_file)
    run(cfg)
    with pytest.raises(
        DatagenError, match=r"sidecar d_model=32 but model .* has hidden size 64 \(d_model mismatch\)"
    ):
        load_dataset(out / "av_sft.parquet", model_dir=tiny_model_dir("gemma3"))
    # the gemma3 fixture shares the tokenizer but has d=64: rebuilding with it must refuse
    with pytest.raises(
        DatagenError, match=r"av_sft: activation vectors have d=32 but the model's hidden size is 64"
    ):
        run(cfg.replace(model_dir=str(tiny_model_dir("gemma3"))), stages=["build"])
    assert not (out / "av_sft.parquet").exists()  # stale outputs removed, nothing half-built left
    assert not (out / ".done" / "build.json").exists()


def test_missing_sidecar(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"activation_vector": pa.array([[1.0, 2.0]], pa.list_(pa.float32()))}),
        tmp_path / "x.parquet",
    )
    with pytest.raises(DatagenError, match=r"x.parquet: sidecar x.parquet.nla_meta.yaml is missing"):
        load_dataset(tmp_path / "x.parquet")


def test_read_back_columns(cfg_file, tmp_path):
    out = tmp_path / "out"
    run(DatagenConfig.from_yaml(cfg_file))
    t = read_parquet(out / "av_sft.parquet")
    for c in ("activation_vector", "doc_id", "position", "activation_layer", "n_raw_tokens", "context", "prompt",
              "response", "explanation"):  # fmt: skip
        assert c in t.column_names, c
    assert t.schema.field("activation_vector").type == pa.list_(pa.float32())


def test_max_len_past_the_subjects_positions_is_refused_before_extract(cfg_file, tmp_path, capsys):
    """max_len 1000 on a 128-position subject extracted rows at positions 128-923 (issue 58)."""
    code = main(["datagen", "run", "--config", str(cfg_file), "--set", "max_len=1000"])
    err = capsys.readouterr().err
    assert code == 2
    assert ("max_len: 1000 tokens per document, but the subject model" in err
            and "has 128 positions (max_position_embeddings in its config.json)" in err
            and "Set max_len <= 128 (--set max_len=128)" in err), err
    assert not (tmp_path / "out" / "activations.parquet").exists()
    assert main(["datagen", "extract", "--config", str(cfg_file), "--set", "max_len=128"]) == 0
    assert (tmp_path / "out" / "activations.parquet").is_file()


def test_max_len_is_checked_against_a_named_model_dir_before_a_world_is_built(cfg_file, tmp_path, capsys,
                                                                             monkeypatch):
    """A world-source config naming its model dir (as every saved datagen_config.yaml does) built the
    world first, minutes on an empty cache, and refused max_len only then (issue 58's re-probe)."""
    import nla.world

    data = yaml.safe_load(cfg_file.read_text())
    data.update(source="world", world_preset="tiny", corpus_path=None, explainer="world")
    cfg = tmp_path / "world_cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))

    def no_build(*a, **k):
        raise AssertionError("the world was built before max_len was checked")

    monkeypatch.setattr(nla.world, "build_world", no_build)
    code = main(["datagen", "run", "--config", str(cfg), "--set", "max_len=1000"])
    err = capsys.readouterr().err
    assert code == 2 and "max_len: 1000 tokens per document, but the subject model" in err, err
    assert not (tmp_path / "out" / "activations.parquet").exists()


def test_a_malformed_summary_is_refused_naming_it_before_any_work(cfg_file, tmp_path, capsys, monkeypatch):
    """A datagen_summary.json cut short was a bare JSONDecodeError, after the world was built (issue 58)."""
    import nla.world

    monkeypatch.setattr(nla.world, "build_world", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built")))
    data = yaml.safe_load(cfg_file.read_text())
    data.update(source="world", world_preset="tiny", corpus_path=None, explainer="world")
    cfg = tmp_path / "world_cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "datagen_summary.json").write_text('{"extract": ')
    code = main(["datagen", "run", "--config", str(cfg)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert (f"{tmp_path / 'out' / 'datagen_summary.json'}:1:13: the datagen summary is not valid JSON (Expecting value); "
            "delete it (datagen writes it again)") in err
    # nothing else written (the run lock aside)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".nla.lock", "datagen_summary.json"]
