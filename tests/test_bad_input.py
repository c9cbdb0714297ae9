"""Bad input found by a hostile-user probe of the CLI (issue 21, third pass): each case builds its
input, asserts exit 2 with one error line naming the culprit (or the correct result) and that nothing
was written."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_validation import D, _ar_train_args, assert_one_error_line, cli, pair  # noqa: F401 - pair is a fixture
from train_helpers import dataset_sidecar, write_ar_dataset, write_av_dataset

from nla.core.sidecar import write_sidecar


@pytest.fixture
def ar_data(pair, tmp_path, tiny_tokenizer):  # noqa: F811
    """An AR dataset of 8 rows (its sidecar matches the pair) and its sidecar."""
    side = dataset_sidecar(tiny_tokenizer, pair["av"], D, 1)
    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    return write_ar_dataset(tmp_path / "ar.parquet", side, vec), side, vec


def test_training_on_no_rows_one_row_or_one_direction_is_refused(ar_data, tmp_path, capsys):
    path, side, vec = ar_data
    cases = {"empty": vec[:0], "one": vec[:1], "same": np.repeat(vec[:1], 8, 0) * np.arange(1, 9)[:, None]}
    for name, v in cases.items():
        ds = write_ar_dataset(tmp_path / f"{name}.parquet", side, v.astype(np.float32)) if len(v) else None
        if ds is None:
            ds = tmp_path / "empty.parquet"
            pq.write_table(pq.read_table(path).slice(0, 0), ds)
            write_sidecar(ds, side)
        code, lines = cli(capsys, *_ar_train_args(tmp_path, ds))
        assert code == 2, (name, lines)
        want = "the table has no rows" if name == "empty" else "have no spread after normalisation"
        assert_one_error_line(lines, "train", str(ds), want)
        assert not (tmp_path / "run" / "checkpoints").exists()


def test_eval_refuses_vectors_of_one_direction_and_score_leaves_fve_null(pair, ar_data, tmp_path, capsys):  # noqa: F811
    _, side, vec = ar_data
    same = write_ar_dataset(tmp_path / "same.parquet", side, (np.repeat(vec[:1], 4, 0) * 2).astype(np.float32))
    code, lines = cli(capsys, "eval", "--ar", pair["ar"], "--dataset", same, "--out", tmp_path / "ev", "--device", "cpu")
    assert code == 2 and not (tmp_path / "ev").exists()
    assert_one_error_line(lines, "eval", f"dataset {same}: the 4 gold vector(s) have no spread")
    (tmp_path / "t.txt").write_text("a\nb\nc\nd\n")
    assert main_json(capsys, "score", "--ar", pair["ar"], "--texts", tmp_path / "t.txt", "--vectors", same,
                     "--device", "cpu")["fve_completed_rows"] is None


def main_json(capsys, *argv):
    from nla.cli import main

    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_thread_count_torch_cannot_start_is_refused(capsys):
    from nla.util.threads import apply_threads, max_threads

    code, lines = cli(capsys, "train", "ar", "--set", "dataset=d.parquet", "--threads", "99999")
    assert code == 2 and f"expected at most {max_threads()}" in lines[-1] and "found 99999" in lines[-1]
    with pytest.raises(ValueError, match=rf"threads: 5000 is more than 4 x the {os.cpu_count()} cores"):
        apply_threads(5000)
    assert max_threads() == max(8, 4 * os.cpu_count())


def test_a_micro_batch_that_does_not_divide_the_eval_rows_trains_and_saves(ar_data, tmp_path, capsys):
    """4 held-out rows, eval_max_rows 2, micro-batches of 3: the eval took 3 predictions for 2 golds."""
    path, _, _ = ar_data
    code, lines = cli(capsys, *_ar_train_args(tmp_path, path, "--set", "micro_batch_size=3", "--set",
                                              "eval_fraction=0.5", "--set", "eval_max_rows=2", "--set", "eval_every=1"))
    assert code == 0, lines
    assert (tmp_path / "run" / "checkpoints" / "step_00000004").is_dir()


def test_an_av_dataset_given_to_the_ar_names_the_column(pair, tmp_path, tiny_tokenizer, capsys):  # noqa: F811
    side = dataset_sidecar(tiny_tokenizer, pair["av"], D, 1)
    vec = np.random.default_rng(0).standard_normal((8, D)).astype(np.float32)
    av = write_av_dataset(tmp_path / "av.parquet", side, vec, ["x"] * 8)
    code, lines = cli(capsys, *_ar_train_args(tmp_path, av))
    assert code == 2
    assert_one_error_line(lines, "train", f"dataset {av}: column 'prompt' row 0 holds list", "ar_sft parquet")


def test_unreadable_inputs_are_named(pair, ar_data, tmp_path, capsys):  # noqa: F811
    path, side, vec = ar_data
    good = tmp_path / "good.parquet"
    shutil.copy(path, good)
    write_sidecar(good, side)
    # texts that are not UTF-8: the line is named
    (tmp_path / "bin.txt").write_bytes(b"a\nb\xff\xfe\nc\nd\ne\nf\ng\nh\n")
    code, lines = cli(capsys, "score", "--ar", pair["ar"], "--texts", tmp_path / "bin.txt", "--vectors", good)
    assert code == 2 and assert_one_error_line(lines, "score", "bin.txt: line 2 is not UTF-8 text (byte 0xff")
    # a null inside a vector
    nulls = tmp_path / "nulls.parquet"
    rows = [list(map(float, r)) for r in vec]
    rows[1] = [None] * D
    pq.write_table(pa.table({"activation_vector": pa.array(rows, pa.list_(pa.float32()))}), nulls)
    code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", nulls, "--device", "cpu")
    assert code == 2 and assert_one_error_line(lines, "verbalize", "row 1 has a null entry (position 0)")
    # no rows at all
    np.save(tmp_path / "empty.npy", np.zeros((0, D), np.float32))
    code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", tmp_path / "empty.npy", "--out",
                      tmp_path / "e.jsonl", "--device", "cpu")
    assert code == 2 and not (tmp_path / "e.jsonl").exists()
    assert_one_error_line(lines, "verbalize", "empty.npy has no rows")
    # a directory where a parquet file belongs
    code, lines = cli(capsys, *_ar_train_args(tmp_path, tmp_path))
    assert code == 2 and assert_one_error_line(lines, "train", f"{tmp_path}: is a directory, expected a .parquet")
    # a damaged tokenizer.json
    bad = tmp_path / "badtok"
    shutil.copytree(pair["av"], bad)
    (bad / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    code, lines = cli(capsys, "verbalize", "--av", bad, "--vectors", good, "--device", "cpu")
    assert code == 2 and assert_one_error_line(lines, "verbalize", f"{bad}: the tokenizer cannot be loaded",
                                               "tokenizer.json")
    # a checkpoint's config.json given for the directory
    code, lines = cli(capsys, "verbalize", "--av", pair["av"] / "config.json", "--vectors", good)
    assert code == 2 and assert_one_error_line(lines, "verbalize", "config.json is a file, expected the checkpoint")


def test_a_truncated_training_state_is_named_on_resume(ar_data, tmp_path, capsys):
    path, _, _ = ar_data
    assert cli(capsys, *_ar_train_args(tmp_path, path, "--set", "stop_after_steps=2"))[0] == 0
    state = tmp_path / "run" / "checkpoints" / "step_00000002" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    code, lines = cli(capsys, *_ar_train_args(tmp_path, path, "--resume"))
    assert code == 2
    assert_one_error_line(lines, "train", f"{state}: not a readable training state", "truncated or damaged")


def test_a_copied_run_resumes(ar_data, tmp_path, capsys):
    path, _, _ = ar_data
    assert cli(capsys, *_ar_train_args(tmp_path, path, "--set", "stop_after_steps=2"))[0] == 0
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    args = [a if a != tmp_path / "run" else tmp_path / "copy" for a in _ar_train_args(tmp_path, path, "--resume")]
    code, lines = cli(capsys, *args)
    assert code == 0, lines
    assert (tmp_path / "copy" / "checkpoints" / "step_00000004").is_dir()


def test_blank_explanations_are_failed_samples_and_outputs_get_the_umask_mode(pair, ar_data, tmp_path,  # noqa: F811
                                                                               capsys):
    path, _, _ = ar_data
    (tmp_path / "t.txt").write_text("a\n\n  \nb\nc\nd\ne\nf\n")
    out = tmp_path / "rows.jsonl"
    summary = main_json(capsys, "score", "--ar", pair["ar"], "--texts", tmp_path / "t.txt", "--vectors", path,
                        "--out", out, "--device", "cpu")
    assert summary["failure_rate"] == 2 / 8
    assert [json.loads(ln)["failed"] for ln in out.read_text().splitlines()][:4] == [False, True, True, False]
    mask = os.umask(0o022)
    os.umask(mask)
    assert (out.stat().st_mode & 0o777) == 0o666 & ~mask


def test_a_dataset_sidecar_that_contradicts_its_data_is_refused(pair, ar_data, tmp_path, capsys):  # noqa: F811
    path, side, _ = ar_data
    for name, wrong in (("width", side.replace(d_model=D * 2)), ("kind", side.replace(kind="nla_model", role="ar"))):
        ds = tmp_path / f"{name}.parquet"
        shutil.copy(path, ds)
        write_sidecar(ds, wrong)
        code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", ds, "--device", "cpu")
        assert code == 2
        want = f"d_model {D * 2}, but {ds} holds {D}-d vectors" if name == "width" else "is a checkpoint's sidecar"
        assert_one_error_line(lines, "verbalize", want)


def test_warmup_longer_than_a_short_run_says_what_to_set(capsys, tmp_path):
    code, lines = cli(capsys, "train", "ar", "--set", "dataset=d.parquet", "--max-steps", "2", "--out", tmp_path / "r")
    assert code == 2
    assert_one_error_line(lines, "train", "warmup_steps", "--set warmup_steps=0")


def test_rl_refuses_more_prompts_per_step_than_the_dataset_holds(pair, ar_data, tmp_path, capsys):  # noqa: F811
    path, _, _ = ar_data
    run = tmp_path / "rl"
    code, lines = cli(capsys, "rl", "--av", pair["av"], "--ar", pair["ar"], "--dataset", path, "--out", run,
                      "--set", "rollout.rollout_batch_size=100000", "--set", "device=cpu")
    assert code == 2 and not run.exists()
    assert_one_error_line(lines, "rl", "rollout.rollout_batch_size: 100000 prompts per step", "holds 8 rows")



def test_a_max_length_too_short_for_the_ar_tail_is_named_as_the_cause(pair, ar_data, tmp_path, capsys):  # noqa: F811
    path, side, _ = ar_data
    need = len(side.critic_suffix_ids) + 1
    code, lines = cli(capsys, *_ar_train_args(tmp_path, path, "--set", f"max_length={need - 1}"))
    assert code == 2 and not (tmp_path / "run" / "checkpoints").exists()
    assert_one_error_line(lines, "train", f"max_length: {need - 1} tokens cannot hold the AR template's constant tail",
                          f"at least {need}")
    run = tmp_path / "rl"
    code, lines = cli(capsys, "rl", "--av", pair["av"], "--ar", pair["ar"], "--dataset", path, "--out", run,
                      "--set", "rollout.rollout_batch_size=2", "--set", "reconstructor.max_length=2",
                      "--set", "device=cpu")
    assert code == 2 and not run.exists()
    assert_one_error_line(lines, "rl", "reconstructor.max_length: 2 tokens cannot hold")


# Issue 48: a missing --subject, and sample counts bounded before any decoding.
def test_a_missing_or_non_model_subject_is_an_error_naming_the_flag(pair, ar_data, tmp_path, capsys):  # noqa: F811
    ds = ar_data[0]
    base = ["eval", "--av", pair["av"], "--ar", pair["ar"], "--dataset", ds, "--suite", "causal", "--device", "cpu",
            "--out", tmp_path / "ev"]
    code, lines = cli(capsys, *base, "--subject", tmp_path / "missing")
    assert code == 2 and not (tmp_path / "ev").exists()
    assert lines == [f"nla eval: error: --subject: no directory at {tmp_path / 'missing'}; check the path"]
    (tmp_path / "empty").mkdir()
    code, lines = cli(capsys, *base, "--subject", tmp_path / "empty")
    assert code == 2 and lines == [f"nla eval: error: --subject: {tmp_path / 'empty'} has no config.json; it is not a "
                                   "Hugging Face model directory"]
    code, lines = cli(capsys, "eval", "--ar", pair["ar"], "--dataset", ds, "--subject", pair["av"])  # no --suite
    assert code == 2 and lines == ["nla eval: error: --subject: only the suite's causal edits read a subject; add "
                                   "--suite causal (or --suite)"]


def test_sample_counts_are_bounded_before_any_work(pair, ar_data, tmp_path, capsys, monkeypatch):  # noqa: F811
    from nla.client import NLAClient, NLAClientError
    from nla.util.validation import MAX_SAMPLES_PER_VECTOR

    assert MAX_SAMPLES_PER_VECTOR == 1024
    code, lines = cli(capsys, "eval", "--av", pair["av"], "--ar", pair["ar"], "--dataset", ar_data[0], "--suite",
                      "best_of", "--best-of", "1,100000", "--out", tmp_path / "ev")
    assert code == 2 and not (tmp_path / "ev").exists()
    assert lines == ["nla eval: error: --best-of: expected comma-separated sample counts in 1..1024 such as 1,4,8 "
                     "(every sample of a vector is decoded in one batch), found '1,100000'"]
    # without --suite it was ignored (the run then evaluated without it, exit 0): an error now
    code, lines = cli(capsys, "eval", "--av", pair["av"], "--ar", pair["ar"], "--dataset", ar_data[0], "--best-of",
                      "100000", "--out", tmp_path / "ev")
    assert code == 2 and not (tmp_path / "ev").exists()
    assert lines == ["nla eval: error: --best-of: only the suite's best_of part decodes best-of-N; add --suite "
                     "best_of (or --suite)"]
    code, lines = cli(capsys, "verbalize", "--av", pair["av"], "--vectors", pair["root"] / "good.npy", "--sample",
                      "--n-samples", "1025")
    assert code == 2 and lines[-1] == ("nla verbalize: error: argument --n-samples: expected a sample count in "
                                       "1..1024 per vector (every sample of a vector is decoded in one batch), found "
                                       "1025; see nla verbalize --help")
    client = NLAClient(pair["av"], pair["ar"], device="cpu")
    with pytest.raises(NLAClientError, match=r"^best_of: expected a sample count in 1..1024 per vector .* found "
                                             r"100000; ask for fewer samples$"):
        client.verbalize(pair["good"], greedy=False, best_of=100000)
    # Under the cap, the decode batch's KV cache and logits are compared with the memory free now.
    import nla.train.health as health

    monkeypatch.setattr(health, "available_memory", lambda device: 2**20)  # 1 MiB free
    with pytest.raises(NLAClientError, match=r"^verbalize: n_samples=512 decodes 4 x 512 = 2048 sequences at once, "
                                             r"which needs at least \d+\.\d GiB \(KV cache and logits\) and 0.0 GiB is "
                                             r"free; ask for fewer samples, a smaller batch_size \(--batch-size\) or "
                                             r"fewer max_new_tokens$"):
        client.verbalize(pair["good"], greedy=False, n_samples=512)
    monkeypatch.setattr(health, "available_memory", lambda device: 2**40)
    assert len(client.verbalize(pair["good"][:1], greedy=False, n_samples=2, max_new_tokens=2)) == 2
