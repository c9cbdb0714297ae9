"""nla explore: the JSON API in-process (every bad input), the run view, and one real browser session.

The pair is test_client's tiny AV (trained to answer every vector with one fixed explanation)
and its AR, at layer K=1, d=32. The subject is the conftest tiny Llama placed inside a world
build directory, so the explorer offers the world's held-out documents with ground truth.
Expected numbers come from direct calls: a forward pass with ``output_hidden_states`` for the
activations, ``NLAClient.score`` for the scores, ``nla.world`` for facts and grades.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from conftest import build_tiny_tokenizer
from starlette.testclient import TestClient
from test_client import FIXED_EXPLANATION, D, Pair

from nla.cli import build_parser
from nla.commands import explore as explore_cmd
from nla.explore import ExploreLimits, Explorer, create_app, load_run
from nla.world import WORLD_PRESETS, Fact, facts_at, generate_documents, grade, parse_facts, token_facts

K = 1
WORDS = "Alice walks to the garden in the morning and she is happy ."
LONG_TEXT = " ".join(["the cat walks to the river and the dog sleeps in the house"] * 6)[:-1]  # 60+ tokens


@pytest.fixture(scope="module", autouse=True)
def _threads(single_thread):
    yield


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    return Pair(tmp_path_factory.mktemp("explore_pair"))


@pytest.fixture(scope="module")
def world_subject(tmp_path_factory, tiny_model_dir):
    """A world build dir (config + summary) whose subject/ is the conftest tiny Llama."""
    root = tmp_path_factory.mktemp("world") / "tiny-test"
    shutil.copytree(tiny_model_dir("llama"), root / "subject")
    (root / "world_config.yaml").write_text(yaml.safe_dump(WORLD_PRESETS["tiny"].to_dict()))
    (root / "summary.json").write_text(json.dumps({"heldout_loss": 1.0, "unigram_entropy": 2.0,
                                                   "train_seconds": 0.0}))
    return root / "subject"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return _quickstart_run(tmp_path_factory.mktemp("qs_run"))


@pytest.fixture(scope="module")
def explorer(pair, world_subject) -> Explorer:
    return Explorer.load(pair.av_dir, pair.ar_dir, world_subject, device="cpu")


@pytest.fixture(scope="module")
def api(explorer, run_dir) -> TestClient:
    return TestClient(create_app(explorer, run=load_run(run_dir)))


def _direct_activations(subject_dir, text: str) -> torch.Tensor:
    """[T, d] output of block K from a plain forward pass (HF hidden_states[K+1])."""
    from transformers import AutoModelForCausalLM

    from nla.core.arch import load_tokenizer

    tok = load_tokenizer(subject_dir)
    model = AutoModelForCausalLM.from_pretrained(subject_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True).hidden_states[K + 1][0]


# ---------------------------------------------------------------------------------------------- API


def test_tokenize_spans_and_world_ground_truth(api, explorer):
    info = api.get("/api/info").json()
    assert info["setup_error"] is None and info["d_model"] == D and info["layer_index"] == K
    cfg = WORLD_PRESETS["tiny"]
    doc = generate_documents(cfg.seed, 1, start_id=cfg.heldout_start)[0]  # the first held-out story
    assert info["world_docs"][0]["doc_id"] == doc.doc_id == cfg.heldout_start
    # the documents considered (ExploreLimits.max_world_docs of the held-out ones), and how many fit the cap
    assert info["world_docs_considered"] == min(ExploreLimits().max_world_docs, cfg.n_heldout_docs)
    assert len(info["world_docs"]) <= info["world_docs_considered"] and info["max_tokens"] > 0
    r = api.post("/api/tokenize", json={"doc_id": doc.doc_id})
    assert r.status_code == 200, r.text
    toks = r.json()["tokens"]
    enc = explorer.tokenizer(doc.text, return_offsets_mapping=True)
    assert [(t["start"], t["end"]) for t in toks] == [tuple(o) for o in enc["offset_mapping"]]
    assert all(t["text"] == doc.text[t["start"]:t["end"]] for t in toks)
    expected = [sorted(str(f) for f in fs) for fs in token_facts(doc, [tuple(o) for o in enc["offset_mapping"]])]
    assert [t["facts"] for t in toks] == expected
    # by the last token the facts are what is true at the end of the story
    assert expected[-1] == sorted(str(f) for f in facts_at(doc, len(doc.text)))
    plain = api.post("/api/tokenize", json={"text": WORDS}).json()
    assert [t["text"] for t in plain["tokens"]] == WORDS.split() and "facts" not in plain["tokens"][0]


def test_explain_matches_direct_forward_and_client_score(api, explorer, world_subject):
    positions = [0, 3, 11]
    r = api.post("/api/explain", json={"text": WORDS, "positions": positions, "return_vectors": True})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    acts = _direct_activations(world_subject, WORDS)
    direct = explorer.client.score([FIXED_EXPLANATION] * 3, acts[positions])
    for k, (p, out) in enumerate(zip(positions, res, strict=True)):
        assert out["position"] == p and out["token"] == WORDS.split()[p]
        torch.testing.assert_close(torch.tensor(out["vector"]), acts[p], rtol=1e-4, atol=1e-5)
        g = out["greedy"]
        assert (g["status"], g["explanation"]) == ("completed", FIXED_EXPLANATION)
        assert g["cosine"] == pytest.approx(float(direct.cosine[k]), rel=1e-5, abs=1e-6)
        assert g["mse_nrm"] == pytest.approx(float(direct.mse_nrm[k]), rel=1e-5, abs=1e-6)
        assert g["mse_nrm"] == pytest.approx(2 * (1 - g["cosine"]), rel=1e-4, abs=1e-5)  # scale sqrt(d)
        assert out["samples"] == [] and "facts" not in out


def test_explaining_every_token_of_64_is_one_batched_call(api, explorer, monkeypatch):
    import nla.explore.engine as engine

    calls = []
    # the client's verbalize and score, and the suite's attribute_claims(client, texts, vectors)
    for owner, name in ((explorer.client, "verbalize"), (explorer.client, "score"), (engine, "attribute_claims")):
        real = getattr(owner, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, len(args[0] if _name == "verbalize" else args[1])))
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    text = " ".join(LONG_TEXT.split()[:64])
    r = api.post("/api/explain", json={"text": text})  # no positions: every token
    assert r.status_code == 200, r.text
    assert r.json()["n_tokens"] == 64 and len(r.json()["results"]) == 64
    assert calls == [("verbalize", 64), ("score", 64), ("attribute_claims", 64)]  # one call each, all positions


def test_world_claims_marked_against_the_token_facts(api, explorer):
    doc_id = api.get("/api/info").json()["world_docs"][1]["doc_id"]
    toks = api.post("/api/tokenize", json={"doc_id": doc_id}).json()["tokens"]
    p = len(toks) - 1
    out = api.post("/api/explain", json={"doc_id": doc_id, "positions": [p]}).json()["results"][0]
    truth = {Fact.parse(f) for f in toks[p]["facts"]}
    assert out["facts"] == toks[p]["facts"]
    claimed = sorted(parse_facts(FIXED_EXPLANATION))  # alice, garden, morning
    assert [c["fact"] for c in out["greedy"]["claims"]] == [str(f) for f in claimed]
    assert [c["correct"] for c in out["greedy"]["claims"]] == [f in truth for f in claimed]
    assert out["greedy"]["missed"] == sorted(str(f) for f in truth - set(claimed))
    g = grade(FIXED_EXPLANATION, truth)
    assert (out["greedy"]["recall"], out["greedy"]["precision"]) == pytest.approx((g.recall, g.precision))



def _reference_attribution(client, text, vector, facts):
    """Each sentence of ``text`` with mse_nrm(deleted) - mse_nrm(full) of the AR's readings, its truth
    (every fact it names is in ``facts``; None: names none, or no facts) and whether it quotes the word."""
    import re

    from nla.core.graders import split_sentences
    from nla.core.vectors import mse_nrm

    claims = split_sentences(text or "")
    if not claims:
        return [], None
    variants = [text] + [" ".join(claims[:j] + claims[j + 1:]) for j in range(len(claims))]
    mse = [float(mse_nrm(client.reconstruct([v]), vector[None], client.mse_scale)[0]) for v in variants]
    out = []
    for j, c in enumerate(claims):
        named = {str(f) for f in parse_facts(c)}
        truth = None if facts is None or not named else named <= set(facts)
        out.append({"text": c, "delta_mse": mse[j + 1] - mse[0], "truth": truth,
                    "quotation": bool(re.fullmatch(r'The text ends with "[^"]+"\.', c))})
    return out, mse[0]


def _assert_same_claims(got, want):
    assert [{k: v for k, v in c.items() if k != "delta_mse"} for c in got] == [
        {k: v for k, v in c.items() if k != "delta_mse"} for c in want]
    assert [c["delta_mse"] for c in got] == pytest.approx([c["delta_mse"] for c in want], rel=1e-4, abs=1e-5)


def test_claim_attribution_is_each_claims_deletion_cost(api, explorer):
    from nla.core.graders import get_grader

    doc_id = api.get("/api/info").json()["world_docs"][1]["doc_id"]
    toks = api.post("/api/tokenize", json={"doc_id": doc_id}).json()["tokens"]
    positions = [0, len(toks) - 1]
    body = {"doc_id": doc_id, "positions": positions, "n_samples": 2, "seed": 3, "max_new_tokens": 24,
            "return_vectors": True}
    res = api.post("/api/explain", json=body).json()["results"]
    for p, out in zip(positions, res, strict=True):
        vec = torch.tensor(out["vector"])
        for e in [out["greedy"], *out["samples"]]:
            want, full = _reference_attribution(explorer.client, e["explanation"], vec, toks[p]["facts"])
            _assert_same_claims(e["claim_attribution"], want)
            if e["explanation"] is None:  # a failed sample: no claims
                assert e["claim_attribution"] == []
            elif full is not None and e["mse_nrm"] is not None:  # the full text's reading is the one scored
                assert full == pytest.approx(e["mse_nrm"], rel=1e-4, abs=1e-5)
        # the fixed explanation is one claim naming three facts: true only where all three are
        g = out["greedy"]["claim_attribution"]
        assert [c["text"] for c in g] == [FIXED_EXPLANATION] and g[0]["quotation"] is False
        assert g[0]["truth"] is ({str(f) for f in parse_facts(FIXED_EXPLANATION)} <= set(toks[p]["facts"]))
    # several claims: a quotation (truth null), the true facts, one false fact; typed text has no truth
    p = positions[-1]
    facts = toks[p]["facts"]
    assert facts, "the last token of a story has facts"
    kind = facts[0].partition("=")[0]
    grader = get_grader("world")
    wrong = next(f for f in grader.facts_of_kind(kind) if f not in facts)
    text = grader.oracle(facts, "garden", 0) + " " + grader.oracle([wrong], None, 1)
    vec = explorer.activations(explorer.text_input(doc_id=doc_id))[p]
    got = explorer.claim_attribution([text, None], vec.expand(2, -1), [facts, facts])
    want, _ = _reference_attribution(explorer.client, text, vec, facts)
    assert {c["truth"] for c in want} == {True, False, None} and any(c["quotation"] for c in want)
    _assert_same_claims(got[0], want)
    assert got[1] == []
    _assert_same_claims(explorer.claim_attribution([text], vec[None])[0],
                        _reference_attribution(explorer.client, text, vec, None)[0])


def test_samples_are_seeded_and_scored(api, explorer):
    body = {"text": WORDS, "positions": [2, 5], "n_samples": 3, "seed": 11, "max_new_tokens": 24}
    a = api.post("/api/explain", json=body).json()["results"]
    b = api.post("/api/explain", json=body).json()["results"]
    assert [len(x["samples"]) for x in a] == [3, 3]
    assert [[s["text"] for s in x["samples"]] for x in a] == [[s["text"] for s in x["samples"]] for x in b]
    acts = explorer.activations(explorer.text_input(WORDS))
    for p, x in zip((2, 5), a, strict=True):
        done = [s for s in x["samples"] if s["explanation"] is not None]
        if done:
            ref = explorer.client.score([s["explanation"] for s in done], acts[[p] * len(done)])
            assert [s["cosine"] for s in done] == pytest.approx(ref.cosine.tolist(), rel=1e-5, abs=1e-6)
        assert all(s["cosine"] is None for s in x["samples"] if s["explanation"] is None)


def test_score_vectors_and_token_forms(api, explorer):
    gold = torch.randn(3, D, generator=torch.Generator().manual_seed(4)) * 5
    texts = [FIXED_EXPLANATION, "Bob is happy", None]
    r = api.post("/api/score", json={"texts": texts, "vectors": gold.tolist()})
    assert r.status_code == 200, r.text
    got = r.json()["results"]
    ref = explorer.client.score(texts, gold)
    assert [x["cosine"] for x in got[:2]] == pytest.approx(ref.cosine[:2].tolist(), rel=1e-5)
    assert got[2] == {"cosine": None, "mse_nrm": None, "failed": True}
    # The token form scores against that token's activation: the same number explain reports.
    exp = api.post("/api/explain", json={"text": WORDS, "positions": [4]}).json()["results"][0]["greedy"]
    tok = api.post("/api/score", json={"text": WORDS, "position": 4, "texts": [FIXED_EXPLANATION]}).json()
    assert tok["results"][0]["cosine"] == pytest.approx(exp["cosine"], rel=1e-6)


def _post(api, path, body=None, **kw):
    return api.post(path, json=body, **kw) if body is not None or kw == {} else api.post(path, **kw)


BAD = [
    ("/api/tokenize", {"text": ""}, 400, "text is empty"),
    ("/api/tokenize", {"text": "   \n "}, 400, "text is empty"),
    ("/api/explain", {"text": "cat " * 600}, 413, "characters; the cap is 2000"),
    ("/api/explain", {"text": "cat " * 200}, 413, "more than 128 tokens"),
    ("/api/explain", {"text": WORDS, "positions": [13]}, 400, "position 13 is out of range: the text has 13 tokens"),
    ("/api/explain", {"text": WORDS, "positions": [-1]}, 400, "position -1 is out of range"),
    ("/api/explain", {"text": WORDS, "positions": []}, 400, "positions is empty"),
    ("/api/explain", {"text": WORDS, "positions": ["a"]}, 400, "expected a list of (64-bit) integers"),
    ("/api/explain", {"text": WORDS, "n_samples": 9}, 400, "n_samples must be 0..8"),
    ("/api/explain", {"text": WORDS, "max_new_tokens": 1000}, 400, "max_new_tokens must be 1..96"),
    ("/api/explain", {"text": WORDS, "temperature": 0}, 400, "temperature: expected a finite number in [0.0001, 100]"),
    ("/api/explain", {"text": WORDS, "n_samples": 2, "temperature": 1e-40}, 400,
     "temperature: expected a finite number in [0.0001, 100], found 1e-40"),
    ("/api/explain", {"text": 5}, 400, "field 'text': expected str, found int"),
    ("/api/explain", {"doc_id": 3}, 400, "doc_id 3: not a held-out document"),
    ("/api/explain", {"doc_id": True}, 400, "field 'doc_id': expected int, found bool"),
    ("/api/explain", {"text": WORDS, "doc_id": 1000}, 400, "not both"),
    ("/api/explain", {}, 400, "give either 'text'"),
    ("/api/score", {"texts": ["a"], "vectors": [[0.5] * 16]}, 400, "expected [N, 32] (the pair's d_model)"),
    ("/api/score", {"texts": ["a", "b"], "vectors": [[0.5] * 32]}, 400, "2 texts for 1 vectors"),
    ("/api/score", {"texts": ["a"], "vectors": [[0.0] * 32]}, 400, "finite and non-zero"),
    ("/api/score", {"texts": ["a"], "vectors": [[1, 2], [3]]}, 400, "equal-length lists of numbers"),
    ("/api/score", {"texts": [], "vectors": []}, 400, "texts is empty"),
    ("/api/score", {"texts": ["x" * 2001], "vectors": [[1.0] * 32]}, 413, "the cap is 2000"),
    ("/api/score", {"texts": ["a"], "text": WORDS, "position": 40}, 400, "position 40 is out of range"),
    ("/api/score", {"texts": ["a"]}, 400, "give either 'text'"),
    ("/api/tokenize", {"text": "a\ud800b"}, 400, "field 'text': character 1 is a lone surrogate ('\\ud800')"),
    ("/api/score", {"texts": ["ok", "x\udfff"], "vectors": [[1.0] * 32] * 2}, 400,
     "field 'texts', item 1: character 1 is a lone surrogate"),
    ("/api/explain", {"text": WORDS, "seed": 2**70}, 400, "field 'seed': 1180591620717411303424 is out of range"),
    ("/api/explain", {"text": WORDS, "positions": [2**64]}, 400, "expected a list of (64-bit) integers"),
    ("/api/score", {"texts": ["a"], "vectors": [[True] * 32]}, 400, "found a boolean"),
    # issue 48: an integer too large for a float was a 500; NaN and float32 overflow are named too
    ("/api/score", {"texts": ["a"], "vectors": [[10**400] * 32]}, 400, "field 'vectors': an entry is too large"),
    ("/api/score", {"texts": ["a"], "vectors": [[1.0] * 31 + [float("nan")]]}, 400,
     "field 'vectors': entry [0, 31] is nan"),
    ("/api/score", {"texts": ["a"], "vectors": [[1e39] * 32]}, 400, "expected finite float32 numbers"),
]


@pytest.mark.parametrize("path,body,status,reason", BAD, ids=[f"{i}-{b[3][:24]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_one_line_json_4xx(api, path, body, status, reason):
    # json.dumps escapes non-ASCII (a lone surrogate travels as the JSON escape \ud800, as a browser sends it)
    r = api.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert reason in err and "\n" not in err


def test_bad_bodies_and_the_server_keeps_running(api):
    r = api.post("/api/explain", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = api.post("/api/explain", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "expected a JSON object, found list" in r.json()["error"]
    # A form post (what a cross-site page can send without a preflight) is refused.
    r = api.post("/api/explain", content=b"text=hi", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    big = json.dumps({"texts": ["a"], "vectors": [[1.0] * 32] * 200_000}).encode()
    assert len(big) > 4_000_000
    r = api.post("/api/score", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "the cap is 4000000" in r.json()["error"]
    r = api.get("/api/nothing")
    assert r.status_code == 404 and "Not Found" in r.json()["error"]
    deep = b'{"texts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = api.post("/api/score", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]
    assert api.post("/api/explain", json={"text": WORDS, "positions": [1]}).status_code == 200


def test_an_unexpected_error_is_a_500_and_the_server_keeps_running(explorer, monkeypatch):
    client = TestClient(create_app(explorer), raise_server_exceptions=False)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(explorer, "explain", boom)
    r = client.post("/api/explain", json={"text": WORDS})
    assert r.status_code == 500 and "RuntimeError: simulated failure" in r.json()["error"]
    monkeypatch.undo()
    assert client.post("/api/explain", json={"text": WORDS, "positions": [0]}).status_code == 200


def test_cli_flags_map_onto_the_limits(pair, world_subject):
    client = _cli_app("--av", str(pair.av_dir), "--ar", str(pair.ar_dir), "--subject", str(world_subject),
                      "--device", "cpu", "--max-samples", "2", "--max-tokens", "20")
    info = client.get("/api/info").json()
    assert info["limits"]["max_samples"] == 2 and info["limits"]["max_new_tokens"] == 96
    assert info["max_tokens"] == 20
    r = client.post("/api/explain", json={"text": WORDS, "positions": [0], "n_samples": 3})
    assert r.status_code == 400 and "n_samples must be 0..2" in r.json()["error"]


def test_only_the_allowed_hosts_are_answered(explorer):
    app = create_app(explorer, allowed_hosts=list(explore_cmd.LOOPBACK))
    assert TestClient(app, base_url="http://127.0.0.1:8765").get("/api/info").status_code == 200
    assert TestClient(app, base_url="http://[::1]:8765").get("/api/info").status_code == 200  # IPv6 loopback
    r = TestClient(app, base_url="http://evil.example").get("/api/info")
    assert r.status_code == 400 and "Invalid host header 'evil.example'" in r.json()["error"]
    r = TestClient(app, base_url="http://127.0.0.1:8765").get("/api/info", headers={"host": "[::1]evil.com"})
    assert r.status_code == 400 and "Invalid host header '[::1]evil.com'" in r.json()["error"]


def test_every_bind_keeps_a_host_allow_list():
    import socket

    from nla.util.http import host_name

    assert [host_name(h) for h in ("[::1]:8765", "[::1]", "LocalHost:80", "a.b", "::1")] == [
        "::1", "::1", "localhost", "a.b", "::1"]
    # issue 48: only ":port" may follow the bracket (the host was read as ::1 and answered)
    assert [host_name(h) for h in ("[::1]evil.com", "[::1]:80x", "[::1", "a.b:evil")] == [
        "[::1]evil.com", "[::1]:80x", "[::1", "a.b:evil"]
    assert explore_cmd.allowed_hosts("::1", []) == sorted(explore_cmd.LOOPBACK)
    every = explore_cmd.allowed_hosts("0.0.0.0", ["lab.example"])
    assert {*explore_cmd.LOOPBACK, socket.gethostname(), "lab.example"} <= set(every)
    assert "evil.example" not in every and "*" not in every
    one = explore_cmd.allowed_hosts("10.1.2.3", [])
    assert "10.1.2.3" in one and socket.gethostname() in one and "127.0.0.1" not in one


# --------------------------------------------------------------------- setup errors, served by the CLI's app


def _cli_app(*argv: str):
    args = build_parser().parse_args(["explore", *argv])
    return TestClient(explore_cmd.build(args), base_url="http://127.0.0.1:8765")  # the CLI answers loopback only


def _assert_setup_error(client: TestClient, reason: str) -> None:
    info = client.get("/api/info").json()
    assert reason in info["setup_error"] and "\n" not in info["setup_error"]
    r = client.post("/api/explain", json={"text": WORDS})
    assert r.status_code == 409 and reason in r.json()["error"]
    assert client.get("/").status_code == 200  # the page still loads and shows it


def test_pair_with_different_d_model_is_served_as_a_409(pair, world_subject, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from nla.core.reconstructor import Reconstructor

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(pair.tok), max_position_embeddings=128)
    narrow = Reconstructor.from_base(LlamaForCausalLM(cfg), K, tokenizer=pair.tok,
                                     sidecar=pair.side.replace(d_model=16, role="ar"))
    narrow.save_pretrained(tmp_path / "ar16")
    _assert_setup_error(_cli_app("--av", str(pair.av_dir), "--ar", str(tmp_path / "ar16"), "--subject",
                                 str(world_subject), "--device", "cpu"),
                        "the AV sidecar says 32 but the AR sidecar says 16")


def test_subject_without_the_layer_is_served_as_a_409(pair, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    cfg = LlamaConfig(hidden_size=D, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "shallow")
    tok.save_pretrained(tmp_path / "shallow")
    _assert_setup_error(_cli_app("--av", str(pair.av_dir), "--ar", str(pair.ar_dir), "--subject",
                                 str(tmp_path / "shallow"), "--device", "cpu"),
                        "the pair reads block 1 but the subject model")


def test_missing_subject_and_checkpoint_are_served(pair, tmp_path):
    # The tiny pair's sidecars record no base_model, so the subject must be given.
    _assert_setup_error(_cli_app("--av", str(pair.av_dir), "--ar", str(pair.ar_dir), "--device", "cpu"),
                        "pass --subject DIR")
    _assert_setup_error(_cli_app("--av", str(tmp_path / "nope"), "--ar", str(pair.ar_dir)),
                        "--av: no checkpoint directory at")


# ---------------------------------------------------------------------------------------------- run view


def _png(path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1, 2], [2, 1, 0.5])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _quickstart_run(out):
    """A run dir written by the quickstart's own report writer, from hand-made eval reports."""
    from nla.core.graders import Quotation
    from nla.eval.evaluate import EvalReport, EvalRow, Faithfulness, Sample
    from nla.eval.report import ROUND_TRIP, write_report
    from nla.quickstart import StageRecord

    def report(fve, expl, mse):
        row = EvalRow(ROUND_TRIP, fve=fve, cosine=0.5, mse_mean=1.0, mse_p10=0.5, mse_p50=1.0, mse_p90=1.5,
                      faithfulness=Faithfulness(0.5, 0.25, {"person": (1.0, 0.5), "place": (0.0, 0.0)}, 2,
                                                quote=Quotation(2, 0.5, 0.5, 1.0, {"quote[0]": (0.5, 1.0)},
                                                                {"quote[0]": 1})))
        sample = Sample(row=3, explanation=expl, status="completed", mse_nrm=mse, facts=["person=alice", "place=park"],
                        context="Alice went to the park", reference='The text ends with "to the park".')
        return EvalReport("eval.parquet", 2, D, None, 0.9, 1.3, rows=[row], samples=[sample]).to_dict()

    _png(out / "rl" / "rl_curves.png")
    write_report(out, preset="tiny", stages=[StageRecord("world", 1.5, True), StageRecord("rl", 10.25, False)],
                 configs={"world": {"preset": "tiny"}}, world={"heldout_loss": 1.4}, warm_eval=report(0.1, None, 2.0),
                 rl_eval=report(0.3, "Alice is in the garden.", 0.75), ar_info={}, av_info={}, rl_info={})
    return out


def test_run_view_reads_the_quickstart_report(api, run_dir):
    run = api.get("/api/run").json()
    assert run["kind"] == "quickstart" and run["path"] == str(run_dir)
    head = {h["label"]: h["value"] for h in run["headline"]}
    assert head["round-trip FVE, warm-start"] == 0.1 and head["round-trip FVE, after RL"] == 0.3
    evals = run["tables"][0]
    assert evals["columns"][:3] == ["predictor", "FVE warm", "FVE RL"]
    assert evals["rows"][0][:3] == ["AV → AR round trip", 0.1, 0.3]
    assert run["tables"][1]["rows"][0] == ["AV → AR round trip", "1.00 / 0.50", "0.00 / 0.00"]
    assert run["tables"][2]["rows"][0] == ["quote[0] (the token read)", 0.5, 1.0, 0.5, 1.0]
    assert run["tables"][2]["rows"][1] == ["exactly the text's end (share of rows)", 0.5, None, 0.5, None]
    assert run["tables"][3]["rows"] == [["world", 1.5, "yes"], ["rl", 10.2, "no"]]
    ex = run["examples"][0]
    assert ex["rl"]["claims"] == [{"fact": "person=alice", "correct": True}, {"fact": "place=garden", "correct": False}]
    assert ex["rl"]["missed"] == ["place=park"] and ex["warmstart"]["explanation"] is None
    assert ex["rl"]["quotation"] is None  # it quotes nothing (graded against the sample's context)
    assert [p["name"] for p in run["plots"]] == ["rl_curves"]
    png = api.get(run["plots"][0]["url"])
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content == (run_dir / "rl_curves.png").read_bytes()
    for name in ("report", "..%2Freport.json", "world_loss"):
        r = api.get(f"/api/run/plots/{name}")
        assert r.status_code == 404 and "error" in r.json()


def test_run_view_reads_an_rl_dir_and_rejects_others(explorer, tmp_path):
    rl = tmp_path / "rl"
    _png(rl / "rl_curves.png")
    (rl / "rl_summary.json").write_text(json.dumps({"step": 3, "reward_mean": -1.23456, "fve_nrm": 0.5}))
    (rl / "rl.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": -s / 10}) + "\n" for s in (1, 2, 3)))
    run = TestClient(create_app(explorer, run=load_run(rl))).get("/api/run").json()
    assert run["kind"] == "rl" and run["headline"][:2] == [{"label": "step", "value": 3},
                                                           {"label": "reward_mean", "value": -1.235}]
    assert run["tables"][0]["rows"] == [[1, -0.1], [2, -0.2], [3, -0.3]]
    assert [p["name"] for p in run["plots"]] == ["rl_curves"]
    with pytest.raises(FileNotFoundError, match="neither report.json"):
        load_run(tmp_path)
    r = TestClient(create_app(explorer)).get("/api/run")
    assert r.status_code == 404 and "--run RUN_DIR" in r.json()["error"]


def test_page_and_static_files_are_packaged(api):
    page = api.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text
    for name in ("app.js", "style.css"):
        assert api.get(f"/static/{name}").status_code == 200
    # Offline: the page loads nothing from another host.
    for name in ("index.html", "app.js", "style.css"):
        from nla.explore.app import STATIC_DIR

        assert "http://" not in (STATIC_DIR / name).read_text() and "https://" not in (STATIC_DIR / name).read_text()


# ---------------------------------------------------------------------------------------------- browser


@pytest.mark.browser
def test_browser_shows_an_explanation_and_a_score(explorer, run_dir, tmp_path):
    from chromium import HeadlessChromium, find_chromium

    from nla.util.http import BackgroundServer

    if find_chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser test: .ci/run installs the Debian package chromium")
        pytest.skip("no chromium binary here (apt-get install chromium, or set $NLA_CHROMIUM); CI runs this test")
    app = create_app(explorer, run=load_run(run_dir), allowed_hosts=list(explore_cmd.LOOPBACK))
    with BackgroundServer(app) as server, HeadlessChromium(width=1100, height=800) as page:
        page.goto(server.url + "/")
        page.wait_for("document.querySelectorAll('#doc-select option').length > 1")  # /api/info answered
        page.click("#explore-btn")  # empty text: the error line shows, nothing breaks
        assert "text is empty" in page.wait_for("!document.getElementById('error').hidden && "
                                                "document.getElementById('error').textContent")
        page.type_text("#text-input", WORDS)
        page.click("#explore-btn")
        page.wait_for("document.querySelectorAll('.tok[style*=background]').length === 13", timeout=120)
        assert page.evaluate("document.getElementById('error').hidden")
        page.click('.tok[data-position="3"]')
        shown = page.wait_for("!document.getElementById('detail').hidden && "
                              "document.querySelector('#d-greedy .explanation').textContent")
        assert shown == FIXED_EXPLANATION
        cos = float(page.evaluate("document.querySelector('#d-greedy .score-cos b').textContent"))
        acts = explorer.activations(explorer.text_input(WORDS))
        expected = float(explorer.client.score([FIXED_EXPLANATION], acts[[3]]).cosine[0])
        assert cos == pytest.approx(expected, abs=5e-4)  # shown with 3 decimals
        assert page.evaluate("document.getElementById('d-token').textContent") == json.dumps(WORDS.split()[3])
        # the claim rows under the explanation: one per claim of the JSON answer, each with its bar and value
        import httpx

        claims = httpx.post(server.url + "/api/explain", json={"text": WORDS, "positions": [3]}).json()[
            "results"][0]["greedy"]["claim_attribution"]
        assert claims and page.evaluate("document.querySelectorAll('#d-greedy .claim-row').length") == len(claims)
        assert page.evaluate("document.querySelectorAll('#d-greedy .claim-row .claim-bar .bar').length") == len(claims)
        shown = page.evaluate("[...document.querySelectorAll('#d-greedy .claim-row')].map((r) => "
                              "[r.querySelector('.claim-text').textContent, r.querySelector('.claim-delta').textContent,"
                              " r.querySelector('.bar').className])")
        assert shown == [[c["text"], f"{c['delta_mse']:+.3f}", "bar " + ("neg" if c["delta_mse"] < 0 else "pos")]
                         for c in claims]
        page.click("#tab-run")
        n_tables = len(httpx.get(server.url + "/api/run").json()["tables"])  # eval, kinds, quotation, stages
        assert n_tables >= 3
        page.wait_for(f"document.querySelectorAll('#run-tables table').length === {n_tables}")
        page.screenshot(tmp_path / "page.png")
        assert (tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.isfinite(cos)


def test_cli_serves_on_loopback(pair, world_subject):
    """`nla explore` as a user runs it: a real uvicorn process on 127.0.0.1, answering /api/info."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nla.cli", "explore", "--av", str(pair.av_dir), "--ar", str(pair.ar_dir),
           "--subject", str(world_subject), "--port", str(port), "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/info", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "nla explore did not answer within 120 s"
                time.sleep(0.2)
        assert r.status_code == 200 and r.json()["d_model"] == D and r.json()["setup_error"] is None
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_vector_whose_norm_overflows_is_a_400(api):
    """Entries of 1e30 are finite in float32, their squares are not: no working model's activation
    (the client's check, as for the CLI), so the request's fault: a 400 naming it, not a 500."""
    r = api.post("/api/score", json={"texts": ["a cat"], "vectors": [[1e30] * D]})
    assert r.status_code == 400 and "row 0 (1 of 1) have a norm that overflows float32" in r.json()["error"]
    assert api.post("/api/score", json={"texts": ["a cat"], "vectors": [[1.0] * D]}).status_code == 200
