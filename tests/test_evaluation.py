"""evaluate_pair and the eval/verbalize/score CLI, checked against direct computations.

The AV of ``test_client.Pair`` answers every vector with FIXED_EXPLANATION ("Alice is in the
garden in the morning"), so every number of the report can be recomputed here from the
primitives (client.reconstruct, nla.core.vectors, nla.world.grade).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_client import FIXED_EXPLANATION, NLAClient, nla_pair  # noqa: F401 - nla_pair is a fixture

from nla.cli import main
from nla.core.graders import get_grader
from nla.core.sidecar import write_sidecar
from nla.core.vectors import cosine, fve, predict_mean_baselines
from nla.datagen.explain import row_key
from nla.datagen.io import vectors_to_arrow
from nla.eval.evaluate import evaluate_pair, faithfulness
from nla.world import Fact, TextExplainer, grade

N = 6
FACTS = [
    ["person=alice", "place=garden"],
    ["mood=happy", "time=morning"],
    ["person=alice", "place=garden", "time=morning"],
    ["place=kitchen"],
    [],
    ["person=bruno", "time=night"],
]
REFERENCE = ["Alice is in the garden", "happy in the morning", "Alice", "the kitchen", "nothing yet", "Bob at noon"]


def _dataset(path, nla_pair, with_explanation: bool):  # noqa: F811 - fixture value passed in
    vecs = np.random.default_rng(0).standard_normal((N, 32)).astype(np.float32) * 3
    cols = {
        "activation_vector": vectors_to_arrow(vecs),
        "doc_id": pa.array([10, 10, 11, 12, 13, 13], pa.int64()),
        "position": pa.array([4, 9, 5, 6, 2, 8], pa.int64()),
        "context": pa.array([f"context of row {i}" for i in range(N)]),
        "facts": pa.array(FACTS, pa.list_(pa.string())),
    }
    if with_explanation:
        cols["explanation"] = pa.array(REFERENCE)
    pq.write_table(pa.table(cols), path)
    write_sidecar(path, nla_pair.side.replace(kind="nla_dataset", role=None))
    return path, torch.from_numpy(vecs)


@pytest.fixture(scope="module")
def client(nla_pair):  # noqa: F811
    return NLAClient(nla_pair.av_dir, nla_pair.ar_dir, device="cpu")


def test_report_matches_direct_computation(nla_pair, client, tmp_path):  # noqa: F811
    path, gold = _dataset(tmp_path / "sft.parquet", nla_pair, with_explanation=True)
    t = pq.read_table(path)  # row 5's text read named noon before night fell: its reference's "noon" is stale
    contexts = [f"context of row {i}" for i in range(N - 1)] + ["At noon Bruno slept until the night"]
    pq.write_table(t.set_column(t.column_names.index("context"), "context", pa.array(contexts)), path)
    report = evaluate_pair(client, path, max_new_tokens=14, n_show=3)
    scale = 32**0.5
    assert report.mse_scale == pytest.approx(scale)
    base = predict_mean_baselines(gold, scale)
    assert report.baseline_raw_mean_mse == pytest.approx(base.raw_mean, rel=1e-6)

    # Round trip: the AV says FIXED_EXPLANATION for every row, so predictions are its reconstruction.
    pred = client.reconstruct([FIXED_EXPLANATION] * N)
    rt = report.row("AV → AR round trip")
    assert rt.fve == pytest.approx(fve(pred, gold, scale), abs=1e-5)
    assert rt.cosine == pytest.approx(float(cosine(pred, gold).mean()), abs=1e-5)
    assert rt.failure_rate == 0.0
    # Fact recall by hand: "Alice ... garden ... morning" names {alice, garden, morning}.
    # rows: 2 truths of 2 found -> 1; 1 of 2 (morning) -> .5; 3/3 -> 1; 0/1 -> 0; empty truth -> no recall
    # (nothing holds: issue 58, it was graded 1); 0/2 -> 0.
    assert rt.faithfulness.recall == pytest.approx((1 + 0.5 + 1 + 0 + 0) / 5)
    # precision = correct / 3 named: 2/3, 1/3, 3/3, 0, 0 (claims facts where none hold), 0.
    assert rt.faithfulness.precision == pytest.approx((2 / 3 + 1 / 3 + 1 + 0 + 0 + 0) / 6)
    assert rt.faithfulness.n == 5 and "1 of 6 rows have no fact that holds (facts [])" in rt.faithfulness.note
    # The AV ignores its vector here, so the shuffled row has exactly the same numbers.
    sh = report.row("AV on shuffled vectors → AR")
    assert sh.fve == pytest.approx(rt.fve, abs=1e-6)

    ref = report.row("AR on reference explanations")
    ref_pred = client.reconstruct(REFERENCE)
    assert ref.fve == pytest.approx(fve(ref_pred, gold, scale), abs=1e-5)
    assert ref.cosine == pytest.approx(float(cosine(ref_pred, gold).mean()), abs=1e-5)
    mse = ((ref_pred / ref_pred.norm(dim=-1, keepdim=True) - gold / gold.norm(dim=-1, keepdim=True)) ** 2).sum(-1)
    assert ref.mse_p50 == pytest.approx(float(np.quantile(mse.numpy(), 0.5)), rel=1e-4)
    truths = [[Fact.parse(s) for s in f] for f in FACTS]
    assert ref.faithfulness.recall == pytest.approx(np.mean([grade(t, f).recall for t, f in zip(REFERENCE, truths, strict=True)
                                                             if f]))
    assert ref.faithfulness.by_kind["person"][0] == pytest.approx((1 + 1 + 0) / 3)  # rows 0, 2, 5
    # time claimed twice: morning (row 1, true), noon (row 5: false, but its text read named it) -> 1 of 2 said earlier
    assert ref.faithfulness.said["time"] == (2, 0.5) and ref.faithfulness.stale["time"] == 0.5
    assert ref.faithfulness.stale["person"] == 0.0  # Alice twice, both true

    mean_raw = report.row("predict the mean (raw)")
    assert mean_raw.fve == pytest.approx(0.0, abs=1e-6)
    assert report.row("predict the mean (normalised)").mse_mean == pytest.approx(base.normalized_mean, rel=1e-5)
    # The dataset's explanation column *is* the text explainer: no duplicate row.
    assert "text explainer → AR" not in [r.name for r in report.rows]
    assert len(report.samples) == 3 and report.samples[0].facts == FACTS[report.samples[0].row]

    js = json.loads(report.to_json())
    assert js["rows"][0]["name"] == "AV → AR round trip"
    md = report.to_markdown()
    assert "| AR on reference explanations |" in md and "Fact recall / precision by kind" in md
    assert "(and the share false but said earlier in the text read" in md and "time 2 (0.50; 0.50 earlier)" in md


def test_frozen_ar_row_and_degeneracy(nla_pair, client, tmp_path):  # noqa: F811
    import copy

    path, gold = _dataset(tmp_path / "sft.parquet", nla_pair, with_explanation=True)
    other = copy.deepcopy(nla_pair.ar)
    with torch.no_grad():  # a different reader: rotate the head's output by a fixed permutation
        other.value_head.weight.copy_(other.value_head.weight[torch.randperm(32, generator=torch.Generator().manual_seed(1))])
    frozen = NLAClient.from_models(ar=other)
    report = evaluate_pair(client, path, max_new_tokens=14, n_show=0, frozen_ar=frozen)
    names = [r.name for r in report.rows]
    assert names[:2] == ["AV → AR round trip", "AV → frozen warm-start AR"]
    # The frozen AR reads the same explanation (FIXED_EXPLANATION on every row) with its own weights.
    row = report.row("AV → frozen warm-start AR")
    assert row.fve == pytest.approx(fve(frozen.reconstruct([FIXED_EXPLANATION] * N), gold, 32**0.5), abs=1e-5)
    assert row.fve != pytest.approx(report.row("AV → AR round trip").fve, abs=1e-3)
    # Same texts, so the same faithfulness; FIXED_EXPLANATION has no full stop and is not a sentence of
    # the world's explanation language: every row is degenerate (outside the language), none repeated.
    assert row.faithfulness == report.row("AV → AR round trip").faithfulness
    assert row.degenerate == {"any": 1.0, "repeated": 0.0, "broken_quote": 0.0, "outside_language": 1.0}
    assert "| AV → frozen warm-start AR |" in report.to_markdown() and "| degenerate |" in report.to_markdown()
    # The reference explanations are not world sentences either ("Alice is in the garden").
    assert report.row("AR on reference explanations").degenerate["outside_language"] == 1.0


def test_frozen_ar_that_is_the_pair_s_own_reuses_its_reading(nla_pair, client, tmp_path):  # noqa: F811
    """Before RL the frozen reader is the pair's AR: passing the client itself gives the row a second,
    separately loaded copy of that AR would give, without reading the texts again."""
    import copy

    path, _ = _dataset(tmp_path / "sft.parquet", nla_pair, with_explanation=True)
    same = evaluate_pair(client, path, max_new_tokens=14, n_show=0, frozen_ar=client)
    copy_reader = NLAClient.from_models(ar=copy.deepcopy(nla_pair.ar))
    reread = evaluate_pair(client, path, max_new_tokens=14, n_show=0, frozen_ar=copy_reader)
    a, b = same.row("AV → frozen warm-start AR"), reread.row("AV → frozen warm-start AR")
    assert a.fve == pytest.approx(b.fve, abs=1e-6) and a.mse_mean == pytest.approx(b.mse_mean, abs=1e-6)
    assert a.faithfulness == b.faithfulness and a.degenerate == b.degenerate
    assert a.fve == same.row("AV → AR round trip").fve
    assert [r.name for r in same.rows] == [r.name for r in reread.rows]


def test_oracle_row_reads_every_true_fact(nla_pair, client, tmp_path):  # noqa: F811
    from nla.world.explain import oracle_explanation

    path, gold = _dataset(tmp_path / "rl.parquet", nla_pair, with_explanation=False)
    t = pq.read_table(path)
    words = ["the garden", "morning,", "was", "kitchen", "", "night"]
    t = t.set_column(t.column_names.index("context"), "context", pa.array([f"Once upon a time {w}" for w in words]))
    pq.write_table(t.append_column("text_end", pa.array(words)), path)
    report = evaluate_pair(client, path, max_new_tokens=14, n_show=0)
    row = report.row("oracle: every true fact → AR")
    texts = [oracle_explanation([Fact.parse(f) for f in fs], w, i) for i, (fs, w) in enumerate(zip(FACTS, words, strict=True))]
    assert texts[0].startswith('The text ends with "the garden". ') and texts[4] in (
        "This is the start of a story.", "The text has only just begun.", "Nothing specific has been said yet.",
        "A new story is beginning.")  # no facts, nothing to quote: a generic remark
    assert row.fve == pytest.approx(fve(client.reconstruct(texts), gold, 32**0.5), abs=1e-5)
    # it names every true fact and nothing else: recall 1 and precision 1 on every row
    assert row.faithfulness.recall == 1.0 and row.faithfulness.precision == 1.0
    assert row.degenerate["any"] == 0.0
    # ... and quotes the text's end exactly: every unit true, at every position. Units per row: "the
    # garden" 2, "morning ," 2, "was" 1, "kitchen" 1, "" 0 (nothing to quote), "night" 1
    q = row.faithfulness.quote
    assert (q.n, q.said, q.exact, q.all_true) == (6, 5 / 6, 1.0, 1.0)
    assert q.by_position == {"quote[0]": (1.0, 1.0), "quote[1]": (1.0, 1.0)}
    assert q.claims == {"quote[0]": 5, "quote[1]": 2}
    # the AV's fixed explanation quotes nothing: not said (recall 0) on every row with an end, no precision
    rt = report.row("AV → AR round trip").faithfulness.quote
    assert (rt.said, rt.exact, rt.all_true) == (0.0, 0.0, None)
    assert rt.by_position == {"quote[0]": (0.0, None), "quote[1]": (0.0, None)}
    md = report.to_markdown()
    assert "## Quotation of the text's end, unit by unit" in md
    assert "| oracle: every true fact → AR | 0.83 | 1.00 | 1.00 | 1.00 / 1.00 | 1.00 / 1.00 |" in md
    d = report.to_dict()["rows"]
    assert d[0]["faithfulness"]["quote"]["by_position"]["quote[0]"] == [0.0, None]


def test_oracle_and_text_explainer_quote_as_many_units_as_the_datagen_setting(nla_pair, client, tmp_path):  # noqa: F811
    """world_explainer.quote_units = 1: the data explainer and the oracle quote the token read only, and the
    quotation is graded against the end cut by the same rule: quote[0] said and true, nothing else a target."""
    import yaml

    from nla.world.explain import oracle_explanation

    path, _ = _dataset(tmp_path / "rl.parquet", nla_pair, with_explanation=False)
    words = ["the garden", "morning,", "was", "kitchen", "", "night"]
    t = pq.read_table(path)
    t = t.set_column(t.column_names.index("context"), "context", pa.array([f"Once upon a time {w}" for w in words]))
    pq.write_table(t.append_column("text_end", pa.array(words)), path)
    cfg = tmp_path / "datagen_config.yaml"
    cfg.write_text(yaml.safe_dump({"out_dir": str(tmp_path), "world_explainer": {"quote_units": 1}}))
    write_sidecar(path, nla_pair.side.replace(kind="nla_dataset", role=None), datagen_config=str(cfg))
    report = evaluate_pair(client, path, max_new_tokens=14, n_show=0)
    oracle = report.row("oracle: every true fact → AR").faithfulness.quote
    # graded against the end cut by the same rule (issue 57): every quotation is exactly the cut end
    # (garden, ",", was, kitchen, night; the empty end quotes nothing), and no unit before the token
    # read is a recall target, so quote[1] has no row
    assert (oracle.n, oracle.said, oracle.exact, oracle.all_true) == (6, 5 / 6, 1.0, 1.0)
    assert oracle.by_position == {"quote[0]": (1.0, 1.0)}
    te = report.row("text explainer → AR").faithfulness.quote
    assert te.by_position == oracle.by_position
    assert oracle_explanation([], "garden", 0).startswith('The text ends with "garden".')


def test_text_explainer_baseline_on_rl_split(nla_pair, client, tmp_path):  # noqa: F811
    path, gold = _dataset(tmp_path / "rl.parquet", nla_pair, with_explanation=False)
    report = evaluate_pair(client, path, max_new_tokens=14, n_show=0)
    # No datagen config in the sidecar provenance: the TextExplainer defaults (seed 0).
    docs, pos = [10, 10, 11, 12, 13, 13], [4, 9, 5, 6, 2, 8]
    te = TextExplainer(seed=0)
    texts = [te.explain(frozenset(Fact.parse(s) for s in f), row_key(d, p)) for f, d, p in zip(FACTS, docs, pos, strict=True)]
    row = report.row("text explainer → AR")
    assert row.fve == pytest.approx(fve(client.reconstruct(texts), gold, 32**0.5), abs=1e-5)
    # the text read ("context of row i") names no fact: nothing claimed was said earlier
    assert row.faithfulness == faithfulness(texts, FACTS, get_grader("world"), earlier=[frozenset()] * N)
    assert set(row.faithfulness.stale.values()) == {0.0}
    assert "AR on reference explanations" not in [r.name for r in report.rows]


def test_max_rows_and_errors(nla_pair, client, tmp_path):  # noqa: F811
    path, _ = _dataset(tmp_path / "d.parquet", nla_pair, with_explanation=True)
    small = evaluate_pair(NLAClient.from_models(ar=nla_pair.ar), path, max_rows=3, n_show=2)
    assert small.n_rows == 3 and "AV → AR round trip" not in [r.name for r in small.rows]
    assert small.samples[0].status == "not verbalized (no AV)"
    no_side = tmp_path / "bare.parquet"
    pq.write_table(pq.read_table(path), no_side)
    with pytest.raises(FileNotFoundError, match="has no sidecar bare.parquet.nla_meta.yaml"):
        evaluate_pair(client, no_side)
    wide = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(np.ones((3, 16), np.float32))}), wide)
    write_sidecar(wide, nla_pair.side.replace(kind="nla_dataset", role=None, d_model=16))
    with pytest.raises(ValueError, match="d=16 vectors but the checkpoints' sidecar says d_model=32"):
        evaluate_pair(client, wide)
    with pytest.raises(ValueError, match="no reconstructor"):
        evaluate_pair(NLAClient.from_models(nla_pair.av_model, nla_pair.tok, nla_pair.side), path)
    bad = tmp_path / "badfacts.parquet"
    t = pq.read_table(path)
    t = t.set_column(t.column_names.index("facts"), "facts", pa.array([["colour=red"]] * N, pa.list_(pa.string())))
    pq.write_table(t, bad)
    write_sidecar(bad, nla_pair.side.replace(kind="nla_dataset", role=None))
    with pytest.raises(ValueError, match="facts: row 0"):
        evaluate_pair(NLAClient.from_models(ar=nla_pair.ar), bad)


@pytest.mark.slow
def test_cli_eval_verbalize_score(nla_pair, tmp_path, capsys):  # noqa: F811
    path, gold = _dataset(tmp_path / "d.parquet", nla_pair, with_explanation=True)
    av, ar = str(nla_pair.av_dir), str(nla_pair.ar_dir)
    out = tmp_path / "eval"
    assert main(["eval", "--av", av, "--ar", ar, "--dataset", str(path), "--max-rows", "4", "--out", str(out),
                 "--max-new-tokens", "14", "--device", "cpu", "--frozen-ar", ar]) == 0
    printed = capsys.readouterr().out
    assert "| AV → AR round trip |" in printed and "| AV → frozen warm-start AR |" in printed
    rows = {r["name"]: r for r in json.loads((out / "eval.json").read_text())["rows"]}
    # the same AR as the live one: the frozen reader's numbers are the round trip's
    assert rows["AV → frozen warm-start AR"]["fve"] == pytest.approx(rows["AV → AR round trip"]["fve"], abs=1e-6)
    assert json.loads((out / "eval.json").read_text())["n_rows"] == 4 and (out / "eval.md").is_file()

    np.save(tmp_path / "v.npy", gold.numpy())
    jl = tmp_path / "v.jsonl"
    assert main(["verbalize", "--av", av, "--vectors", str(tmp_path / "v.npy"), "--rows", "3", "--out", str(jl),
                 "--max-new-tokens", "14", "--device", "cpu"]) == 0
    rows = [json.loads(x) for x in jl.read_text().splitlines()]
    assert [r["row"] for r in rows] == [0, 1, 2] and rows[0]["explanation"] == FIXED_EXPLANATION

    scores = tmp_path / "s.jsonl"
    assert main(["score", "--ar", ar, "--texts", str(jl), "--vectors", str(path), "--rows", "3",
                 "--out", str(scores), "--device", "cpu"]) == 0
    summary = json.loads(capsys.readouterr().out)
    pred = NLAClient(None, ar, device="cpu").reconstruct([FIXED_EXPLANATION] * 3)
    direct = float(cosine(pred, gold[:3]).mean())
    assert summary["rows"] == 3 and summary["cosine_mean"] == pytest.approx(direct, abs=1e-5)
    assert len(scores.read_text().splitlines()) == 3
    assert main(["score", "--ar", ar, "--dataset", str(path), "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["failure_rate"] == 0.0


def test_text_explainer_baseline_follows_the_datagen_explainer(nla_pair, client, tmp_path):  # noqa: F811
    """The baseline row re-explains with the data's own explainer settings, fact_rate included."""
    import yaml

    path, gold = _dataset(tmp_path / "rl.parquet", nla_pair, with_explanation=False)
    cfg = tmp_path / "datagen_config.yaml"
    cfg.write_text(yaml.safe_dump({"out_dir": str(tmp_path), "seed": 3,
                                   "world_explainer": {"fact_rate": 0.6, "wrong_rate": 0.0}}))
    write_sidecar(path, nla_pair.side.replace(kind="nla_dataset", role=None), datagen_config=str(cfg))
    report = evaluate_pair(client, path, max_new_tokens=14, n_show=0)
    docs, pos = [10, 10, 11, 12, 13, 13], [4, 9, 5, 6, 2, 8]
    te = TextExplainer(seed=3, wrong_rate=0.0, fact_rate=0.6)
    texts = [te.explain(frozenset(Fact.parse(s) for s in f), row_key(d, p)) for f, d, p in zip(FACTS, docs, pos, strict=True)]
    assert texts != [TextExplainer(seed=3, wrong_rate=0.0).explain(frozenset(Fact.parse(s) for s in f), row_key(d, p))
                     for f, d, p in zip(FACTS, docs, pos, strict=True)]  # the rule matters on these rows
    row = report.row("text explainer → AR")
    assert row.fve == pytest.approx(fve(client.reconstruct(texts), gold, 32**0.5), abs=1e-5)
    assert row.faithfulness == faithfulness(texts, FACTS, get_grader("world"), earlier=[frozenset()] * N)
def test_text_diversity_by_hand():
    from nla.eval.evaluate import text_diversity

    # 4 rows: "a" twice, "b", one failure (None): 3 distinct texts of 4 rows; "a" on 2 of 4
    assert text_diversity(["a", "a", "b", None]) == {"distinct": 0.75, "top_share": 0.5}
    assert text_diversity(["same"] * 5) == {"distinct": 0.2, "top_share": 1.0}  # a memorised explanation
    assert text_diversity([]) == {"distinct": 0.0, "top_share": 0.0}
