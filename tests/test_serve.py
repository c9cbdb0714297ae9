"""nla serve: a real uvicorn server on a free loopback port, real HTTP requests.

The AV is a random-weight tiny Llama (the conftest tokenizer with the explanation tags) written
with nla's own writers (``save_av_checkpoint``, ``Reconstructor.save_pretrained``), and the AR is built from it
(``Reconstructor.from_base``). Its greedy texts differ between vectors (some end at EOS, some run
out of tokens), so equality with ``NLAClient.verbalize`` is a real check. The "published client"
below is written from the description of what it does: chat template -> embedding rows read from
the checkpoint's safetensors -> the vector rescaled to ``injection_scale`` at the marker -> one
``POST /generate`` per vector -> ``resp.json()["text"]``.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from nla.cli import build_parser, main
from nla.client import NLAClient
from nla.core.injection import save_av_checkpoint
from nla.core.reconstructor import Reconstructor
from nla.core.sidecar import NLAConfig
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR
from nla.core.token_ids import canonical_av_prompt_ids
from nla.serve import ServeLimits
from nla.serve.app import NLAService, create_app
from nla.util.http import LOOPBACK, BackgroundServer, host_name

D = 32
MAX_NEW = 24
N_VECTORS = 10


@pytest.fixture(scope="module", autouse=True)
def _threads(single_thread):
    yield


def build_random_pair(root: Path, seed: int = 3) -> tuple[Path, Path]:
    """A random tiny Llama AV and the AR built from it, saved as nla checkpoints."""
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<explanation>", "</explanation>"])
    side = NLAConfig.from_tokenizer(
        tok, kind="nla_model", role="av", d_model=D, layer_index=1, av_template=DEFAULT_AV_TEMPLATE,
        ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR, injection_scale="sqrt_d_model",
    )
    model = build_tiny_model("llama", tok, seed=seed)
    av_dir, ar_dir = root / "av", root / "ar"
    save_av_checkpoint(model, tok, side, av_dir)
    ar = Reconstructor.from_base(model, 1, tokenizer=tok, sidecar=side)
    ar.save_pretrained(ar_dir)
    return av_dir, ar_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_random_pair(tmp_path_factory.mktemp("serve_pair"))


@pytest.fixture(scope="module")
def client(pair) -> NLAClient:
    return NLAClient(pair[0], pair[1], device="cpu")


@pytest.fixture(scope="module")
def vectors() -> torch.Tensor:
    return torch.randn(32, D, generator=torch.Generator().manual_seed(0)) * 3


@pytest.fixture(scope="module")
def service(pair):
    s = NLAService.load(str(pair[0]), str(pair[1]), device="cpu", limits=ServeLimits(max_new_tokens=64, max_prompt_tokens=256))
    yield s
    s.close()


@pytest.fixture(scope="module")
def server(service):
    with BackgroundServer(create_app(service, allowed_hosts=list(LOOPBACK))) as srv:
        yield srv


class PublishedStyleClient:
    """What the published NLA client does per vector, from its description (fp32 embeddings here)."""

    def __init__(self, av_dir: Path, url: str) -> None:
        from safetensors.torch import load_file

        from nla.core.arch import load_tokenizer
        from nla.core.sidecar import load_sidecar

        self.url = url
        self.side = load_sidecar(av_dir)
        self.tok = load_tokenizer(av_dir)
        weights = load_file(str(av_dir / "model.safetensors"))
        self.embed = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight")).float()
        self.scale = float(self.side.injection_scale_value())
        content = self.side.av_template.format(injection_char=self.side.injection_char)
        self.ids = canonical_av_prompt_ids(self.tok, [{"role": "user", "content": content}])
        s = self.side
        self.pos = next(i for i in range(1, len(self.ids) - 1) if self.ids[i] == s.injection_token_id
                        and self.ids[i - 1] == s.injection_left_neighbor_id
                        and self.ids[i + 1] == s.injection_right_neighbor_id)

    def embeds(self, v: torch.Tensor) -> list[list[float]]:
        e = self.embed[self.ids].clone()
        v32 = v.float()
        e[self.pos] = v32 * (self.scale / v32.norm())
        return e.tolist()

    def generate(self, v: torch.Tensor, **sampling) -> str:
        params = {"temperature": 1.0, "max_new_tokens": 200, "skip_special_tokens": False, **sampling}
        resp = httpx.post(f"{self.url}/generate", json={"input_embeds": self.embeds(v), "sampling_params": params},
                          timeout=60)
        resp.raise_for_status()
        out = resp.json()
        out = out[0] if isinstance(out, list) else out
        return out["text"]


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, timeout=60, **kw)


# --------------------------------------------------------------------- the published client's path
def test_published_client_gets_exactly_the_verbalize_text(pair, client, server, vectors):
    ref = client.verbalize(vectors[:N_VECTORS], greedy=True, max_new_tokens=MAX_NEW)
    assert len({r.text for r in ref}) >= 3, "the AV should write different texts for different vectors"
    assert {str(r.status) for r in ref} >= {"truncated", "failed"}  # some rows end at EOS, some run out
    pub = PublishedStyleClient(pair[0], server.url)
    for i, r in enumerate(ref):
        assert pub.generate(vectors[i], temperature=0.0, max_new_tokens=MAX_NEW, top_p=1.0) == r.text, i
    # the whole response: EOS is not in the text; finish reason and counts as SGLang gives them
    one = _post(server.url, "/generate", {"input_embeds": pub.embeds(vectors[0]),
                                          "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW,
                                                              "skip_special_tokens": False}}).json()
    assert one["meta_info"]["prompt_tokens"] == len(pub.ids)
    ended = str(ref[0].status) != "truncated"
    assert one["meta_info"]["finish_reason"]["type"] == ("stop" if ended else "length")
    assert one["meta_info"]["completion_tokens"] == (len(pub.tok.encode(ref[0].text, add_special_tokens=False))
                                                    + 1 if ended else MAX_NEW)
    # a list of prompts is a batch: a list of answers, in order
    batch = _post(server.url, "/generate", {"input_embeds": [pub.embeds(v) for v in vectors[:4]],
                                            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW,
                                                                "skip_special_tokens": False}}).json()
    assert [b["text"] for b in batch] == [r.text for r in ref[:4]]


def test_max_new_tokens_and_input_ids_and_text(pair, client, server, vectors):
    pub = PublishedStyleClient(pair[0], server.url)
    for n in (1, 5):
        ref = client.verbalize(vectors[:3], greedy=True, max_new_tokens=n)
        assert [pub.generate(v, temperature=0.0, max_new_tokens=n) for v in vectors[:3]] == [r.text for r in ref]
    # token ids and text: the same decode as their embeddings
    ids = pub.tok.encode("the cat walks to the garden", add_special_tokens=False)
    by_ids = _post(server.url, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0}}).json()
    by_emb = _post(server.url, "/generate", {"input_embeds": pub.embed[ids].tolist(),
                                             "sampling_params": {"temperature": 0}}).json()
    assert by_ids["text"] == by_emb["text"] and by_ids["meta_info"]["prompt_tokens"] == len(ids)
    text = _post(server.url, "/generate", {"text": ["the cat", "a dog"], "sampling_params": {"temperature": 0,
                                                                                            "max_new_tokens": 4}})
    assert text.status_code == 200 and len(text.json()) == 2
    # the marker is never written (suppressed as in the rollout), sampled or greedy
    marker = pub.side.injection_char
    sampled = _post(server.url, "/generate", {"input_embeds": [pub.embeds(v) for v in vectors[:8]],
                                              "sampling_params": {"temperature": 5.0, "max_new_tokens": 16,
                                                                  "skip_special_tokens": False}}).json()
    assert all(marker not in s["text"] for s in sampled)


# --------------------------------------------------------------------- batching
def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(pair, service, server, vectors):
    pub = PublishedStyleClient(pair[0], server.url)
    lengths = [MAX_NEW if i % 2 else 7 for i in range(32)]  # two max_new_tokens in one batch: truncation
    bodies = [{"input_embeds": pub.embeds(v), "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                                   "skip_special_tokens": False}}
              for v, n in zip(vectors, lengths, strict=True)]
    sequential = [_post(server.url, "/generate", b).json()["text"] for b in bodies]
    before = service.batcher.stats()
    answers: list = [None] * 32
    start = threading.Barrier(32)

    def send(i: int) -> None:
        start.wait()
        answers[i] = _post(server.url, "/generate", bodies[i]).json()["text"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert answers == sequential  # none lost, none answered with another's text
    assert len(set(sequential)) >= 3
    after = service.batcher.stats()
    assert after["requests"] - before["requests"] == 32 and after["prompts"] - before["prompts"] == 32
    assert after["largest_batch"] > 1 and after["batches"] - before["batches"] < 32
    info = httpx.get(f"{server.url}/info").json()
    assert info["batching"]["largest_batch"] == after["largest_batch"]


def test_a_failing_batch_answers_each_request_with_an_error_and_the_server_goes_on(pair, service, server, vectors,
                                                                                   monkeypatch):
    pub = PublishedStyleClient(pair[0], server.url)
    real = service.batcher.decode
    calls = []

    def boom(jobs):
        calls.append(len(jobs))
        raise RuntimeError("simulated decode failure")

    monkeypatch.setattr(service.batcher, "decode", boom)
    results: list = [None] * 6
    start = threading.Barrier(6)

    def send(i: int) -> None:
        start.wait()
        results[i] = _post(server.url, "/generate", {"input_embeds": pub.embeds(vectors[i]),
                                                     "sampling_params": {"temperature": 0, "max_new_tokens": 4}})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(calls) == 6
    assert all(r.status_code == 500 and "simulated decode failure" in r.json()["error"] for r in results)
    monkeypatch.setattr(service.batcher, "decode", real)
    assert pub.generate(vectors[0], temperature=0.0, max_new_tokens=4) == \
        NLAClient.verbalize(service.client, vectors[:1], max_new_tokens=4)[0].text
    assert service.batcher.stats()["failed_batches"] >= 1


# --------------------------------------------------------------------- nla's own endpoints
def test_verbalize_and_score_equal_the_client(client, server, vectors):
    v = vectors[:6]
    r = _post(server.url, "/verbalize", {"vectors": v.tolist(), "max_new_tokens": MAX_NEW})
    assert r.status_code == 200
    assert r.json()["results"] == [x.to_dict() for x in client.verbalize(v, greedy=True, max_new_tokens=MAX_NEW)]
    body = {"vectors": v[:2].tolist(), "greedy": False, "temperature": 0.7, "n_samples": 3, "max_new_tokens": 12,
            "seed": 5}
    ref = client.verbalize(v[:2], greedy=False, temperature=0.7, n_samples=3, max_new_tokens=12, seed=5)
    assert _post(server.url, "/verbalize", body).json()["results"] == [x.to_dict() for x in ref]
    # 20 vectors are decoded in pieces of verbalize_piece (8): rows numbered over the request, the same
    # answers as the client's, greedy and sampled (one seeded stream over the pieces)
    v20 = vectors[:20]
    got = _post(server.url, "/verbalize", {"vectors": v20.tolist(), "max_new_tokens": MAX_NEW}).json()["results"]
    assert [g["row"] for g in got] == list(range(20))
    assert got == [x.to_dict() for x in client.verbalize(v20, greedy=True, max_new_tokens=MAX_NEW)]
    body = {"vectors": v20.tolist(), "greedy": False, "temperature": 0.7, "max_new_tokens": 12, "seed": 5}
    ref = client.verbalize(v20, greedy=False, temperature=0.7, max_new_tokens=12, seed=5, batch_size=8)
    assert _post(server.url, "/verbalize", body).json()["results"] == [x.to_dict() for x in ref]
    texts = ["Alice is in the garden", None, "the cat sleeps", ""]
    got = _post(server.url, "/score", {"texts": texts, "vectors": v[:4].tolist()}).json()["results"]
    res = client.score(texts, v[:4])
    assert [g["failed"] for g in got] == res.failed.tolist() == [False, True, False, True]
    for g, m, c in zip(got, res.mse_nrm.tolist(), res.cosine.tolist(), strict=True):
        assert (g["mse_nrm"], g["cosine"]) == ((None, None) if np.isnan(m) else (m, c))
    info = httpx.get(f"{server.url}/info").json()
    assert info["d_model"] == D and info["injection_scale"] == pytest.approx(D ** 0.5)
    assert isinstance(info["injection_scale"], float) and info["has_ar"] is True
    assert {"requests", "batches", "largest_batch"} <= set(info["batching"]) and info["limits"]["max_new_tokens"] == 64
    assert httpx.get(f"{server.url}/get_model_info").json()["is_generation"] is True


def test_a_verbalize_past_its_wall_time_is_a_503_between_pieces(pair, vectors):
    """Issue 58: /verbalize was bounded by its decode work only, which a slow or busy machine turns into
    minutes; past verbalize_seconds the next piece is refused, naming how far it got."""
    limits = ServeLimits(max_new_tokens=16, verbalize_seconds=1e-6, verbalize_piece=8)
    service = NLAService.load(str(pair[0]), None, device="cpu", limits=limits)
    try:
        with BackgroundServer(create_app(service)) as srv:
            r = _post(srv.url, "/verbalize", {"vectors": vectors[:20].tolist(), "max_new_tokens": 8})
            assert r.status_code == 503
            err = r.json()["error"]
            assert err.startswith("/verbalize: 8 of 20 vectors explained in ") and \
                "past this server's limit of 1e-06 s per request (ServeLimits.verbalize_seconds)" in err
            # one piece's worth is answered whole: the bound is checked between pieces
            r = _post(srv.url, "/verbalize", {"vectors": vectors[:8].tolist(), "max_new_tokens": 8})
            assert r.status_code == 200 and len(r.json()["results"]) == 8
    finally:
        service.close()


def test_score_without_an_ar_is_a_409(pair):
    service = NLAService.load(str(pair[0]), None, device="cpu")
    try:
        with BackgroundServer(create_app(service)) as srv:
            r = _post(srv.url, "/score", {"texts": ["a"], "vectors": [[1.0] * D]})
            assert r.status_code == 409 and "--ar DIR" in r.json()["error"]
            assert httpx.get(f"{srv.url}/info").json()["ar"] is None
    finally:
        service.close()


# --------------------------------------------------------------------- bad input
GOOD = [[0.01] * D] * 5
SP = {"temperature": 0, "max_new_tokens": 4}
BAD = [
    ({"input_embeds": [[0.1] * 16] * 5}, 400, "field 'input_embeds': expected the AV's hidden size = 32"),
    ({"input_embeds": [[0.1] * D, [0.1] * 3]}, 400, "field 'input_embeds': expected a [T, d] list of equal-length"),
    ({"input_embeds": "abc"}, 400, "field 'input_embeds': expected a non-empty list"),
    ({"input_embeds": []}, 400, "field 'input_embeds': expected a non-empty list"),
    ({"input_embeds": [0.1] * D}, 400, "field 'input_embeds': expected a [T, d] list"),
    ({"input_embeds": [[float("nan")] * D]}, 400, "field 'input_embeds': entry [0, 0] is nan"),
    ({"input_embeds": [[0.1] * (D - 1) + [float("inf")]]}, 400, "field 'input_embeds': entry [0, 31] is inf"),
    ({"input_embeds": [[1e39] * D]}, 400, "expected finite float32 numbers"),
    ({"input_embeds": [[10**400] * D]}, 400, "field 'input_embeds': an entry is too large"),
    ({"input_embeds": [[True] * D]}, 400, "field 'input_embeds': expected numbers, found a boolean"),
    ({"input_embeds": [["x"] * D]}, 400, "field 'input_embeds': expected numbers, found a str ('x')"),
    ({"input_embeds": [[0.1] * D] * 300}, 413, "300 tokens; the cap is 256 tokens per prompt"),
    ({"input_embeds": GOOD, "input_ids": [1, 2]}, 400, "either 'input_embeds' or 'input_ids', not both"),
    ({}, 400, "give exactly one of 'input_embeds', 'input_ids' or 'text'"),
    ({"input_ids": [1, True]}, 400, "field 'input_ids': expected a non-empty list of token ids"),
    ({"input_ids": [10**6]}, 400, "field 'input_ids': expected a non-empty list of token ids"),
    ({"text": "a\ud800"}, 400, "field 'text': character 1 is a lone surrogate"),
    ({"input_embeds": GOOD, "sampling_params": {"temperature": 0, "min_p": 0.1}}, 400,
     "unsupported key(s) ['min_p']; this server supports ['temperature', 'top_p', 'top_k', 'max_new_tokens'"),
    ({"input_embeds": GOOD, "sampling_params": {"temperature": -1}}, 400,
     "'sampling_params.temperature': expected 0 (greedy) or a finite number in [0.0001, 100], found -1.0"),
    # issue 58: a temperature that underflows the logits' division was a 500 here and garbage in /verbalize
    ({"input_embeds": GOOD, "sampling_params": {"temperature": 1e-40}}, 400,
     "'sampling_params.temperature': expected 0 (greedy) or a finite number in [0.0001, 100], found 1e-40"),
    ({"input_embeds": GOOD, "sampling_params": {"temperature": True}}, 400,
     "'sampling_params.temperature': expected a number, found bool"),
    ({"input_embeds": GOOD, "sampling_params": {"temperature": float("nan")}}, 400, "'sampling_params.temperature'"),
    ({"input_embeds": GOOD, "sampling_params": {"top_p": 0}}, 400, "'sampling_params.top_p': expected a number in"),
    ({"input_embeds": GOOD, "sampling_params": {"top_p": 1.5}}, 400, "'sampling_params.top_p'"),
    ({"input_embeds": GOOD, "sampling_params": {"top_k": 0}}, 400, "'sampling_params.top_k': expected -1 (off)"),
    ({"input_embeds": GOOD, "sampling_params": {"max_new_tokens": 65}}, 400,
     "'sampling_params.max_new_tokens': expected 1..64"),
    ({"input_embeds": GOOD, "sampling_params": {"max_new_tokens": 0}}, 400, "'sampling_params.max_new_tokens'"),
    ({"input_embeds": GOOD, "sampling_params": {"max_new_tokens": 2.5}}, 400,
     "'sampling_params.max_new_tokens': expected an integer"),
    ({"input_embeds": GOOD, "sampling_params": {"skip_special_tokens": 1}}, 400,
     "'sampling_params.skip_special_tokens': expected true or false"),
    ({"input_embeds": GOOD, "sampling_params": [1]}, 400, "field 'sampling_params': expected an object"),
    ({"input_embeds": GOOD, "stream": True}, 400, "only false is supported"),
    ({"input_embeds": GOOD, "lora_path": "x"}, 400, "unsupported field(s) ['lora_path']"),
]
BAD_NLA = [
    ("/verbalize", {"vectors": [[0.1] * 16]}, 400, "field 'vectors': expected d_model = 32"),
    ("/verbalize", {"vectors": [[0.0] * D]}, 400, "row 0 (1 of 1) are all-zero vectors"),
    ("/verbalize", {"vectors": [[10**400] * D]}, 400, "field 'vectors': an entry is too large"),
    ("/verbalize", {"vectors": [[0.1] * D], "greedy": 1}, 400, "field 'greedy': expected bool, found int"),
    ("/verbalize", {"vectors": [[0.1] * D], "n_samples": 99}, 400, "field 'n_samples': expected 1..16"),
    ("/verbalize", {"vectors": [[0.1] * D], "max_new_tokens": 1000}, 400, "field 'max_new_tokens': expected 1..64"),
    ("/verbalize", {"vectors": [[0.1] * D], "greedy": False, "temperature": 0}, 400, "field 'temperature'"),
    ("/verbalize", {"vectors": [[0.1] * D], "greedy": False, "temperature": 1e-40}, 400,
     "field 'temperature': expected a finite number in [0.0001, 100], found 1e-40"),
    ("/verbalize", {"vectors": [[0.1] * D], "temperature": float("inf")}, 400, "field 'temperature': expected a "
                                                                               "finite number"),
    ("/verbalize", {"vectors": [[0.1] * D] * 300}, 413, "300 vectors; the cap is 256"),
    ("/score", {"texts": ["a", "b"], "vectors": [[0.1] * D]}, 400, "2 texts for 1 vectors"),
    ("/score", {"texts": [3], "vectors": [[0.1] * D]}, 400, "field 'texts', item 0: expected a string or null"),
    ("/score", {"texts": ["a"], "vectors": [[float("nan")] * D]}, 400, "field 'vectors': entry [0, 0] is nan"),
    ("/score", {"texts": ["a"], "vectors": [[1e30] * D]}, 400, "overflows float32"),
]


@pytest.mark.parametrize("body,status,reason", BAD, ids=[f"{i}-{b[2][:30]}" for i, b in enumerate(BAD)])
def test_bad_generate_input_is_a_one_line_4xx(server, body, status, reason):
    body = {"sampling_params": SP, **body} if "sampling_params" not in body and body else body
    r = _post(server.url, "/generate", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert reason in err and "\n" not in err


@pytest.mark.parametrize("path,body,status,reason", BAD_NLA, ids=[f"{i}-{b[3][:30]}" for i, b in enumerate(BAD_NLA)])
def test_bad_verbalize_and_score_input_is_a_one_line_4xx(server, path, body, status, reason):
    r = _post(server.url, path, body)
    assert r.status_code == status, r.text
    assert reason in r.json()["error"] and "\n" not in r.json()["error"]


@pytest.fixture(scope="module")
def small_server(pair):
    s = NLAService.load(str(pair[0]), None, device="cpu",
                        limits=ServeLimits(max_body_bytes=100_000, max_prompt_tokens=256, max_new_tokens=64))
    with BackgroundServer(create_app(s, allowed_hosts=list(LOOPBACK))) as srv:
        yield srv
    s.close()


def test_bodies_hosts_and_the_server_keeps_answering(server, small_server):
    url = server.url
    r = httpx.post(f"{url}/generate", content=b"text=hi", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    r = httpx.post(f"{url}/generate", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(f"{url}/generate", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "expected a JSON object, found list" in r.json()["error"]
    r = httpx.post(f"{url}/generate", content=b'{"input_ids": ' + b"1" * 5000 + b"}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not usable JSON" in r.json()["error"]
    big = json.dumps({"input_embeds": [[0.1] * D] * 2000}).encode()
    r = httpx.post(f"{small_server.url}/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "the cap is 100000" in r.json()["error"]
    assert httpx.get(f"{url}/nothing").status_code == 404
    # the Host check: only :port may follow an IPv6 literal's bracket
    for bad in ("[::1]evil.com", "[::1]:80evil", "evil.example", "localhost:evil"):
        r = httpx.get(f"{url}/health", headers={"host": bad})
        assert r.status_code == 400 and "Invalid host header" in r.json()["error"], bad
    for good in ("[::1]:8000", "[::1]", "localhost", "127.0.0.1:1"):
        assert httpx.get(f"{url}/health", headers={"host": good}).status_code == 200, good
    assert [host_name(h) for h in ("[::1]evil.com", "[::1]:12", "a.b:x", "a.b:80")] == [
        "[::1]evil.com", "::1", "a.b:x", "a.b"]
    # still answering, after every bad request of this module
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert _post(url, "/generate", {"input_embeds": GOOD, "sampling_params": SP}).status_code == 200


# --------------------------------------------------------------------- the command line
def test_cli_parses_and_refuses_bad_port_and_host(pair, capsys):
    args = build_parser().parse_args(["serve", "--av", str(pair[0]), "--port", "8123", "--allow-host", "lab",
                                      "--max-batch", "8", "--threads", "1"])
    assert (args.port, args.allow_host, args.max_batch, args.host) == (8123, ["lab"], 8, "127.0.0.1")
    for bad, said in (("0", "expected a port 1-65535, found 0"), ("70000", "found 70000"),
                      ("http", "expected an integer port 1-65535, found 'http'")):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", "--av", str(pair[0]), "--port", bad])
        assert exc.value.code == 2 and said in capsys.readouterr().err
    # a host that cannot be bound is refused before the models load, as one line
    assert main(["serve", "--av", str(pair[0]), "--host", "no-such-host.invalid", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "nla serve: error: --host: cannot resolve 'no-such-host.invalid'" in err and err.count("\n") == 1
    assert main(["serve", "--av", str(pair[0] / "nope"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
    from nla.commands import serve as serve_cmd

    app = serve_cmd.build(build_parser().parse_args(["serve", "--av", str(pair[0]), "--device", "cpu",
                                                     "--max-new-tokens", "9", "--threads", "1"]))
    assert any("HostAllowList" in repr(m.cls) for m in app.user_middleware)
    with BackgroundServer(app) as srv:
        info = httpx.get(f"{srv.url}/info").json()
        assert info["limits"]["max_new_tokens"] == 9 and info["av"] == str(pair[0])
        assert re.search("Invalid host header 'evil.example'", httpx.get(
            f"{srv.url}/health", headers={"host": "evil.example"}).text)


def test_prompts_of_different_lengths_decode_together_as_alone(service):
    """Left padding: a short and a long prompt in one batch give each one's tokens decoded alone
    (the positions follow the attention mask)."""
    from nla.serve.engine import GenerateJob, SamplingParams, decode_batch

    emb = service.model.get_input_embeddings()

    def job(text: str) -> GenerateJob:
        with torch.no_grad():
            e = emb(torch.tensor(service.tokenizer(text)["input_ids"])).float()
        return GenerateJob(e, SamplingParams.parse({"temperature": 0, "max_new_tokens": 12}, service.limits))

    texts = ["the cat walks", "the dog sleeps in the house and the cat walks to the garden"]
    alone = [decode_batch(service.model, [job(t)], service.eos_id, service.pad_id, service.suppress_ids)[0]
             for t in texts]
    together = decode_batch(service.model, [job(t) for t in texts], service.eos_id, service.pad_id,
                            service.suppress_ids)
    assert together == alone
    assert alone[0] != alone[1]


# --------------------------------------------------------------------- issue 58: bounds before work
def _raw_request(srv, data: bytes, *, read: bool = True, timeout: float = 10.0) -> bytes:
    import socket

    with socket.create_connection((srv.host, srv.port), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


ISSUE58_BAD = [
    # an empty text was a 500 with a traceback in the log
    ("/generate", {"text": ""}, 400, "field 'text': is empty; send a prompt of at least one character"),
    ("/generate", {"text": ["hi", ""]}, 400, "field 'text', item 1: is empty"),
    # a text longer than the token cap can hold is refused before the tokenizer runs (256 tokens x 32 bytes)
    ("/generate", {"text": "ab" * 50_000}, 413, "field 'text': 100000 bytes, more than 256 tokens "
                                                 "(--max-prompt-tokens) can hold at 32 bytes a token"),
    # the prompt must fit the AV's 128 positions (max_position_embeddings)
    ("/generate", {"input_ids": [5] * 200}, 400, "field 'input_ids': 200 tokens; the AV has 128 positions"),
    # the decode work of one request, bounded before any is done: 200 x 16 x 64 tokens
    ("/verbalize", {"vectors": [[0.1] * D] * 200, "n_samples": 16, "max_new_tokens": 64, "greedy": False}, 413,
     "200 vectors x n_samples 16 x max_new_tokens 64 = 204800 tokens to decode; the cap is 65536"),
    ("/generate", {"input_ids": [[5, 6]] * 64, "sampling_params": {"max_new_tokens": 64, "temperature": 0}}, 200, None),
    # numbers as strings are not numbers
    ("/verbalize", {"vectors": [[0.1] * D], "max_new_tokens": "5"}, 400, "field 'max_new_tokens': expected int, found str"),
    ("/verbalize", {"vectors": [[0.1] * D], "greedy": False, "temperature": "0.5"}, 400,
     "field 'temperature': expected float or int, found str"),
    ("/verbalize", {"vectors": [["0.1"] * D]}, 400, "field 'vectors': expected numbers, found a str ('0.1')"),
    ("/generate", {"input_embeds": [[0.1] * (D - 1) + ["1e3"]]}, 400,
     "field 'input_embeds': expected numbers, found a str ('1e3')"),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "8"}}, 400,
     "'sampling_params.max_new_tokens': expected a number, found str"),
    ("/generate", {"input_ids": ["5", "6"]}, 400, "field 'input_ids': expected a non-empty list of token ids"),
]


@pytest.mark.parametrize("path,body,status,reason", ISSUE58_BAD, ids=[f"{i}" for i in range(len(ISSUE58_BAD))])
def test_each_request_is_bounded_before_its_work(server, path, body, status, reason):
    r = _post(server.url, path, body)
    assert r.status_code == status, r.text
    if reason is not None:
        assert reason in r.json()["error"] and "\n" not in r.json()["error"]


def test_a_prompt_near_the_end_of_the_positions_is_decoded_only_up_to_them(server):
    """prompt + max_new_tokens past the AV's 128 positions: the decode stops at them ("length", cut count)."""
    r = _post(server.url, "/generate", {"input_ids": [5] * 120, "sampling_params": {"max_new_tokens": 64,
                                                                                     "temperature": 0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["prompt_tokens"] == 120 and meta["completion_tokens"] <= 8
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == 8


def test_duplicate_json_keys_are_refused(server):
    raw = b'{"input_ids": [5, 6], "input_ids": [7]}'
    r = httpx.post(f"{server.url}/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "the key 'input_ids' is given twice in one object" in r.json()["error"]
    raw = b'{"vectors": [[1]], "greedy": true, "greedy": false}'
    r = httpx.post(f"{server.url}/verbalize", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "the key 'greedy' is given twice" in r.json()["error"]


def test_slow_bodies_idle_connections_and_disconnects(pair, caplog):
    """A client that sent a byte a second held its connection and the server's buffer; an idle
    keep-alive connection was never closed; a client that disconnected mid-body was logged as a traceback."""
    import time

    from nla.serve.app import uvicorn_settings

    limits = ServeLimits(max_new_tokens=8, body_timeout_s=1.0, keep_alive_s=1.0, header_timeout_s=1.5)
    s = NLAService.load(str(pair[0]), None, device="cpu", limits=limits)
    settings = uvicorn_settings(limits)
    assert {k: v for k, v in settings.items() if k != "http"} == {"timeout_keep_alive": 1, "limit_concurrency": 256}
    assert settings["http"].head_timeout_s == 1.5
    try:
        with BackgroundServer(create_app(s, allowed_hosts=list(LOOPBACK)), **settings) as srv:
            import socket

            # a request head sent a byte every 0.3 s (never done): a 408 and the connection closed after
            # header_timeout_s, though bytes kept coming (the keep-alive timer restarts on every byte)
            with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
                t0 = time.monotonic()
                got = b""
                try:
                    for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 40:
                        sock.sendall(bytes([byte]))
                        time.sleep(0.3)
                        sock.setblocking(False)
                        try:
                            got += sock.recv(65536)
                        except BlockingIOError:
                            pass
                        finally:
                            sock.setblocking(True)
                        if got:
                            break
                except (BrokenPipeError, ConnectionResetError):
                    pass
                assert got.startswith(b"HTTP/1.1 408"), got[:200]
                assert b"the request line and headers did not arrive within 1.5 s" in got
                assert 1.4 < time.monotonic() - t0 < 5
            # a whole request right away is unaffected, and so is the second request on one connection
            with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
                for _ in range(2):
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    got = b""
                    while not got.endswith(b'{"status":"ok"}'):
                        got += sock.recv(65536)
                    assert got.startswith(b"HTTP/1.1 200")
            head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n")
            t0 = time.monotonic()
            out = _raw_request(srv, head + b'{"input_ids": [5')  # and nothing more
            assert out.startswith(b"HTTP/1.1 408"), out[:200]
            assert b"request body did not arrive within 1 s (16 bytes came)" in out
            assert time.monotonic() - t0 < 8
            # an idle keep-alive connection is closed by the server after keep_alive_s
            import socket

            with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                t0 = time.monotonic()
                got = b""
                while chunk := sock.recv(65536):  # the answer, then b"" when the server closes
                    got += chunk
                assert got.startswith(b"HTTP/1.1 200") and got.endswith(b'{"status":"ok"}')
                assert time.monotonic() - t0 < 5  # closed by the server after ~1 s, not by the 10 s socket timeout
            # a client gone mid-body: no traceback, no error logged; the server answers the next one
            with caplog.at_level("WARNING"):
                _raw_request(srv, head + b'{"input_ids"', read=False)
                time.sleep(0.5)
                assert httpx.get(f"{srv.url}/health").status_code == 200
            assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info], \
                [r.getMessage() for r in caplog.records]
    finally:
        s.close()
