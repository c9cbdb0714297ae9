"""An AV, an AR and a dataset of different subjects are refused where they meet, with an override.

The pair is test_client's tiny pair; "another subject" is the same files with another recorded
subject, layer or tokenizer (marker id), the way a second model's checkpoints would differ.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_client import NLAClient, nla_pair  # noqa: F401 - nla_pair is a fixture

from nla.cli import main
from nla.core.provenance import Provenance, ProvenanceError, check_provenance, same_subject
from nla.core.sidecar import load_sidecar, write_sidecar
from nla.datagen.io import vectors_to_arrow


def test_every_recorded_field_is_compared_and_unrecorded_ones_are_not(caplog):
    av = Provenance("the AV", subject="org/subject-a", layer=2, marker=("㈎", 100))
    ds = Provenance("the dataset", subject="org/subject-b", layer=3, marker=("㈎", 101))
    with pytest.raises(ProvenanceError) as err:
        check_provenance([ds, av], context="eval")
    msg = str(err.value)
    assert msg.startswith("eval: these come from different subjects: subject model: the dataset has "
                          "'org/subject-b', the AV has 'org/subject-a'; layer: the dataset has 3, the AV has 2; "
                          "tokenizer (the marker's token id): the dataset has '㈎' = id 101, the AV has '㈎' = id 100")
    assert "--allow-mixed-provenance" in msg
    with caplog.at_level(logging.WARNING, logger="nla.core.provenance"):
        assert len(check_provenance([ds, av], allow=True)) == 3
    assert "allowed by --allow-mixed-provenance" in caplog.text
    # a published AV sidecar records no layer, a dataset may record no subject: nothing to compare
    assert check_provenance([Provenance("the AV", layer=None), Provenance("the AR", layer=2),
                             Provenance("the dataset", subject=None)]) == []


def test_same_subject_by_name_path_or_copy(tmp_path):
    a = tmp_path / "subject"
    a.mkdir()
    (a / "config.json").write_text('{"hidden_size": 32}')
    (a / "tokenizer.json").write_text('{"v": 1}')
    assert same_subject("org/m", "org/m") and not same_subject("org/m", "org/n")
    assert same_subject(str(a), str(a) + "/") and same_subject(str(a), str(tmp_path / "." / "subject"))
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert same_subject(str(a), str(copy))  # the same files elsewhere: one model
    (copy / "tokenizer.json").write_text('{"v": 2}')
    assert not same_subject(str(a), str(copy))  # another tokenizer: another subject


def _relabelled(nla_pair, tmp_path, name, **fields):  # noqa: F811
    """Copies of the pair's AV and AR dirs whose sidecars record ``fields`` (e.g. another subject)."""
    out = {}
    for role, src in (("av", nla_pair.av_dir), ("ar", nla_pair.ar_dir)):
        dst = tmp_path / f"{name}_{role}"
        shutil.copytree(src, dst)
        write_sidecar(dst, load_sidecar(dst).replace(**fields))
        out[role] = dst
    return out


def _dataset(path, side, n=6):
    vecs = np.random.default_rng(0).standard_normal((n, 32)).astype(np.float32)
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vecs)}), path)
    write_sidecar(path, side.replace(kind="nla_dataset", role=None))
    return path


def test_a_pair_of_two_subjects_is_refused_by_the_client(nla_pair, tmp_path, caplog):  # noqa: F811
    a = _relabelled(nla_pair, tmp_path, "a", base_model="org/subject-a")
    b = _relabelled(nla_pair, tmp_path, "b", base_model="org/subject-b")
    with pytest.raises(ProvenanceError, match="AV/AR pair: these come from different subjects: subject model: the AV "
                                              "has 'org/subject-a', the AR has 'org/subject-b'"):
        NLAClient(a["av"], b["ar"], device="cpu")
    with caplog.at_level(logging.WARNING, logger="nla.core.provenance"):
        NLAClient(a["av"], b["ar"], device="cpu", allow_mixed_provenance=True)
    assert "allowed by --allow-mixed-provenance" in caplog.text
    NLAClient(a["av"], a["ar"], device="cpu")  # one subject: fine


@pytest.mark.parametrize("command", ["eval", "score", "verbalize"])
def test_data_of_another_subject_is_refused_before_anything_is_written(nla_pair, tmp_path, capsys,  # noqa: F811
                                                                       command):
    a = _relabelled(nla_pair, tmp_path, "a", base_model="org/subject-a")
    side_a = load_sidecar(a["av"])
    other = side_a.replace(base_model="org/subject-b", injection_token_id=side_a.injection_token_id + 1)
    ds = _dataset(tmp_path / "other.parquet", other)
    out = tmp_path / "out" / ("eval" if command == "eval" else "rows.jsonl")
    texts = tmp_path / "t.txt"
    texts.write_text("a\n" * 6)
    argv = {"eval": ["eval", "--av", a["av"], "--ar", a["ar"], "--dataset", ds, "--max-new-tokens", "8"],
            "score": ["score", "--ar", a["ar"], "--texts", texts, "--vectors", ds],
            "verbalize": ["verbalize", "--av", a["av"], "--vectors", ds, "--max-new-tokens", "8"]}[command]
    argv = [str(x) for x in argv] + ["--out", str(out), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"nla {command}: error: dataset: these come from different subjects: subject model: the dataset" in err
    assert "'org/subject-b'" in err and "id " in err and "--allow-mixed-provenance" in err
    assert not out.exists() and not out.parent.exists()
    assert main(argv + ["--allow-mixed-provenance"]) == 0 and out.exists()


def test_rl_refuses_data_of_another_subject_before_writing(nla_pair, tmp_path, capsys):  # noqa: F811
    a = _relabelled(nla_pair, tmp_path, "a", base_model="org/subject-a", layer_index=1)
    ds = _dataset(tmp_path / "rl.parquet", load_sidecar(a["av"]).replace(layer_index=0))
    run = tmp_path / "run"
    argv = ["rl", "--av", str(a["av"]), "--ar", str(a["ar"]), "--dataset", str(ds), "--out", str(run),
            "--steps", "1", "--set", "device=cpu", "--set", "rollout.rollout_batch_size=2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "nla rl: error: rl: these come from different subjects: layer: dataset" in err and "has 0" in err
    assert not run.exists()
