"""Issue 58: ``nla score --texts`` pairs each explanation with the vector its ``row`` names (the field
``nla verbalize`` writes), not with the vector at its line number, and drops a UTF-8 byte-order mark.

Real files and a real AR (a random tiny Llama saved by nla's writers), through the CLI.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_serve import D, build_random_pair
from test_validation import assert_one_error_line, cli

TEXTS = ["the cat sat", "a dog ran far", "rain on the roof", "she read a book"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_random_pair(tmp_path_factory.mktemp("score_rows"))


def _scores(path) -> dict[int, float]:
    return {r["row"]: r["mse_nrm"] for r in map(json.loads, path.read_text().splitlines())}


def test_jsonl_rows_pair_explanations_with_their_vectors(pair, capsys, tmp_path):
    vecs = np.random.default_rng(0).standard_normal((4, D)).astype(np.float32) * 3
    np.save(tmp_path / "v.npy", vecs)
    ordered = tmp_path / "ordered.jsonl"
    ordered.write_text("".join(json.dumps({"row": i, "status": "completed", "explanation": t}) + "\n"
                               for i, t in enumerate(TEXTS)))
    shuffled = tmp_path / "shuffled.jsonl"  # sorted by something else after verbalize; a BOM in front
    order = [2, 0, 3, 1]
    shuffled.write_bytes(b"\xef\xbb\xbf" + "".join(
        json.dumps({"row": i, "status": "completed", "explanation": TEXTS[i]}) + "\n" for i in order).encode())
    for src, out in ((ordered, "a.jsonl"), (shuffled, "b.jsonl")):
        code, lines = cli(capsys, "score", "--ar", pair[1], "--texts", src, "--vectors", tmp_path / "v.npy",
                          "--out", tmp_path / out, "--device", "cpu")
        assert code == 0, lines
    a, b = _scores(tmp_path / "a.jsonl"), _scores(tmp_path / "b.jsonl")
    assert sorted(b) == [0, 1, 2, 3]
    assert b == pytest.approx(a, rel=1e-6)  # each explanation scored against its own vector, wherever its line is
    # without the rows, line i goes with vector i: the shuffled file gives other numbers
    no_rows = tmp_path / "no_rows.jsonl"
    no_rows.write_text("".join(json.dumps({"explanation": TEXTS[i]}) + "\n" for i in order))
    assert cli(capsys, "score", "--ar", pair[1], "--texts", no_rows, "--vectors", tmp_path / "v.npy", "--out",
               tmp_path / "c.jsonl", "--device", "cpu")[0] == 0
    assert _scores(tmp_path / "c.jsonl")[0] != pytest.approx(a[0], rel=1e-3)


def test_a_bom_stays_out_of_the_first_explanation(tmp_path):
    from nla.commands.score import read_texts_and_rows

    txt = tmp_path / "e.txt"
    txt.write_bytes(b"\xef\xbb\xbfthe cat sat\nrain\n")
    assert read_texts_and_rows(str(txt)) == (["the cat sat", "rain"], None)
    js = tmp_path / "e.jsonl"
    js.write_bytes(b"\xef\xbb\xbf" + json.dumps({"row": 1, "explanation": "x"}).encode() + b"\n")
    assert read_texts_and_rows(str(js)) == (["x"], [1])


@pytest.mark.parametrize("lines, message", [
    ([{"row": 0, "explanation": "a"}, {"explanation": "b"}], "line 2 has no 'row' field and line 1 has one"),
    ([{"row": -1, "explanation": "a"}], "line 1: 'row' must be a vector's row number (an integer >= 0), found -1"),
    ([{"row": 9, "explanation": "a"}], "'row' 9 names no vector"),
])
def test_bad_rows_are_refused(pair, capsys, tmp_path, lines, message):
    np.save(tmp_path / "v.npy", np.ones((2, D), dtype=np.float32))
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out = cli(capsys, "score", "--ar", pair[1], "--texts", src, "--vectors", tmp_path / "v.npy")
    assert code == 2
    assert_one_error_line(out, "score", message)
