"""Bad input through the CLI: exit code 2, one line naming the culprit, nothing written (nla.util.validation).

Real files throughout: NaN / zero / complex / boolean .npy arrays, a parquet whose vector column
holds strings, truncated and corrupt safetensors, a YAML syntax error, unwritable outputs, on a
tiny real AV/AR pair saved here.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import build_tiny_model

from nla.cli import main
from nla.core.reconstructor import VALUE_HEAD_FILE, Reconstructor
from nla.core.sidecar import NLAConfig, write_sidecar
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR
from nla.datagen.io import vectors_to_arrow
from nla.util.checkpoint_files import check_safetensors_file
from nla.util.validation import InputError, check_vectors, describe_rows, load_yaml

D = 32


def cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """Exit code and the non-empty stderr lines of ``nla *argv``."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    err = capsys.readouterr().err
    return code, [ln for ln in err.splitlines() if ln.strip()]


def assert_one_error_line(lines: list[str], command: str, *parts: str) -> str:
    errors = [ln for ln in lines if ln.startswith(f"nla {command}: error: ")]
    assert len(errors) == 1, lines
    assert not any("Traceback" in ln for ln in lines)
    for part in parts:
        assert part in errors[0], (part, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("validation")
    model = build_tiny_model("llama", tiny_tokenizer)
    side = NLAConfig.from_tokenizer(
        tiny_tokenizer, kind="nla_model", role="av", d_model=D, layer_index=1, av_template=DEFAULT_AV_TEMPLATE,
        ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR, injection_scale="sqrt_d_model",
    )
    av = root / "av"
    model.save_pretrained(av)
    tiny_tokenizer.save_pretrained(av)
    write_sidecar(av, side)
    ar = root / "ar"
    Reconstructor.from_base(model, 1, tokenizer=tiny_tokenizer, sidecar=side).save_pretrained(ar)
    good = np.random.default_rng(0).standard_normal((4, D)).astype(np.float32)
    np.save(root / "good.npy", good)
    return {"root": root, "av": av, "ar": ar, "good": good, "side": side}


# --- vectors ------------------------------------------------------------------------------------
def test_describe_rows():
    assert describe_rows([3], 10) == "row 3 (1 of 10)"
    assert describe_rows(range(12), 20) == "rows 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... (12 of 20)"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda a: a.__setitem__((1, 0), np.nan) or a.__setitem__((3, 5), np.inf) or a,
         "rows 1, 3 (2 of 4) hold NaN or Inf"),
        (lambda a: a.__setitem__(2, 0.0) or a, "row 2 (1 of 4) are all-zero vectors"),
        (lambda a: a.astype(np.float64) * 1e300, "rows 0, 1, 2, 3 (4 of 4) hold NaN or Inf (after conversion"),
        (lambda a: np.full_like(a, 1e38), "rows 0, 1, 2, 3 (4 of 4) have a norm that overflows float32"),
        (lambda a: a.astype(np.complex64), "found complex numbers (dtype complex64)"),
        (lambda a: a > 0, "found booleans (dtype bool)"),
        (lambda a: a.astype(np.int64), "found integers (dtype int64)"),
    ],
)
def test_check_vectors_refuses(pair, make, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_vectors(make(pair["good"].copy()), "v.npy")


def test_check_vectors_accepts_float16_and_returns_float32(pair):
    out = check_vectors(pair["good"].astype(np.float16))
    assert out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, pair["good"].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("command", ["verbalize", "score"])
def test_nan_row_refused_by_verbalize_and_score(pair, capsys, tmp_path, command):
    bad = pair["good"].copy()
    bad[2, 7] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    out = tmp_path / "out.jsonl"
    if command == "verbalize":
        argv = ["verbalize", "--av", pair["av"], "--vectors", tmp_path / "nan.npy", "--out", out, "--device", "cpu"]
    else:
        (tmp_path / "t.txt").write_text("a\nb\nc\nd\n")
        argv = ["score", "--ar", pair["ar"], "--texts", tmp_path / "t.txt", "--vectors", tmp_path / "nan.npy",
                "--out", out, "--device", "cpu"]
    code, lines = cli(capsys, *argv)
    assert code == 2
    assert_one_error_line(lines, command, str(tmp_path / "nan.npy"), "row 2 (1 of 4) hold NaN or Inf")
    assert not out.exists()


@pytest.mark.parametrize(
    ("array", "found"), [(np.zeros((3, D), np.complex128) + 1j, "complex numbers"), (np.ones((3, D), bool), "booleans")]
)
def test_complex_and_bool_npy_refused(pair, capsys, tmp_path, array, found):
    np.save(tmp_path / "v.npy", array)
    code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", tmp_path / "v.npy", "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, "verbalize", "v.npy", f"found {found}")


def test_parquet_vector_column_of_strings_refused(pair, capsys, tmp_path):
    col = pa.array([[str(x) for x in row] for row in pair["good"]], pa.list_(pa.string()))
    pq.write_table(pa.table({"activation_vector": col}), tmp_path / "s.parquet")
    code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", tmp_path / "s.parquet", "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, "verbalize", "s.parquet", "'activation_vector'", "lists of string")


def test_zero_vector_dataset_refused_by_rl_before_anything_is_written(pair, capsys, tmp_path):
    vec = pair["good"].copy()
    vec[1] = 0.0
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vec)}), tmp_path / "rl.parquet")
    run = tmp_path / "run"
    code, lines = cli(capsys, "rl", "--av", pair["av"], "--ar", pair["ar"], "--dataset", tmp_path / "rl.parquet",
                      "--out", run, "--set", "device=cpu")
    assert code == 2
    assert_one_error_line(lines, "rl", "rl.parquet", "row 1 (1 of 4) are all-zero vectors")
    assert not run.exists()


def test_rl_nan_row_stops_before_step_0_naming_the_row(pair, capsys, tmp_path):
    vec = np.tile(pair["good"], (3, 1))
    vec[9, 0] = np.nan
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vec)}), tmp_path / "rl.parquet")
    run = tmp_path / "run"
    code, lines = cli(capsys, "rl", "--av", pair["av"], "--ar", pair["ar"], "--dataset", tmp_path / "rl.parquet",
                      "--out", run, "--set", "device=cpu")
    assert code == 2
    assert_one_error_line(lines, "rl", "row 9 (1 of 12) hold NaN or Inf")
    assert not run.exists()


# --- integer flags --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "command", "culprit"),
    [
        (["verbalize", "--av", "x", "--vectors", "v.npy", "--rows", "-1"], "verbalize",
         "argument --rows: expected an integer >= 1, found -1"),
        (["eval", "--ar", "x", "--dataset", "d.parquet", "--samples", "-5"], "eval",
         "argument --samples: expected an integer >= 0, found -5"),
        (["score", "--ar", "x", "--texts", "t.txt", "--vectors", "v.npy", "--batch-size", "0"], "score",
         "argument --batch-size: expected an integer >= 1, found 0"),
        (["rl", "--steps", "two"], "rl", "argument --steps: expected an integer >= 1, found 'two'"),
    ],
)
def test_negative_counts_refused_in_one_line(capsys, argv, command, culprit):
    code, lines = cli(capsys, *argv)
    assert code == 2
    assert lines == [f"nla {command}: error: {culprit}; see nla {command} --help"]


# --- YAML -----------------------------------------------------------------------------------------
def test_yaml_error_names_file_line_and_column(pair, capsys, tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("dataset: d.parquet\nlr: 1e-4\nbatch_size: [8, 16\nseed: 0\n")
    with pytest.raises(InputError, match=rf"{bad}:4:5: the ARTrainConfig config is not valid YAML"):
        load_yaml(bad, "ARTrainConfig config")
    code, lines = cli(capsys, "train", "ar", "--config", bad, "--out", tmp_path / "run")
    assert code == 2
    assert_one_error_line(lines, "train", f"{bad}:4:5", "not valid YAML", "fix the syntax there")
    assert not (tmp_path / "run").exists()
    side = tmp_path / "nla_meta.yaml"
    side.write_text("kind: nla_model\nrole: av\n  d_model: 3\n")
    code, lines = cli(capsys, "verbalize", "--av", tmp_path, "--vectors", pair["root"] / "good.npy", "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, "verbalize", f"{side}:3:10", "the sidecar is not valid YAML")


# --- checkpoint files -----------------------------------------------------------------------------
def _damaged_copy(pair, tmp_path, role: str, file: str, how: str) -> Path:
    dst = tmp_path / f"{role}_{how}"
    shutil.copytree(pair[role], dst)
    target = dst / file
    data = target.read_bytes()
    if how == "truncated":
        target.write_bytes(data[: len(data) - 100])
    elif how == "missing":
        target.unlink()
    elif how == "corrupt_header":
        (n,) = struct.unpack("<Q", data[:8])
        target.write_bytes(data[:8] + b"{" * n + data[8 + n :])
    elif how == "empty":
        target.write_bytes(b"")
    return dst


def test_check_safetensors_file_by_hand(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    good = struct.pack("<Q", len(header)) + header + b"\0" * 8
    (tmp_path / "ok.safetensors").write_bytes(good)
    check_safetensors_file(tmp_path / "ok.safetensors")
    (tmp_path / "short.safetensors").write_bytes(good[:-1])
    with pytest.raises(InputError, match=rf"short.safetensors: truncated or corrupt safetensors file \({len(good) - 1} "
                                         r"bytes; safetensors: .*not fully covered\); re-download"):
        check_safetensors_file(tmp_path / "short.safetensors")
    (tmp_path / "long.safetensors").write_bytes(good + b"\0")  # data past the last tensor
    with pytest.raises(InputError, match=r"long.safetensors: truncated or corrupt .*not fully covered"):
        check_safetensors_file(tmp_path / "long.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 10**9) + header)
    with pytest.raises(InputError, match=r"huge.safetensors: truncated or corrupt .*header too large"):
        check_safetensors_file(tmp_path / "huge.safetensors")
    (tmp_path / "json.safetensors").write_bytes(struct.pack("<Q", len(header)) + b"{" * len(header) + b"\0" * 8)
    with pytest.raises(InputError, match=r"json.safetensors: truncated or corrupt .*invalid JSON"):
        check_safetensors_file(tmp_path / "json.safetensors")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match=r"empty.safetensors: truncated safetensors file \(0 bytes, no header\)"):
        check_safetensors_file(tmp_path / "empty.safetensors")


def _load_command(pair, tmp_path, role: str, ckpt, out) -> list:
    """The CLI command that loads ``ckpt``: ``verbalize`` for an AV, ``score`` for an AR."""
    if role == "av":
        return ["verbalize", "--av", ckpt, "--vectors", pair["root"] / "good.npy", "--out", out]
    (tmp_path / "t.txt").write_text("a\nb\nc\nd\n")
    return ["score", "--ar", ckpt, "--texts", tmp_path / "t.txt", "--vectors", pair["root"] / "good.npy", "--out", out]


@pytest.mark.parametrize(
    ("role", "file", "how", "message"),
    [
        ("av", "model.safetensors", "truncated", "model.safetensors: truncated or corrupt safetensors file"),
        ("av", "model.safetensors", "missing", "has no model.safetensors (no weights)"),
        ("av", "model.safetensors", "corrupt_header", "model.safetensors: truncated or corrupt safetensors file"),
        ("ar", VALUE_HEAD_FILE, "truncated", "value_head.safetensors: truncated or corrupt safetensors file"),
        ("ar", "model.safetensors", "empty", "model.safetensors: truncated safetensors file (0 bytes"),
    ],
)
def test_damaged_checkpoints_are_named(pair, capsys, tmp_path, role, file, how, message):
    ckpt = _damaged_copy(pair, tmp_path, role, file, how)
    out = tmp_path / "out.jsonl"
    argv = _load_command(pair, tmp_path, role, ckpt, out)
    code, lines = cli(capsys, *argv, "--device", "cpu")
    assert code == 2
    line = assert_one_error_line(lines, argv[0], message)
    assert str(ckpt) in line and ("re-download or re-save" in line or "safe_serialization" in line)
    assert not out.exists()


@pytest.mark.parametrize("role", ["av", "ar"])
def test_nan_weights_without_a_checksum_record_are_refused(pair, capsys, tmp_path, role):
    """Issue 21: NaN weights in a checkpoint nla did not write (no checksum record) loaded: ``nla
    score`` printed ``NaN`` (not JSON) and ``verbalize`` wrote padding. Every weight is now checked
    finite at load where no record exists; nothing is written."""
    from safetensors.torch import load_file, save_file

    from nla.util.checkpoint_files import CHECKSUM_FILE

    ckpt = tmp_path / f"{role}_nan"
    shutil.copytree(pair[role], ckpt)
    (ckpt / CHECKSUM_FILE).unlink(missing_ok=True)  # a checkpoint from elsewhere
    weights = load_file(str(ckpt / "model.safetensors"))
    name = sorted(k for k in weights if weights[k].is_floating_point())[0]
    weights[name].view(-1)[[0, 3]] = float("nan")
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out.jsonl"
    argv = _load_command(pair, tmp_path, role, ckpt, out)
    code, lines = cli(capsys, *argv, "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, argv[0], f"{ckpt / 'model.safetensors'}: tensor {name!r} holds 2 non-finite value(s)")
    assert not out.exists()
    # the intact copy (same files, no record) loads: the check refuses only what is broken
    good = tmp_path / f"{role}_good"
    shutil.copytree(pair[role], good)
    (good / CHECKSUM_FILE).unlink(missing_ok=True)
    argv[2] = good
    assert cli(capsys, *argv, "--device", "cpu")[0] == 0


def test_damaged_checkpoint_refused_by_rl(pair, capsys, tmp_path):
    ar = _damaged_copy(pair, tmp_path, "ar", VALUE_HEAD_FILE, "truncated")
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(pair["good"])}), tmp_path / "rl.parquet")
    code, lines = cli(capsys, "rl", "--av", pair["av"], "--ar", ar, "--dataset", tmp_path / "rl.parquet",
                      "--out", tmp_path / "run")
    assert code == 2
    assert_one_error_line(lines, "rl", f"{ar / VALUE_HEAD_FILE}: truncated")
    assert not (tmp_path / "run").exists()


def test_base_model_that_is_not_a_directory(capsys, tmp_path):
    code, lines = cli(capsys, "train", "ar", "--set", "dataset=d.parquet", "--base-model", tmp_path / "no" / "model",
                      "--out", tmp_path / "run")
    assert code == 2
    assert_one_error_line(lines, "train", f"base_model: no model directory at '{tmp_path / 'no' / 'model'}'")
    assert not (tmp_path / "run").exists()


def test_truncated_base_model_refused_by_train(pair, capsys, tmp_path):
    base = _damaged_copy(pair, tmp_path, "av", "model.safetensors", "truncated")
    code, lines = cli(capsys, "train", "ar", "--set", "dataset=d.parquet", "--base-model", base,
                      "--out", tmp_path / "run")
    assert code == 2
    assert_one_error_line(lines, "train", f"{base / 'model.safetensors'}: truncated")


# --- outputs and devices --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_output_fails_before_work(pair, capsys, tmp_path, where):
    if where == "under_a_file":
        (tmp_path / "afile").write_text("x")
        out, culprit = tmp_path / "afile" / "sub" / "out.jsonl", f"{tmp_path / 'afile'} is a file"
    else:
        out, culprit = Path("/proc/nla-no-such-dir/out.jsonl"), "cannot write under /proc"
    code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", pair["root"] / "good.npy",
                      "--out", out, "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, "verbalize", culprit, str(out))


def test_unwritable_run_dir_fails_before_training(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    code, lines = cli(capsys, "train", "av", "--set", "dataset=d.parquet", "--out", tmp_path / "afile")
    assert code == 2
    assert_one_error_line(lines, "train", f"out_dir: {tmp_path / 'afile'} is a file, expected a directory")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_machine_is_refused(pair, capsys):
    code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", pair["root"] / "good.npy",
                      "--device", "cuda")
    assert code == 2
    assert_one_error_line(lines, "verbalize", "device: 'cuda' asked for, but this machine has", "--device cpu")


# --- texts, roles, run directories, stuck runs -----------------------------------------------------
def test_texts_split_on_newline_only(pair, capsys, tmp_path):
    from nla.client import NLAClient
    from nla.commands.score import read_texts

    # U+2028, NEL and a lone CR are inside explanations; only \n (with an optional \r before it) ends a row.
    (tmp_path / "t.txt").write_bytes("a\u2028b cat\nthe\x85dog\rruns\r\n\nAlice\n".encode())
    expected = ["a\u2028b cat", "the\x85dog\rruns", "", "Alice"]
    assert read_texts(str(tmp_path / "t.txt")) == expected
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"explanation": e}) for e in ["x\u2028y", None]) + "\n\n")
    assert read_texts(str(tmp_path / "t.jsonl")) == ["x\u2028y", None]
    vec = np.random.default_rng(1).standard_normal((4, D)).astype(np.float32)
    np.save(tmp_path / "v.npy", vec)
    out = tmp_path / "scores.jsonl"
    code, _ = cli(capsys, "score", "--ar", pair["ar"], "--texts", tmp_path / "t.txt", "--vectors", tmp_path / "v.npy",
                  "--out", out, "--device", "cpu")
    assert code == 0
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    want = NLAClient(None, pair["ar"], device="cpu").score(expected, vec).mse_nrm
    assert [r["row"] for r in rows] == [0, 1, 2, 3]
    assert [r["failed"] for r in rows] == [False, False, True, False]  # the empty line says nothing: failed
    np.testing.assert_allclose([rows[i]["mse_nrm"] for i in (0, 1, 3)], want.numpy()[[0, 1, 3]], rtol=1e-6)
    (tmp_path / "bad.jsonl").write_text('{"explanation": "ok"}\n{"explanation": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 is not valid JSON"):
        read_texts(str(tmp_path / "bad.jsonl"))


def test_swapped_roles_refused_by_rl(pair, capsys, tmp_path):
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(pair["good"])}), tmp_path / "rl.parquet")
    code, lines = cli(capsys, "rl", "--av", pair["ar"], "--ar", pair["av"], "--dataset", tmp_path / "rl.parquet",
                      "--out", tmp_path / "run")
    assert code == 2
    assert_one_error_line(lines, "rl", f"av: {pair['ar']} is an AR checkpoint (role 'ar'), not an AV")
    assert not (tmp_path / "run").exists()


def _ar_train_args(tmp_path, ds, *extra):
    return ["train", "ar", "--dataset", ds, "--out", tmp_path / "run", "--max-steps", "4", "--set", "batch_size=4",
            "--set", "warmup_steps=1", "--set", "save_every=2", "--set", "eval_fraction=0.25",
            "--set", "tensorboard=false", "--set", "progress=false", "--set", "log_every=1", *extra]


def test_run_dir_is_not_reused_silently(pair, capsys, tmp_path, tiny_tokenizer, single_thread):
    import yaml
    from train_helpers import dataset_sidecar, write_ar_dataset

    from nla.util.metrics import read_metrics

    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    ds = write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1), vec)
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert cli(capsys, *_ar_train_args(tmp_path, ds, "--set", "stop_after_steps=2"))[0] == 0
    # A kill during a save leaves a temp dir; the next start removes it.
    (ckpts / ".step_00000004.tmp-deadbeef").mkdir()
    (ckpts / ".step_00000004.tmp-deadbeef" / "model.safetensors").write_bytes(b"x" * 1000)
    (ckpts / "..step_00000004.tmp-deadbeef.tmp-cafe1234").mkdir()  # the AR's own temp dir beside it
    code, lines = cli(capsys, *_ar_train_args(tmp_path, ds))
    assert code == 2
    assert_one_error_line(lines, "train", f"out_dir {run} already holds a run (checkpoints up to step_00000002)",
                          "--resume", "--overwrite")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"]  # stale temp dir gone, run untouched
    code, lines = cli(capsys, *_ar_train_args(tmp_path, ds, "--resume", "--set", "lr=0.003"))
    assert code == 2
    assert_one_error_line(lines, "train", "--resume: the config differs from the run's",
                          "lr: 0.0001 in the run, 0.003 now")
    assert cli(capsys, *_ar_train_args(tmp_path, ds, "--resume"))[0] == 0  # same config: continues
    assert [r["step"] for r in read_metrics(run / "ar.jsonl")] == [1, 2, 3, 4]
    assert cli(capsys, *_ar_train_args(tmp_path, ds, "--overwrite", "--max-steps", "2"))[0] == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"]
    assert [r["step"] for r in read_metrics(run / "ar.jsonl")] == [1, 2]  # a new run, not a mix
    saved = yaml.safe_load((ckpts / "step_00000002" / "train_config.yaml").read_text())
    assert saved["max_steps"] == 2


def test_resume_refuses_a_dataset_replaced_at_the_same_path(pair, capsys, tmp_path, tiny_tokenizer, single_thread):
    """Issue 58: a checkpoint records its dataset's size and SHA-256; ``--resume`` on another file at
    the same path used to go on silently (the data cursor pointing into other rows)."""
    import hashlib
    import json
    import shutil

    from train_helpers import dataset_sidecar, write_ar_dataset

    rng = np.random.default_rng(0)
    ds = write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1),
                          rng.standard_normal((8, D)).astype(np.float32))
    shutil.copy(ds, tmp_path / "ar.orig.parquet")
    ckpts = tmp_path / "run" / "checkpoints"
    assert cli(capsys, *_ar_train_args(tmp_path, ds, "--set", "stop_after_steps=2"))[0] == 0
    rec = json.loads((ckpts / "step_00000002" / "inputs.json").read_text())
    digest = hashlib.sha256(Path(ds).read_bytes()).hexdigest()
    assert rec["dataset"] == {"path": str(Path(ds).resolve()), "size": Path(ds).stat().st_size, "sha256": digest}
    # the same path, other rows (other vectors, same shape and size)
    write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1),
                     rng.standard_normal((8, D)).astype(np.float32))
    code, lines = cli(capsys, *_ar_train_args(tmp_path, ds, "--resume"))
    assert code == 2
    assert_one_error_line(lines, "train", f"--resume: dataset {Path(ds).resolve()} is not the file this run trained on",
                          f"sha256 {digest[:16]}", "Put the run's dataset back")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"]  # the run untouched
    shutil.copy(tmp_path / "ar.orig.parquet", ds)  # the run's own file back: it continues
    assert cli(capsys, *_ar_train_args(tmp_path, ds, "--resume"))[0] == 0
    assert sorted(p.name for p in ckpts.iterdir())[-1] == "step_00000004"


def test_diverged_training_stops_at_the_first_non_finite_figure(pair, capsys, tmp_path, tiny_tokenizer,
                                                                 single_thread):
    """Issue 21: ``lr=1e6`` trained an AR whose predictions were infinite (scored as cosine 0) to
    the last step, exit 0, with a warning at step ~11. It now stops at the first step whose loss
    or prediction norm is not finite, naming the step and the setting; nothing of it is saved."""
    from train_helpers import dataset_sidecar, write_ar_dataset

    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    ds = write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1), vec)
    code, lines = cli(capsys, *_ar_train_args(tmp_path, ds, "--max-steps", "12", "--set", "lr=1e6",
                                              "--set", "save_every=100"))
    assert code == 2
    line = assert_one_error_line(lines, "train", "ar: the training pred_norm is inf at step ",
                                 "the run diverged and was stopped (no checkpoint was written); lower lr=1e+06")
    step = int(line.split(" at step ")[1].split(":")[0])
    assert 1 < step < 12  # step 1 runs on the initial weights, finite
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_dead_run_with_finite_losses_still_warns(caplog):
    """A zero gradient with a finite loss (a collapsed output) is the stuck monitor's case: it warns
    once at ``patience`` steps."""
    from nla.train.health import StuckRunMonitor, TrainingDivergedError, check_finite_loss

    mon = StuckRunMonitor("ar", patience=3)
    with caplog.at_level("WARNING", logger="nla.train.health"):
        warned = [mon.observe(step, grad_norm=0.0) for step in range(1, 6)]
    assert [bool(w) for w in warned] == [False, False, True, False, False]
    assert "ar looks stuck: the gradient norm has been zero or non-finite for 3 steps in a row (step 3" in warned[2][0]
    check_finite_loss("ar", 4, {"loss": 1.0, "pred_norm": 3.0}, "lr=1", None)  # finite: nothing
    with pytest.raises(TrainingDivergedError, match=r"^av: the training loss is nan at step 7: .* \(the last good "
                                                    r"checkpoint is ck/step_5\); lower lr=0.1"):
        check_finite_loss("av", 7, {"loss": float("nan"), "pred_norm": float("inf")}, "lr=0.1", "ck/step_5")


def test_pickled_weights_are_refused(pair, capsys, tmp_path):
    from nla.util.checkpoint_files import check_checkpoint

    ckpt = tmp_path / "pickled"
    shutil.copytree(pair["av"], ckpt)
    (ckpt / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    with pytest.raises(InputError, match=r"has no model.safetensors \(only pickled weights \['pytorch_model.bin'\]\); "
                                         r"nla loads safetensors only"):
        check_checkpoint(ckpt, "av")
    with pytest.raises(InputError, match="only pickled weights"):
        Reconstructor.from_base(ckpt, 1)  # base-model loads insist on safetensors too
    code, lines = cli(capsys, "verbalize", "--av", ckpt, "--vectors", pair["root"] / "good.npy", "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, "verbalize", "only pickled weights")


def test_rendezvous_port_probe_binds_the_given_host_only():
    import socket

    from nla.rl.distributed import free_port

    port = free_port()  # default: loopback, never all interfaces
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # the probe released it, on the loopback it tested
    with pytest.raises(OSError):
        free_port("203.0.113.7")  # TEST-NET-3: not an address of this host, so nothing can be bound there


def test_eval_names_the_nan_row_and_file(pair, capsys, tmp_path):
    vec = pair["good"].copy()
    vec[3, 1] = -np.inf
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vec)}), tmp_path / "heldout.parquet")
    code, lines = cli(capsys, "eval", "--av", pair["av"], "--ar", pair["ar"], "--dataset", tmp_path / "heldout.parquet",
                      "--out", tmp_path / "ev", "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, "eval", "heldout.parquet: column 'activation_vector': row 3 (1 of 4) hold NaN or Inf")
    assert not (tmp_path / "ev").exists()


def test_skip_bad_rows_drops_counts_and_keeps_row_numbers(pair, capsys, caplog, tmp_path):
    from nla.client import NLAClient
    from nla.util.validation import drop_bad_rows

    vec = np.random.default_rng(2).standard_normal((5, D)).astype(np.float32)
    vec[1, 4], vec[3] = np.nan, 0.0
    kept_vec, kept, report = drop_bad_rows(vec, "v")
    assert kept.tolist() == [0, 2, 4] and np.array_equal(kept_vec, vec[[0, 2, 4]])
    assert report == ("v: skipped 2 of 5 rows: row 1 (1 of 5) hold NaN or Inf (after conversion to float32); "
                      "row 3 (1 of 5) are all-zero vectors")
    np.save(tmp_path / "v.npy", vec)
    out = tmp_path / "verbs.jsonl"
    with caplog.at_level("WARNING"):
        code, _ = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", tmp_path / "v.npy", "--skip-bad-rows",
                      "--max-new-tokens", "6", "--out", out, "--device", "cpu")
    assert code == 0 and any("skipped 2 of 5 rows" in r.message for r in caplog.records)
    got = [json.loads(ln) for ln in out.read_text().splitlines()]
    want = NLAClient(pair["av"], device="cpu").verbalize(vec[[0, 2, 4]], max_new_tokens=6)
    assert [g["row"] for g in got] == [0, 2, 4]
    assert [g["text"] for g in got] == [w.text for w in want]
    texts = ["the cat", "a dog", "Alice runs", "Bob", "the river"]
    (tmp_path / "t.txt").write_text("\n".join(texts) + "\n")
    code, _ = cli(capsys, "score", "--ar", pair["ar"], "--texts", tmp_path / "t.txt", "--vectors", tmp_path / "v.npy",
                  "--skip-bad-rows", "--out", tmp_path / "s.jsonl", "--device", "cpu")
    assert code == 0
    rows = [json.loads(ln) for ln in (tmp_path / "s.jsonl").read_text().splitlines()]
    ref = NLAClient(None, pair["ar"], device="cpu").score([texts[i] for i in (0, 2, 4)], vec[[0, 2, 4]]).mse_nrm
    assert [r["row"] for r in rows] == [0, 2, 4]
    np.testing.assert_allclose([r["mse_nrm"] for r in rows], ref.numpy(), rtol=1e-6)
    code, lines = cli(capsys, "score", "--ar", pair["ar"], "--texts", tmp_path / "t.txt", "--vectors",
                      tmp_path / "v.npy", "--device", "cpu")  # without the flag: refused, both rows named
    assert code == 2
    assert_one_error_line(lines, "score", "row 1 (1 of 5) hold NaN or Inf (after conversion to float32); "
                                          "row 3 (1 of 5) are all-zero vectors")


@pytest.mark.parametrize(
    ("argv", "command", "culprit"),
    [
        (["datagen", "run", "--set", "seed=abc"], "datagen",
         "DatagenConfig.seed: expected an integer, found 'abc' (str); fix it in the YAML or with --set seed=..."),
        (["datagen", "run", "--set", "provider.max_tokens=many"], "datagen",
         "ProviderConfig.max_tokens: expected an integer, found 'many'"),
        (["world", "build"], "world", "{cfg}:2:1: the world config is not valid YAML"),
        (["datagen", "run"], "datagen", "{cfg}:2:1: the datagen config is not valid YAML"),
    ],
)
def test_datagen_and_world_config_errors(capsys, tmp_path, argv, command, culprit):
    cfg = tmp_path / "cfg.yaml"
    if "--set" in argv:
        cfg.write_text("n_docs: 4\n")
    else:
        cfg.write_text("n_docs: 4\n\tseed: 1\n")  # a tab indent: not YAML
    code, lines = cli(capsys, *argv, "--config", cfg, "--out", tmp_path / "out")
    assert code == 2
    assert_one_error_line(lines, command, culprit.format(cfg=cfg))
    assert not (tmp_path / "out").exists()


def test_flipped_bit_in_a_saved_checkpoint_is_caught(pair, capsys, tmp_path, tiny_tokenizer, single_thread):
    from train_helpers import dataset_sidecar, write_ar_dataset

    from nla.util.checkpoint_files import CHECKSUM_FILE, verify_checksums

    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    ds = write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1), vec)
    code, lines = cli(capsys, *_ar_train_args(tmp_path, ds, "--max-steps", "2"))
    assert code == 0, lines
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    recorded = dict(ln.split("  ")[::-1] for ln in (ckpt / CHECKSUM_FILE).read_text().splitlines())
    assert sorted(recorded) == ["model.safetensors", "value_head.safetensors"]
    import hashlib

    assert recorded["model.safetensors"] == hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    verify_checksums(ckpt)  # intact: passes
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor: the file stays complete and loadable
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    (tmp_path / "t.txt").write_text("the cat\n")
    np.save(tmp_path / "v.npy", vec[:1])
    code, lines = cli(capsys, "score", "--ar", ckpt, "--texts", tmp_path / "t.txt", "--vectors", tmp_path / "v.npy",
                      "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, "score", f"{ckpt / 'model.safetensors'}: its SHA-256 differs from the one recorded")


def test_resume_compares_config_sections_field_by_field(tmp_path):
    # RL configs nest sections: a changed loss.kl_coef is named by its dotted path, while
    # checkpointing.keep_last / backend.ray_address (how this invocation runs) may change.
    import yaml

    from nla.train.rundir import RunDirError, prepare_run_dir

    saved = {"steps": 10, "loss": {"kl_coef": 0.01, "eps_low": 0.2},
             "checkpointing": {"save_every": 5, "keep_last": 2}, "backend": {"name": "local", "ray_address": None}}
    ckpt = tmp_path / "checkpoints" / "step_00000005"
    ckpt.mkdir(parents=True)
    (ckpt / "rl_config.yaml").write_text(yaml.safe_dump(saved))
    same_run = {**saved, "checkpointing": {"save_every": 1, "keep_last": 0},
                "backend": {"name": "local", "ray_address": "10.0.0.1:6379"}}
    prepare_run_dir(tmp_path, same_run, "rl_config.yaml", resume=True, overwrite=False)
    with pytest.raises(RunDirError, match=r"loss.kl_coef: 0.01 in the run, 0.1 now; steps: 10 in the run, 11 now"):
        prepare_run_dir(tmp_path, {**saved, "steps": 11, "loss": {"kl_coef": 0.1, "eps_low": 0.2}}, "rl_config.yaml",
                        resume=True, overwrite=False)


def test_a_run_saved_before_a_field_existed_resumes_at_its_default(tmp_path):
    # rollout.decode and optimiser.gradient_checkpointing came after this run was saved: at their
    # defaults (what ran then) it resumes; set otherwise it is another run, named.
    import yaml

    from nla.train.rundir import ADDED_FIELDS, RunDirError, prepare_run_dir

    saved = {"steps": 10, "rollout": {"max_response_len": 24}, "optimiser": {"lr": 1e-4}}
    ckpt = tmp_path / "checkpoints" / "step_00000005"
    ckpt.mkdir(parents=True)
    (ckpt / "rl_config.yaml").write_text(yaml.safe_dump(saved))
    assert ADDED_FIELDS["rollout.decode"] == "eager"
    now = {"steps": 10, "rollout": {"max_response_len": 24, "decode": "eager"},
           "optimiser": {"lr": 1e-4, "gradient_checkpointing": False}}
    prepare_run_dir(tmp_path, now, "rl_config.yaml", resume=True, overwrite=False)
    with pytest.raises(RunDirError, match=r"rollout.decode: '<absent>' in the run, 'captured' now"):
        prepare_run_dir(tmp_path, {**now, "rollout": {"max_response_len": 24, "decode": "captured"}},
                        "rl_config.yaml", resume=True, overwrite=False)


@pytest.mark.parametrize("argv", [
    ["train", "ar", "--set", "lr=[1"],
    ["train", "av", "--set", "lr=[1"],
    ["rl", "--set", "lr=[1"],
    ["datagen", "run", "--set", "lr=[1"],
])
def test_a_set_value_that_is_not_yaml_is_one_line_not_a_traceback(capsys, tmp_path, argv):
    """Issue 21: ``--set 'lr=[1'`` raised a YAML traceback in every command."""
    if argv[0] == "datagen":
        (tmp_path / "c.yaml").write_text("n_docs: 4\n")
        argv = [*argv[:2], "--config", tmp_path / "c.yaml", *argv[2:]]
    code, lines = cli(capsys, *argv, "--out", tmp_path / "run")
    assert code == 2
    assert_one_error_line(lines, argv[0], "--set 'lr=[1': the value '[1' is not valid YAML", "quote it")
    assert not (tmp_path / "run").exists()
    code, lines = cli(capsys, *argv[:-1], "=5", "--out", tmp_path / "run")
    assert code == 2
    assert_one_error_line(lines, argv[0], "--set '=5': expected key=value")


@pytest.mark.parametrize(("port", "message"), [("99999", "expected a port 1-65535, found 99999"),
                                               ("0", "expected a port 1-65535, found 0"),
                                               ("http", "expected an integer port 1-65535, found 'http'")])
def test_explore_refuses_a_bad_port_before_loading_anything(capsys, tmp_path, port, message):
    """Issue 21: ``nla explore --port 99999`` loaded both models, then died in a traceback."""
    code, lines = cli(capsys, "explore", "--av", tmp_path / "no_av", "--ar", tmp_path / "no_ar", "--port", port)
    assert code == 2
    assert any(message in ln and "--port" in ln for ln in lines), lines
    assert not any("Traceback" in ln for ln in lines)


def test_an_ar_with_a_published_critic_sidecar_scores_like_the_original(pair, capsys, tmp_path):
    """Issue 21: the same AR weights under the published critic layout (shared tokens block, no
    AV template, injection_scale null, role critic) load and score exactly as under nla's own."""
    import yaml

    critic = tmp_path / "critic"
    shutil.copytree(pair["ar"], critic)
    doc = yaml.safe_load((critic / "nla_meta.yaml").read_text())
    doc["role"] = "critic"
    doc["extraction"]["injection_scale"] = None
    doc["prompt_templates"] = {"critic": doc["prompt_templates"]["ar"]}
    doc.pop("prompt_template_sha256", None)
    assert {"injection_char", "injection_token_id", "critic_suffix_ids"} <= doc["tokens"].keys()
    (critic / "nla_meta.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    (tmp_path / "t.txt").write_text("a\nb\nc\nd\n")
    outs = {}
    for name, ckpt in (("nla", pair["ar"]), ("critic", critic)):
        out = tmp_path / f"{name}.jsonl"
        code, lines = cli(capsys, "score", "--ar", ckpt, "--texts", tmp_path / "t.txt", "--vectors",
                          pair["root"] / "good.npy", "--out", out, "--device", "cpu")
        assert code == 0, lines
        outs[name] = out.read_text()
    assert outs["critic"] == outs["nla"] and outs["nla"]


def test_resume_accepts_the_same_directory_spelled_another_way(pair, capsys, tmp_path, tiny_tokenizer,
                                                               single_thread, monkeypatch):
    """Issue 21: ``--resume`` refused ``runs/x`` as ``/abs/runs/x`` ("out_dir differs"); two
    spellings of one path are one run, a different path is still refused."""
    from train_helpers import dataset_sidecar, write_ar_dataset

    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1), vec)
    monkeypatch.chdir(tmp_path)
    args = ["train", "ar", "--set", "batch_size=4", "--set", "warmup_steps=1", "--set", "save_every=2",
            "--set", "eval_fraction=0.25", "--set", "tensorboard=false", "--set", "progress=false", "--max-steps", "6"]
    assert cli(capsys, *args, "--dataset", "ar.parquet", "--out", "run", "--set", "stop_after_steps=2")[0] == 0
    code, lines = cli(capsys, *args, "--dataset", str(tmp_path / "ar.parquet"), "--out", str(tmp_path / "run") + "/",
                      "--set", "stop_after_steps=4", "--resume")
    assert code == 0, lines
    assert (tmp_path / "run" / "checkpoints" / "step_00000004").is_dir()
    shutil.copy(tmp_path / "ar.parquet", tmp_path / "other.parquet")
    shutil.copy(tmp_path / "ar.parquet.nla_meta.yaml", tmp_path / "other.parquet.nla_meta.yaml")
    code, lines = cli(capsys, *args, "--dataset", "other.parquet", "--out", "run", "--resume")
    assert code == 2
    # (the step-4 checkpoint recorded the spelling of the run that wrote it: the absolute one)
    assert_one_error_line(lines, "train", "--resume: the config differs",
                          f"dataset: {str(tmp_path / 'ar.parquet')!r} in the run, 'other.parquet' now")


def test_a_new_top_level_directory_is_refused_and_missing_parents_are_said(pair, capsys, tmp_path, caplog):
    import logging

    from nla.util.validation import check_output_path

    out = Path("/nla-typo-no-such-dir/sub/out.jsonl")
    code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", pair["root"] / "good.npy",
                      "--out", out, "--device", "cpu")
    assert code == 2
    assert_one_error_line(lines, "verbalize", "would create the new top-level directory /nla-typo-no-such-dir")
    assert not Path("/nla-typo-no-such-dir").exists()
    with caplog.at_level(logging.INFO, logger="nla.util.validation"):
        check_output_path(tmp_path / "a" / "b" / "run", "--out")
    assert f"--out: creating {tmp_path / 'a'} (missing folders on the way to {tmp_path / 'a' / 'b' / 'run'})" \
        in caplog.text
    assert not (tmp_path / "a").exists()  # the check creates nothing itself


def test_score_output_is_valid_json_when_predictions_overflow(pair, capsys, caplog, tmp_path):
    """A huge value head (finite, no checksum record). At 1e36 x its weights the predictions are
    finite but their fp32 norms overflow: they are still compared by direction (the norm is taken
    in float64), not read as zero vectors. With the last MLP and the head at 3e38 they are inf:
    NaN scores, written as JSON null, and said."""
    import logging
    import shutil

    from safetensors.torch import load_file, save_file

    from nla.client import NLAClient
    from nla.core.reconstructor import VALUE_HEAD_FILE
    from nla.util.checkpoint_files import CHECKSUM_FILE

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    texts = ["a", "b", "c", "d"]
    gold = torch.from_numpy(np.load(pair["root"] / "good.npy")[:4])
    plain = NLAClient(None, pair["ar"], device="cpu").reconstruct(texts)
    for weight_scale, finite in ((1e36, True), (None, False)):
        ckpt = tmp_path / f"ar_{finite}"
        shutil.copytree(pair["ar"], ckpt)
        (ckpt / CHECKSUM_FILE).unlink(missing_ok=True)
        head = load_file(str(ckpt / VALUE_HEAD_FILE))["weight"]
        if finite:
            save_file({"weight": (head.double() * weight_scale).float()}, str(ckpt / VALUE_HEAD_FILE))
        else:  # the last block's MLP writes ~1e37 into the residual, a head of 3e38s overflows it to inf
            body = load_file(str(ckpt / "model.safetensors"))
            key = max(k for k in body if k.endswith("mlp.down_proj.weight"))
            body[key] = torch.full_like(body[key], 3e38)
            save_file(body, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
            save_file({"weight": torch.full_like(head, 3e38)}, str(ckpt / VALUE_HEAD_FILE))
        out = tmp_path / f"rows_{finite}.jsonl"
        capsys.readouterr()
        with caplog.at_level(logging.WARNING, logger="nla.client"):
            code = main([str(a) for a in _load_command(pair, tmp_path, "ar", ckpt, out)] + ["--device", "cpu"])
        assert code == 0
        summary = json.loads(capsys.readouterr().out, parse_constant=no_constants)
        rows = [json.loads(line, parse_constant=no_constants) for line in out.read_text().splitlines()]
        assert len(rows) == 4 and summary["rows"] == 4
        if finite:
            # the head is linear: the same directions as the plain AR's (float64 reference)
            p64, g64 = plain.double(), gold.double()
            want = ((p64 * g64).sum(-1) / (p64.norm(dim=-1) * g64.norm(dim=-1))).tolist()
            assert [r["cosine"] for r in rows] == pytest.approx(want, abs=1e-4)
            assert summary["mse_nrm_mean"] == pytest.approx(sum(2 * (1 - c) for c in want) / 4, abs=1e-3)
        else:
            inf_rows = (~torch.isfinite(NLAClient(None, ckpt, device="cpu").reconstruct(texts)).all(-1)).tolist()
            assert all(inf_rows)
            assert [r["mse_nrm"] is None and r["cosine"] is None for r in rows] == inf_rows
            assert f"the AR predicts non-finite vectors for {sum(inf_rows)} of 4 rows" in caplog.text
            assert (summary["mse_nrm_mean"] is None) == all(inf_rows)


def test_a_micro_batch_larger_than_memory_is_refused_before_the_first_step(pair, capsys, tmp_path, tiny_tokenizer):
    from train_helpers import dataset_sidecar, write_ar_dataset

    from nla.train.health import available_memory, micro_batch_lower_bound

    # by hand: 16 bytes of ids + mask per token, one fp32 hidden state (and its gradient) per layer and the input
    assert micro_batch_lower_bound(2, 10, 32, 3, None, 4) == 20 * 16 + 20 * 32 * 4 * 2 * 4
    assert micro_batch_lower_bound(2, 10, 32, 3, 100, 4) == 20 * 16 + 20 * 32 * 4 * 2 * 4 + 20 * 100 * 4 * 2
    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    ds = write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1), vec)
    code, lines = cli(capsys, *_ar_train_args(tmp_path, ds, "--set", "batch_size=100000000"))
    assert code == 2
    assert available_memory("cpu") > 0
    assert_one_error_line(lines, "train", "train ar: a micro-batch of 100000000 rows x 256 tokens needs at least",
                          "GiB is available on cpu", "lower micro_batch_size")
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "ar.jsonl").exists()


def test_an_ar_checkpoint_is_refused_as_the_base_of_an_av(pair, capsys, tmp_path):
    code, lines = cli(capsys, "train", "av", "--set", "dataset=d.parquet", "--base-model", pair["ar"],
                      "--out", tmp_path / "run")
    assert code == 2
    assert_one_error_line(lines, "train", f"base_model: {pair['ar']} is a reconstructor (AR) checkpoint",
                          "no LM head", "pass the subject model")
    assert not (tmp_path / "run").exists()


def test_a_base_whose_lm_head_is_missing_from_its_files_is_refused(pair, tmp_path):
    """A causal LM saved without its (untied) head: the loader would start it at random."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from nla.train.av import AVTrainError, _refuse_random_head

    base = tmp_path / "headless"
    shutil.copytree(pair["av"], base)
    weights = load_file(str(base / "model.safetensors"))
    if "lm_head.weight" not in weights:
        pytest.skip("the tiny model ties its head to the embeddings")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(base / "model.safetensors"),
              metadata={"format": "pt"})
    model, info = AutoModelForCausalLM.from_pretrained(base, output_loading_info=True)
    with pytest.raises(AVTrainError, match=r"has no LM head weights \(lm_head.weight missing from its files"):
        _refuse_random_head(model, info, str(base))
    model, info = AutoModelForCausalLM.from_pretrained(pair["av"], output_loading_info=True)
    _refuse_random_head(model, info, str(pair["av"]))  # the whole model passes


def test_checksums_are_verified_once_per_file_and_machine(tmp_path, monkeypatch):
    """Issue 23: a verified file's digest is kept in $NLA_CACHE, so later processes (every copy,
    every rank) load it without hashing; NLA_VERIFY_CHECKSUMS=always hashes every time, off never."""
    import hashlib
    import os
    import time

    import torch
    from safetensors.torch import save_file

    import nla.util.checkpoint_files as V
    from nla.util.validation import InputError

    monkeypatch.setenv("NLA_CACHE", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    f = ckpt / "model.safetensors"
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(f))
    V.write_checksums(ckpt)
    V._verified.clear()
    V.verify_checksums(ckpt)  # hashes once and records it
    lines = (tmp_path / "cache" / "verified-checksums.jsonl").read_text().splitlines()
    assert len(lines) == 1 and hashlib.sha256(f.read_bytes()).hexdigest() in lines[0]
    (tmp_path / "cache" / "verified-checksums.jsonl").write_text(lines[0] + "\n{torn")  # a writer that died

    def no_hash(*a, **k):
        raise AssertionError("hashed again")

    V._verified.clear()  # a new process
    monkeypatch.setattr(hashlib, "sha256", no_hash)
    V.verify_checksums(ckpt)  # once: the machine's record answers
    monkeypatch.setenv("NLA_VERIFY_CHECKSUMS", "always")
    with pytest.raises(AssertionError, match="hashed again"):
        V.verify_checksums(ckpt)
    monkeypatch.undo()
    monkeypatch.setenv("NLA_CACHE", str(tmp_path / "cache"))
    # a bit flipped in place with the size and mtime kept (issue 58): the write moved the ctime, which no
    # user can set back, so "once" hashes it again and catches it; "always" too
    st = f.stat()
    time.sleep(0.05)  # past the kernel's coarse timestamp tick (a few ms), as any later tampering is
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    V._verified.clear()  # a new process: the machine's record no longer matches the file
    with pytest.raises(InputError, match="SHA-256 differs"):
        V.verify_checksums(ckpt)
    monkeypatch.setenv("NLA_VERIFY_CHECKSUMS", "always")
    with pytest.raises(InputError, match="SHA-256 differs"):
        V.verify_checksums(ckpt)
    monkeypatch.setenv("NLA_VERIFY_CHECKSUMS", "off")
    V.verify_checksums(ckpt)  # off: never hashed
    # a rewrite changes the mtime: "once" hashes it again and catches it
    f.write_bytes(bytes(data))
    monkeypatch.setenv("NLA_VERIFY_CHECKSUMS", "once")
    V._verified.clear()
    with pytest.raises(InputError, match="SHA-256 differs"):
        V.verify_checksums(ckpt)
    monkeypatch.setenv("NLA_VERIFY_CHECKSUMS", "sometimes")
    with pytest.raises(InputError, match="NLA_VERIFY_CHECKSUMS: expected one of once, always, off"):
        V.verify_checksums(ckpt)


# ---------------------------------------------------------------- issue 48: one run per dir, --overwrite
HOLDER = """
import sys, time
from nla.train.rundir import lock_run_dir
lock = lock_run_dir(sys.argv[1], "nla rl --config holder.yaml")
print("locked", flush=True)
time.sleep(600)
"""


def _hold_lock(directory) -> subprocess.Popen:
    """A second process that takes ``directory``'s run lock and keeps it (until killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_and_a_crash_releases_the_lock(pair, capsys, tmp_path, tiny_tokenizer,
                                                                   single_thread):
    """Two ``nla rl`` on one out_dir both ran and both reported success; now the second is refused
    with the holder's pid and command, and the lock ends with the holder, kill -9 included."""
    from train_helpers import dataset_sidecar, write_ar_dataset

    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    ds = write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1), vec)
    holder = _hold_lock(tmp_path / "run")
    try:
        code, lines = cli(capsys, *_ar_train_args(tmp_path, ds))
        assert code == 2
        assert_one_error_line(lines, "train", f"out_dir {tmp_path / 'run'} is in use by another nla run",
                              f"pid {holder.pid}", "`nla rl --config holder.yaml`", "another --out")
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".nla.lock"]  # nothing written
    finally:
        holder.kill()  # SIGKILL: no clean-up runs in the holder
        holder.wait()
    assert cli(capsys, *_ar_train_args(tmp_path, ds, "--max-steps", "2"))[0] == 0
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]


def test_the_lock_is_reentrant_in_a_process_and_given_back(tmp_path):
    from nla.train.rundir import RunDirError, lock_run_dir

    with lock_run_dir(tmp_path / "d", "outer"), lock_run_dir(tmp_path / "d", "inner"):
        probe = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(600)", ""), str(tmp_path / "d")],
                               capture_output=True, text=True)
        assert probe.returncode != 0 and "is in use by another nla run" in probe.stderr and "`outer`" in probe.stderr
    holder = _hold_lock(tmp_path / "d")  # both released: another process takes it
    try:
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            lock_run_dir(tmp_path / "d")
    finally:
        holder.kill()
        holder.wait()


def test_overwrite_deletes_only_what_a_run_wrote_and_never_its_inputs(pair, capsys, tmp_path, tiny_tokenizer,
                                                                       single_thread, caplog):
    """--overwrite removed the whole out_dir (a user's notes and a datagen folder included), and with
    an input inside the old run it deleted it, then failed."""
    import shutil

    from train_helpers import dataset_sidecar, write_ar_dataset

    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    ds = write_ar_dataset(tmp_path / "ar.parquet", dataset_sidecar(tiny_tokenizer, pair["av"], D, 1), vec)
    run = tmp_path / "run"
    assert cli(capsys, *_ar_train_args(tmp_path, ds, "--max-steps", "2"))[0] == 0
    (run / "notes.txt").write_text("my notes")
    (run / "datagen").mkdir()
    (run / "datagen" / "keep.parquet").write_bytes(b"data")
    # an input inside what --overwrite deletes: refused, nothing deleted
    inner = run / "checkpoints" / "step_00000002" / "copy.parquet"
    shutil.copy(ds, inner)
    shutil.copy(str(ds) + ".nla_meta.yaml", str(inner) + ".nla_meta.yaml")
    code, lines = cli(capsys, *_ar_train_args(tmp_path, inner, "--overwrite"))
    assert code == 2
    assert_one_error_line(lines, "train", "--overwrite would delete inputs of this run", f"dataset = {inner}",
                          "another --out")
    assert inner.is_file() and (run / "checkpoints" / "step_00000002" / "model.safetensors").is_file()
    # an input inside out_dir but outside a run's outputs is safe: the run reads its data from datagen/
    data = run / "datagen" / "ar.parquet"
    shutil.copy(ds, data)
    shutil.copy(str(ds) + ".nla_meta.yaml", str(data) + ".nla_meta.yaml")
    with caplog.at_level("WARNING", logger="nla.train.rundir"):
        assert cli(capsys, *_ar_train_args(tmp_path, data, "--overwrite", "--max-steps", "2"))[0] == 0
    assert "deleting the previous run in" in caplog.text
    assert "ar.jsonl" in caplog.text and "checkpoints" in caplog.text
    assert "keeping what a run does not write: datagen, notes.txt" in caplog.text
    assert (run / "notes.txt").read_text() == "my notes" and (run / "datagen" / "keep.parquet").is_file()
    assert data.is_file()
    assert not inner.exists()  # the old checkpoint went, the new run's is there
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]


def test_json_files_nla_reads_back_name_the_file_line_and_fix(tmp_path):
    """Issue 58: a malformed summary, manifest or record was a bare JSONDecodeError naming no file."""
    from nla.datagen.real_sources import read_wikipedia
    from nla.util.validation import InputError, load_json

    f = tmp_path / "summary.json"
    f.write_text('{"a": 1,\n "b": }', encoding="utf-8")
    with pytest.raises(InputError) as err:
        load_json(f, "datagen summary", "delete it")
    assert str(err.value) == f"{f}:2:7: the datagen summary is not valid JSON (Expecting value); delete it"
    f.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(InputError, match=r"the datagen summary should be a JSON object, found list; delete it"):
        load_json(f, "datagen summary", "delete it")
    assert load_json(f, "x", "y", kind=None) == [1, 2]
    f.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(InputError, match=r"summary.json: the datagen summary is not UTF-8 text \(invalid start byte "
                                         r"at byte 7\); delete it"):
        load_json(f, "datagen summary", "delete it")
    with pytest.raises(InputError, match="missing.json: the manifest is missing; run extract"):
        load_json(tmp_path / "missing.json", "manifest", "run extract")
    # a user's Wikipedia file cut short: the error is at column 43, one past its 42 characters
    w = tmp_path / "wiki.json"
    w.write_text('{"Ada": {"extract": "x", "topic": "People"', encoding="utf-8")
    with pytest.raises(InputError, match=r"wiki.json:1:43: the Wikipedia file .* is not valid JSON"):
        read_wikipedia(w)
