"""HTTP explainers against a real local HTTP server (no patched client)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nla.datagen.config import DatagenConfig, ProviderConfig
from nla.datagen.explain import extract_tagged, make_explainer
from nla.datagen.io import DatagenError
from nla.datagen.providers import AnthropicExplainer, OpenAIExplainer

KEY = "sk-test-secret-123"


class FakeAPI:
    """Serves scripted replies in order: (status, body (dict|str), delay_s). Records every request."""

    def __init__(self) -> None:
        self.script: list[tuple[int, object, float]] = []
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length))
                with api.lock:
                    api.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    status, reply, delay = api.script.pop(0) if api.script else (500, "script exhausted", 0)
                time.sleep(delay)
                data = reply if isinstance(reply, str) else json.dumps(reply)
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.end_headers()
                    self.wfile.write(data.encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and went away: expected in the timeout test

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api(monkeypatch):
    monkeypatch.setenv("NLA_TEST_KEY", KEY)
    srv = FakeAPI()
    yield srv
    srv.close()


def provider(api, **kw) -> ProviderConfig:
    args = dict(model="m-1", base_url=api.url, api_key_env="NLA_TEST_KEY", max_retries=2, backoff_base_s=0.01,
                backoff_max_s=0.02, timeout_s=2.0, max_concurrency=1)  # fmt: skip
    args.update(kw)
    return ProviderConfig(**args)


def anthropic_reply(text: str) -> dict:
    return {"content": [{"type": "text", "text": text}], "role": "assistant"}


def openai_reply(text: str) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}


ROW = {"doc_id": 1, "position": 5, "context": "Alice walks to the market", "token": " market"}


def test_anthropic_request_shape_and_success(api):
    api.script = [(200, anthropic_reply("ok <explanation>\n Alice at the market.\n</explanation>"), 0)]
    ex = AnthropicExplainer(provider(api))
    assert ex.explain_batch([ROW]) == ["Alice at the market."]
    (req,) = api.requests
    assert req["path"] == "/v1/messages"
    headers = {k.lower(): v for k, v in req["headers"].items()}
    assert headers["x-api-key"] == KEY and headers["anthropic-version"] == "2023-06-01"
    assert req["body"]["model"] == "m-1" and req["body"]["max_tokens"] == 300
    (msg,) = req["body"]["messages"]
    assert (
        msg["role"] == "user"
        and "Alice walks to the market" in msg["content"]
        and '" market"' in msg["content"]
    )
    assert KEY not in repr(ex)
    assert ex.drops == Counter()


def test_openai_request_shape_and_success(api):
    api.script = [(200, openai_reply("<explanation>a market</explanation>"), 0)]
    ex = OpenAIExplainer(provider(api))
    assert ex.explain_batch([ROW]) == ["a market"]
    (req,) = api.requests
    assert req["path"] == "/chat/completions"
    headers = {k.lower(): v for k, v in req["headers"].items()}
    assert headers["authorization"] == f"Bearer {KEY}"
    assert [m["role"] for m in req["body"]["messages"]] == ["system", "user"]
    assert req["body"]["model"] == "m-1"


@pytest.mark.parametrize("status", [429, 503])
def test_retry_then_success(api, status):
    api.script = [(status, {"error": "busy"}, 0), (status, {"error": "busy"}, 0),
                  (200, openai_reply("<explanation>fine</explanation>"), 0)]  # fmt: skip
    ex = OpenAIExplainer(provider(api))
    assert ex.explain_batch([ROW]) == ["fine"]
    assert len(api.requests) == 3
    assert ex.retries == Counter({f"http_{status}": 2}) and ex.drops == Counter()


def test_retries_exhausted_is_counted_drop(api):
    api.script = [(500, "{}", 0)] * 3  # max_retries=2 -> 3 attempts, all fail
    ex = OpenAIExplainer(provider(api))
    assert ex.explain_batch([ROW]) == [None]
    assert len(api.requests) == 3 and ex.drops == Counter({"http_500": 1})


def test_timeout_retried_then_dropped(api):
    api.script = [(200, openai_reply("<explanation>late</explanation>"), 1.0)] * 2
    ex = OpenAIExplainer(provider(api, timeout_s=0.2, max_retries=1))
    assert ex.explain_batch([ROW]) == [None]
    assert len(api.requests) == 2  # first attempt + one retry
    assert ex.retries == Counter({"timeout": 1}) and ex.drops == Counter({"timeout": 1})


def test_malformed_and_missing_tag_dropped_and_counted(api):
    api.script = [
        (200, "not json at all", 0),
        (200, {"unexpected": True}, 0),
        (200, anthropic_reply("I think it is about a market."), 0),
        (200, anthropic_reply("<explanation>a</explanation><explanation>b</explanation>"), 0),
        (200, anthropic_reply("<explanation>good</explanation>"), 0),
        (400, {"error": "bad request"}, 0),
    ]
    ex = AnthropicExplainer(provider(api))  # max_concurrency=1 keeps the script order = row order
    got = ex.explain_batch([dict(ROW, position=i) for i in range(6)])
    assert got == [None, None, None, None, "good", None]
    assert ex.drops == Counter({"malformed_response": 2, "no_tag": 2, "http_400": 1})
    assert len(api.requests) == 6  # none of these is retried


def test_concurrency_all_rows_answered(api):
    api.script = [(200, openai_reply(f"<explanation>r{i}</explanation>"), 0.05) for i in range(8)]
    ex = OpenAIExplainer(provider(api, max_concurrency=4))
    got = ex.explain_batch([dict(ROW, position=i) for i in range(8)])
    assert sorted(got) == sorted(f"r{i}" for i in range(8))


def test_missing_key_and_model_errors(monkeypatch):
    monkeypatch.delenv("NLA_MISSING_KEY", raising=False)
    with pytest.raises(DatagenError, match="environment variable NLA_MISSING_KEY is not set"):
        OpenAIExplainer(ProviderConfig(model="x", api_key_env="NLA_MISSING_KEY"))
    with pytest.raises(DatagenError, match="provider.model is empty"):
        AnthropicExplainer(ProviderConfig(model=""))


def test_registry_lists_valid_names(tmp_path):
    cfg = DatagenConfig(source="file", corpus_path="x.txt", model_dir="m", layer_index=0, explainer="context")
    with pytest.raises(
        DatagenError,
        match=r"'nope' is not registered; valid names: \['anthropic', 'context', 'openai', 'wiki', 'world'\]",
    ):
        make_explainer("nope", cfg)


def test_extract_tagged_strict():
    assert extract_tagged("<explanation> x y </explanation>") == "x y"
    assert extract_tagged("pre <explanation>\nmulti\nline\n</explanation> post") == "multi\nline"
    for bad in ("", "no tag", "<explanation></explanation>", "<explanation>open only",
                "<explanation>a</explanation> <explanation>b</explanation>", "<explanation><explanation>x</explanation>"):  # fmt: skip
        assert extract_tagged(bad) is None, bad


def test_no_network_stops_the_run_early_with_the_cause(monkeypatch, caplog):
    """A base_url nothing listens on: every attempt is a connection error. After
    CONNECTION_FAILURE_ROWS rows the explainer stops, naming the URL and the error, instead of
    dropping all 40 rows after their retries."""
    import logging
    import socket

    from nla.datagen.io import DatagenError
    from nla.datagen.providers import CONNECTION_FAILURE_ROWS

    monkeypatch.setenv("NLA_TEST_KEY", KEY)
    with socket.socket() as sock:  # a port that was free a moment ago and now has no listener
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = ProviderConfig(model="m-1", base_url=f"http://127.0.0.1:{port}", api_key_env="NLA_TEST_KEY",
                         max_retries=1, backoff_base_s=0.01, backoff_max_s=0.02, timeout_s=2.0, max_concurrency=1)
    ex = OpenAIExplainer(cfg)
    with caplog.at_level(logging.WARNING, logger="nla.datagen.providers"):
        with pytest.raises(DatagenError, match=rf"{CONNECTION_FAILURE_ROWS} rows in a row could not connect to "
                                               rf"http://127.0.0.1:{port} \(ConnectError: .*2 attempts each\); check "
                                               "the network"):
            ex.explain_batch([ROW] * 40)
    # one concurrent worker: the rows after the third were never sent
    assert ex.retries["connection_error"] == CONNECTION_FAILURE_ROWS
    assert caplog.text.count("connection_error (ConnectError") == 1  # the first retry is said, once


def test_a_server_that_answers_resets_the_connection_count(api):
    """Connection errors that alternate with answers are a flaky network, not no network: rows drop."""
    api.script = [(200, openai_reply("<explanation>fine</explanation>"), 0)] * 5
    ex = OpenAIExplainer(provider(api))
    ex._unconnected_rows = 2  # as if two rows had just failed to connect
    assert ex.explain_batch([ROW]) == ["fine"] and ex._unconnected_rows == 0


def test_provider_paraphraser_asks_for_each_claim_and_returns_its_rewrite(api):
    from nla.core.graders import get_grader
    from nla.datagen.providers import PARAPHRASE_SYSTEM_PROMPT, provider_paraphraser
    from nla.eval.suite import hidden_code_variants

    api.script = [(200, openai_reply("<explanation>It was raining.</explanation>"), 0),
                  (200, openai_reply("no tag at all"), 0)]
    para = provider_paraphraser("openai", provider(api))
    v = hidden_code_variants(['He said "hi". It rained. Felix ran.'], get_grader("generic"), paraphraser=para)
    # the quotation is kept; a dropped answer keeps the claim as written
    assert v["paraphrase"] == ['He said "hi". It was raining. Felix ran.']
    assert [r["body"]["messages"][0]["content"] for r in api.requests] == [PARAPHRASE_SYSTEM_PROMPT] * 2
    assert "<sentence>\nIt rained.\n</sentence>" in api.requests[0]["body"]["messages"][1]["content"]
    with pytest.raises(ValueError, match="expected one of"):
        provider_paraphraser("mistral", provider(api))


def test_timeout_s_bounds_the_whole_reply_not_each_read(monkeypatch):
    """An endpoint that sends one byte at a time held nla datagen forever: httpx's timeout applies per
    read (issue 58). A real server trickles a reply a byte every 0.2 s; timeout_s 1 ends the attempt."""
    monkeypatch.setenv("NLA_TEST_KEY", KEY)
    stop = threading.Event()

    class Trickle(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            try:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "100000")
                self.end_headers()
                while not stop.is_set():
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cfg = ProviderConfig(model="m-1", base_url=f"http://127.0.0.1:{srv.server_address[1]}", api_key_env="NLA_TEST_KEY",
                             max_retries=1, backoff_base_s=0.01, backoff_max_s=0.02, timeout_s=1.0, max_concurrency=1)
        ex = OpenAIExplainer(cfg)
        t0 = time.monotonic()
        assert ex.explain_batch([ROW]) == [None]
        took = time.monotonic() - t0
        assert 2.0 <= took < 5.0, took  # two attempts of ~1 s each (per-read, it never ended)
        assert ex.retries == Counter({"timeout": 1}) and ex.drops == Counter({"timeout": 1})
    finally:
        stop.set()
        srv.shutdown()
        srv.server_close()
