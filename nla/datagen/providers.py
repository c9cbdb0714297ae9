"""HTTP explainers: Anthropic Messages API and OpenAI-compatible chat completions.

1. The API key is read from an environment variable (`provider.api_key_env`)
   at construction and kept out of logs, reprs and errors.
2. Requests run on a thread pool of `max_concurrency` workers sharing one
   `httpx.Client` (bounded concurrency without asyncio in the caller).
3. 429, 5xx, timeouts and connection errors are retried up to `max_retries`
   times with exponential backoff (`backoff_base_s * 2**attempt`, capped at
   `backoff_max_s`); other 4xx are not retried.
4. The reply must contain exactly one `<explanation>...</explanation>`; a row
   whose reply is missing it, is malformed, or still fails after the retries
   is dropped and counted by reason (`no_tag`, `malformed_response`,
   `timeout`, `http_429`, `http_503`, ...). Nothing is kept silently.
5. No network is not a row's problem: once `CONNECTION_FAILURE_ROWS` rows in a row
   could not connect at all (every attempt a connection error, nothing answered in
   between), the run stops with the cause instead of dropping every row after
   minutes of silent retries. The first retry of each reason is logged at WARNING.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nla.datagen.config import DatagenConfig, ProviderConfig
from nla.datagen.explainer_base import Explainer, extract_tagged, register_explainer
from nla.datagen.io import DatagenError

log = logging.getLogger(__name__)

MAX_CONTEXT_CHARS = 4000  # bound the prompt: the text right before the token matters most
MAX_REPLY_BYTES = 4 * 2**20  # an explanation reply is a few kB; a larger one is dropped as reply_too_large
CONNECTION_FAILURE_ROWS = 3  # rows in a row that never connected: the network or base_url is wrong

SYSTEM_PROMPT = (
    "You interpret the internal state of a language model. You are shown a text the model has read; "
    "its internal state at the final token is being studied."
)
USER_PROMPT = (
    "Text read so far (it ends at the current token):\n<text>\n{context}\n</text>\n"
    'Current token: "{token}"\n\n'
    "In two or three short sentences, describe what the model is most likely representing at the current "
    "token: the topic, the entities and facts established so far, and what is likely to come next. "
    "Answer with exactly one <explanation>...</explanation> block and nothing else."
)


def build_prompt(row: dict[str, Any]) -> str:
    context = row.get("context") or ""
    if len(context) > MAX_CONTEXT_CHARS:
        context = "..." + context[-MAX_CONTEXT_CHARS:]
    return USER_PROMPT.format(context=context, token=row.get("token") or "")


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None, cause: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.cause = cause


class _Drop(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class HTTPExplainer(Explainer):
    """Shared request/retry/extraction logic; subclasses define URL, headers, body and reply parsing."""

    default_base_url = ""
    default_key_env = ""
    system_prompt = SYSTEM_PROMPT

    def __init__(self, cfg: ProviderConfig) -> None:
        super().__init__()
        import httpx

        if not cfg.model:
            raise DatagenError(
                f"{self.name} explainer: provider.model is empty; set the model name in the config"
            )
        env = cfg.api_key_env or self.default_key_env
        key = os.environ.get(env)
        if not key:
            raise DatagenError(
                f"{self.name} explainer: environment variable {env} is not set; export the API key there"
            )
        self.cfg = cfg
        self._key = key  # never logged; excluded from repr
        self.base_url = (cfg.base_url or self.default_base_url).rstrip("/")
        self._client = httpx.Client(timeout=httpx.Timeout(cfg.timeout_s))
        self._lock = threading.Lock()
        self.retries: Counter = Counter()  # reason -> retried attempts (not drops)
        self._unconnected_rows = 0  # consecutive rows whose every attempt was a connection error
        self._abort: DatagenError | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.cfg.model!r}, base_url={self.base_url!r})"

    def prompt(self, row: dict[str, Any]) -> str:
        """The user message for one row (the explainer's: ``build_prompt``)."""
        return build_prompt(row)

    # --- provider specifics ------------------------------------------------
    def url(self) -> str:
        raise NotImplementedError

    def headers(self) -> dict[str, str]:
        raise NotImplementedError

    def body(self, prompt: str) -> dict[str, Any]:
        raise NotImplementedError

    def reply_text(self, data: Any) -> str:
        """The model's reply text from the decoded JSON body; raise KeyError/TypeError/IndexError if malformed."""
        raise NotImplementedError

    # --- shared logic ------------------------------------------------------
    def _attempt(self, prompt: str) -> str:
        import httpx

        # timeout_s bounds the whole request, not each read: a server that sends one byte a second
        # held nla datagen forever under httpx's per-read timeout (issue 58). The deadline is checked
        # after every read, and httpx bounds each read by timeout_s too, so an attempt ends within
        # 2 x timeout_s whatever the server does (within timeout_s plus the last read's wait).
        deadline = time.monotonic() + self.cfg.timeout_s
        try:
            with self._client.stream("POST", self.url(), headers=self.headers(), json=self.body(prompt)) as resp:
                chunks, size = [], 0
                for chunk in resp.iter_bytes():
                    size += len(chunk)
                    if size > MAX_REPLY_BYTES:
                        raise _Drop("reply_too_large")
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise _Retryable("timeout")
                if time.monotonic() > deadline:
                    raise _Retryable("timeout")
                body = b"".join(chunks)
        except httpx.TimeoutException as exc:
            raise _Retryable("timeout") from exc
        except httpx.TransportError as exc:
            raise _Retryable("connection_error", cause=f"{type(exc).__name__}: {exc}") from exc
        code = resp.status_code
        if code == 429 or code >= 500:
            retry_after = None
            try:
                retry_after = float(resp.headers.get("retry-after", ""))
            except ValueError:
                pass
            raise _Retryable(f"http_{code}", retry_after)
        if code >= 400:
            raise _Drop(f"http_{code}")
        try:
            text = self.reply_text(json.loads(body))
            if not isinstance(text, str):
                raise TypeError("reply text is not a string")
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise _Drop("malformed_response") from exc
        explanation = extract_tagged(text)
        if explanation is None:
            raise _Drop("no_tag")
        return explanation

    def explain_one(self, row: dict[str, Any]) -> tuple[str | None, str | None]:
        """(explanation, None) or (None, drop reason)."""
        if self._abort is not None:
            return None, "aborted"
        text, reason, cause = self._explain_one(row)
        with self._lock:
            if reason == "connection_error" and cause is not None:
                self._unconnected_rows += 1
                if self._unconnected_rows >= CONNECTION_FAILURE_ROWS and self._abort is None:
                    self._abort = DatagenError(
                        f"{self.name} explainer: {self._unconnected_rows} rows in a row could not connect to "
                        f"{self.base_url} ({cause}; {self.cfg.max_retries + 1} attempts each); check the network, "
                        "a proxy, or provider.base_url, then rerun (finished stages are kept)")
            else:
                self._unconnected_rows = 0
        return text, reason

    def _explain_one(self, row: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
        """(explanation, None, None) or (None, drop reason, the connection error when every attempt was one)."""
        prompt = self.prompt(row)
        only_connection = True
        for attempt in range(self.cfg.max_retries + 1):
            try:
                return self._attempt(prompt), None, None
            except _Drop as d:
                return None, d.reason, None
            except _Retryable as r:
                only_connection = only_connection and r.reason == "connection_error"
                if attempt == self.cfg.max_retries:
                    return None, r.reason, r.cause if only_connection else None
                if self._abort is not None:
                    return None, "aborted", None
                with self._lock:
                    first = self.retries[r.reason] == 0
                    self.retries[r.reason] += 1
                if first:
                    log.warning("%s: %s (%s); retrying up to %d times with backoff", self.name, r.reason,
                                r.cause or "the server asked to retry", self.cfg.max_retries)
                delay = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2**attempt)
                if r.retry_after is not None:
                    delay = min(self.cfg.backoff_max_s, max(delay, r.retry_after))
                log.debug("%s: %s for doc %s pos %s, retry %d in %.2fs", self.name, r.reason,
                          row.get("doc_id"), row.get("position"), attempt + 1, delay)  # fmt: skip
                time.sleep(delay)
        raise AssertionError("unreachable")

    def explain_batch(self, rows: list[dict[str, Any]]) -> list[str | None]:
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, max(1, len(rows)))) as pool:
            results = list(pool.map(self.explain_one, rows))
        if self._abort is not None:
            raise self._abort
        out = []
        for text, reason in results:
            if text is None:
                self.drops[reason or "unspecified"] += 1
            out.append(text)
        return out

    def close(self) -> None:
        self._client.close()


class AnthropicExplainer(HTTPExplainer):
    name = "anthropic"
    default_base_url = "https://api.anthropic.com"
    default_key_env = "ANTHROPIC_API_KEY"
    api_version = "2023-06-01"

    def url(self) -> str:
        return f"{self.base_url}/v1/messages"

    def headers(self) -> dict[str, str]:
        return {
            "x-api-key": self._key,
            "anthropic-version": self.api_version,
            "content-type": "application/json",
        }

    def body(self, prompt: str) -> dict[str, Any]:
        return {
            "model": self.cfg.model,
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "system": self.system_prompt,
            "messages": [{"role": "user", "content": prompt}],
        }

    def reply_text(self, data: Any) -> str:
        blocks = data["content"]
        texts = [b["text"] for b in blocks if b.get("type") == "text"]
        if not texts:
            raise KeyError("no text block")
        return "".join(texts)


class OpenAIExplainer(HTTPExplainer):
    name = "openai"
    default_base_url = "https://api.openai.com/v1"
    default_key_env = "OPENAI_API_KEY"

    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._key}", "content-type": "application/json"}

    def body(self, prompt: str) -> dict[str, Any]:
        return {
            "model": self.cfg.model,
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "messages": [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": prompt}],
        }

    def reply_text(self, data: Any) -> str:
        return data["choices"][0]["message"]["content"]


@register_explainer("anthropic")
def _anthropic(cfg: DatagenConfig) -> Explainer:
    return AnthropicExplainer(cfg.provider)


@register_explainer("openai")
def _openai(cfg: DatagenConfig) -> Explainer:
    return OpenAIExplainer(cfg.provider)


# ------------------------------------------------------------------ paraphrasing (nla.eval.suite's hidden-code test)
PARAPHRASE_SYSTEM_PROMPT = "You rewrite sentences in other words without changing what they say."
PARAPHRASE_PROMPT = (
    "Rewrite the sentence below in other words. Keep every fact, name and quotation exactly; add nothing and "
    "leave nothing out.\n<sentence>\n{claim}\n</sentence>\n"
    "Answer with exactly one <explanation>...</explanation> block holding the rewritten sentence and nothing else."
)
_PROVIDERS = {"anthropic": AnthropicExplainer, "openai": OpenAIExplainer}


def provider_paraphraser(provider: str, cfg: ProviderConfig):
    """A paraphraser for ``nla.eval.suite.hidden_code_variants``: list of claims -> their re-phrasings
    (None where the provider dropped one), through the configured provider (``anthropic`` or
    ``openai``) with its retries and concurrency. Needs the provider's key, like the explainer."""
    if provider not in _PROVIDERS:
        raise ValueError(f"paraphrase provider: expected one of {sorted(_PROVIDERS)}, found {provider!r}")

    class _Paraphrase(_PROVIDERS[provider]):  # the provider's request and reply format, another prompt
        system_prompt = PARAPHRASE_SYSTEM_PROMPT

        def prompt(self, row: dict[str, Any]) -> str:
            return PARAPHRASE_PROMPT.format(claim=row["claim"])

    client = _Paraphrase(cfg)

    def paraphrase(claims: list[str]) -> list[str | None]:
        return client.explain_batch([{"claim": c} for c in claims])

    return paraphrase
