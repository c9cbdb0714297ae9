"""Issue 58: what ``nla eval --suite`` refuses or skips before it works: a verbalizer given as
``--subject`` (the causal edits ran on it and reported 0.000), and a dataset whose facts are null on
every row (a traceback). Real checkpoints (a random tiny Llama pair) and real parquets."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_serve import D, build_random_pair
from test_validation import assert_one_error_line, cli

from nla.client import NLAClient, NLAClientError
from nla.core.sidecar import load_sidecar, write_sidecar
from nla.datagen.io import vectors_to_arrow
from nla.eval.suite import run_suite
from nla.eval.suite.run import check_subject_dir

N = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_random_pair(tmp_path_factory.mktemp("suite_inputs"))


def _dataset(path, av_dir, facts):
    vecs = np.random.default_rng(0).standard_normal((N, D)).astype(np.float32) * 3
    pq.write_table(pa.table({
        "activation_vector": vectors_to_arrow(vecs), "doc_id": pa.array(range(N), pa.int64()),
        "position": pa.array([3] * N, pa.int64()), "context": pa.array([f"row {i}" for i in range(N)]),
        "facts": pa.array(facts, pa.list_(pa.string())),
    }), path)
    write_sidecar(path, load_sidecar(av_dir).replace(kind="nla_dataset", role=None))
    return path


def test_a_verbalizer_or_reconstructor_is_no_subject(pair, capsys, tmp_path):
    av, ar = pair
    for ckpt, what in ((av, "a verbalizer (AV) checkpoint"), (ar, "a reconstructor (AR) checkpoint")):
        with pytest.raises(NLAClientError, match=rf"--subject: .* is {re.escape(what)} \(.*nla_meta.yaml, kind "
                                                 r"nla_model\), not the subject model"):
            check_subject_dir(ckpt)
        code, lines = cli(capsys, "eval", "--av", av, "--ar", ar, "--dataset", tmp_path / "d.parquet", "--suite",
                          "causal", "--subject", ckpt)
        assert code == 2
        assert_one_error_line(lines, "eval", f"--subject: {ckpt} is {what}", "Pass the subject's model dir")


def test_all_null_facts_skip_the_truth_parts_instead_of_a_traceback(pair, tmp_path):
    av, ar = pair
    ds = _dataset(tmp_path / "null.parquet", av, [None] * N)
    rep = run_suite(NLAClient(av, ar, device="cpu"), ds, parts=("claims", "directions", "confabulation"),
                    max_new_tokens=4, batch_size=8)
    assert set(rep.sections) == {"claims"}
    assert rep.skipped == {"directions": "facts is null on every row of null.parquet: no ground truth to grade by "
                                         "(no facts to take directions of)",
                           "confabulation": "facts is null on every row of null.parquet: no ground truth to grade by"}
