"""split (document-level, deterministic) and DatagenConfig validation."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from nla.datagen.config import DatagenConfig, ProviderConfig, parse_override
from nla.datagen.split import split_doc_ids, split_table


def test_split_counts_disjoint_deterministic():
    ids = np.arange(100, 110)  # 10 docs: round(0.4*10)=4, round(0.4*10)=4, rest 2
    a = split_doc_ids(ids, (0.4, 0.4, 0.2), seed=3)
    assert [len(a[k]) for k in ("av_sft", "ar_sft", "rl")] == [4, 4, 2]
    assert sorted(np.concatenate(list(a.values())).tolist()) == ids.tolist()
    b = split_doc_ids(ids[::-1], (0.4, 0.4, 0.2), seed=3)  # order of input does not matter
    assert all(np.array_equal(a[k], b[k]) for k in a)
    c = split_doc_ids(ids, (0.4, 0.4, 0.2), seed=4)
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_split_table_keeps_documents_whole():
    doc = np.repeat(np.arange(7), 3)
    t = pa.table({"doc_id": doc, "position": np.tile([1, 2, 3], 7)})
    parts = split_table(t, (0.5, 0.25, 0.25), seed=0)
    seen = [set(p.column("doc_id").to_pylist()) for p in parts.values()]
    assert sum(p.num_rows for p in parts.values()) == 21
    assert sum(len(s) for s in seen) == 7 and len(set().union(*seen)) == 7
    for p in parts.values():
        assert p.num_rows == 3 * len(set(p.column("doc_id").to_pylist()))


def test_config_errors_name_field():
    with pytest.raises(
        ValueError, match=r"DatagenConfig.positions_per_doc: expected an integer >= 1, found 0"
    ):
        DatagenConfig(positions_per_doc=0)
    with pytest.raises(ValueError, match=r"split_fractions: expected three numbers >= 0 .* summing to 1"):
        DatagenConfig(split_fractions=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"bad_vectors: expected one of \('error', 'drop'\)"):
        DatagenConfig(bad_vectors="ignore")
    with pytest.raises(
        ValueError, match=r"corpus_path: expected a .txt/.jsonl/.parquet path when source=file"
    ):
        DatagenConfig(source="file")
    with pytest.raises(ValueError, match=r"explainer: expected not 'world' unless source=world"):
        DatagenConfig(source="file", corpus_path="a.txt", model_dir="m", layer_index=0)
    with pytest.raises(ValueError, match=r"provider.max_retries: expected an integer >= 0"):
        ProviderConfig(max_retries=-1)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['n_doc'\]"):
        DatagenConfig.from_dict({"n_doc": 3})
    with pytest.raises(ValueError, match=r"provider: unknown key\(s\) \['modle'\]"):
        DatagenConfig.from_dict({"provider": {"modle": "x"}})
    with pytest.raises(
        ValueError, match=r"injection_scale: expected a positive number, 'sqrt_d_model' or null"
    ):
        DatagenConfig(injection_scale=-1.0)


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("n_docs: 5\nsplit_fractions: {av_sft: 0.5, ar_sft: 0.5, rl: 0.0}\nprovider: {model: a}\n")
    cfg = DatagenConfig.from_yaml(
        p, dict([parse_override("provider.max_retries=7"), parse_override("seed=3")])
    )
    assert (cfg.n_docs, cfg.seed, cfg.provider.model, cfg.provider.max_retries) == (5, 3, "a", 7)
    assert cfg.split_fractions == (0.5, 0.5, 0.0)
    assert DatagenConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="expected key=value"):
        parse_override("seed")


def test_an_api_key_given_as_api_key_env_is_refused_without_echoing_it(tmp_path, capsys):
    from nla.cli import main

    key = "sk-ant-api03-AbCdEf0123456789"
    cfg = tmp_path / "dg.yaml"
    cfg.write_text("source: world\nexplainer: anthropic\nprovider:\n  model: claude\n")
    out = tmp_path / "out"
    rc = main(["datagen", "run", "--config", str(cfg), "--out", str(out), "--set", f"provider.api_key_env={key}"])
    err = capsys.readouterr().err
    assert rc == 2 and "provider.api_key_env: expected the NAME of an environment variable" in err
    assert key not in err and "sk-ant" not in err
    assert not out.exists()  # nothing written, the key stored nowhere
    assert ProviderConfig(api_key_env="MY_KEY_1").api_key_env == "MY_KEY_1"
    with pytest.raises(ValueError, match="found a int value that is not one"):
        ProviderConfig(api_key_env=5)
