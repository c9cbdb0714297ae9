"""``nla serve``'s ASGI app: SGLang's ``/generate`` (what the published NLA client posts), and nla's own
``/verbalize``, ``/score`` and ``/info`` (docs/serve.md).

Safety as in ``nla explore`` (``nla.util.http``): the Host allow-list, JSON bodies only and capped,
every field checked (a bad one is ``{"error": "<one line>"}`` with a 4xx status), model work on the
batcher's thread (never on the event loop), an unexpected error logged and answered as a 500 while
the server keeps running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from nla.client import NLAClient, NLAClientError
from nla.core import arch
from nla.serve.engine import (
    MAX_BYTES_PER_TOKEN,
    Batcher,
    GenerateJob,
    SamplingParams,
    ServeLimits,
    decode_batch,
    generation_output,
)
from nla.util.http import (
    HostAllowList,
    RequestError,
    check_text,
    error_response,
    float_array,
    get_field,
    read_json_body,
)
from nla.util.threads import adapt_threads
from nla.util.validation import InputError, check_sampling

logger = logging.getLogger(__name__)

__all__ = ["GENERATE_KEYS", "NLAService", "create_app"]

# /generate's top-level keys; exactly one of the first three
GENERATE_KEYS = ("input_embeds", "input_ids", "text", "sampling_params", "rid", "stream", "return_logprob")


def _nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else x


class NLAService:
    """The loaded checkpoints, the batcher over them, and what each endpoint computes."""

    def __init__(self, client: NLAClient, limits: ServeLimits | None = None, *, av_path: str | None = None,
                 ar_path: str | None = None) -> None:
        self.client, self.limits = client, limits or ServeLimits()
        side = client.require_av("nla serve")
        self.av_path, self.ar_path = av_path, ar_path
        self.model, self.tokenizer, self.sidecar = client.av_model, client.av_tokenizer, side
        self.hidden_size = arch.hidden_size(self.model.config)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id)
        self.suppress_ids = [int(side.injection_token_id)]  # as NLAClient.verbalize: the AV never writes the marker
        self.context = arch.max_positions(self.model.config) or 0  # 0: the config names no limit
        self.batcher = Batcher(self._decode, self.limits)

    @classmethod
    def load(cls, av: str, ar: str | None = None, *, device: str = "auto", dtype: str = "float32",
             limits: ServeLimits | None = None) -> NLAService:
        """Through ``NLAClient``: every sidecar, tokenizer and provenance check of nla applies."""
        client = NLAClient(av, ar, device=device, dtype=dtype)
        return cls(client, limits, av_path=str(Path(av)), ar_path=str(Path(ar)) if ar is not None else None)

    def close(self) -> None:
        self.batcher.close()

    def _decode(self, jobs: list[GenerateJob]) -> list[dict[str, Any]]:
        """The batch's SGLang response objects (the texts decoded here too: one thread uses the tokenizer)."""
        adapt_threads()
        ids = decode_batch(self.model, jobs, self.eos_id, self.pad_id, self.suppress_ids)
        return [generation_output(self.tokenizer, row, job.params, job.embeds.shape[0], self.eos_id)
                for job, row in zip(jobs, ids, strict=True)]

    # ------------------------------------------------------------------ inputs of /generate
    def prompts(self, body: dict[str, Any]) -> tuple[list[torch.Tensor], bool]:
        """Each prompt's embeddings [T, H] (fp32, CPU), and whether the request was a batch (a list)."""
        given = [k for k in ("input_embeds", "input_ids", "text") if body.get(k) is not None]
        if len(given) != 1:
            if "input_embeds" in given and "input_ids" in given:
                raise RequestError("give either 'input_embeds' or 'input_ids', not both (SGLang's behaviour with both "
                                 "is ambiguous)")
            raise RequestError(f"give exactly one of 'input_embeds', 'input_ids' or 'text', found {given or 'none'}")
        key = given[0]
        value = body[key]
        if key == "text":
            texts = [value] if isinstance(value, str) else value
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("field 'text': expected a string or a non-empty list of strings")
            self._count_prompts(len(texts))
            out = []
            for i, t in enumerate(texts):
                what = f"field 'text'{'' if isinstance(value, str) else f', item {i}'}"
                check_text(t, what)
                if not t:  # no token to start from: the decode failed with a 500 and a traceback (issue 58)
                    raise RequestError(f"{what}: is empty; send a prompt of at least one character")
                most = self.limits.max_prompt_tokens * MAX_BYTES_PER_TOKEN
                if len(t) > most or len(t.encode("utf-8")) > most:  # bounded before the tokenizer runs
                    raise RequestError(f"{what}: {len(t.encode('utf-8'))} bytes, more than "
                                       f"{self.limits.max_prompt_tokens} tokens (--max-prompt-tokens) can hold at "
                                       f"{MAX_BYTES_PER_TOKEN} bytes a token; send a shorter prompt", status=413)
                ids = list(self.tokenizer(t)["input_ids"])
                if not ids:
                    raise RequestError(f"{what}: the tokenizer gives no token for it; send a prompt with text")
                out.append(self._embed_ids(ids, f"field 'text', item {i}"))
            return out, not isinstance(value, str)
        if not isinstance(value, list) or not value:
            raise RequestError(f"field {key!r}: expected a non-empty list, found "
                             f"{type(value).__name__ if not isinstance(value, list) else 'an empty list'}")
        if key == "input_ids":
            batch = isinstance(value[0], list)
            rows = value if batch else [value]
            self._count_prompts(len(rows))
            out = []
            for i, row in enumerate(rows):
                what = f"field 'input_ids'{f', prompt {i}' if batch else ''}"
                if not isinstance(row, list) or not row or not all(
                        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(self.tokenizer) for t in row):
                    raise RequestError(f"{what}: expected a non-empty list of token ids 0..{len(self.tokenizer) - 1}")
                out.append(self._embed_ids(row, what))
            return out, batch
        # input_embeds: [T, H] or a batch [[T_i, H], ...]
        batch = isinstance(value[0], list) and bool(value[0]) and isinstance(value[0][0], list)
        rows = value if batch else [value]
        self._count_prompts(len(rows))
        out = []
        for i, row in enumerate(rows):
            what = f"field 'input_embeds'{f', prompt {i}' if batch else ''}"
            if not isinstance(row, list) or not row:
                raise RequestError(f"{what}: expected a [T, {self.hidden_size}] list of token embeddings, found "
                                 f"{'an empty list' if isinstance(row, list) else type(row).__name__}")
            self._check_length(len(row), what)
            arr = float_array(row, what, ndim=2, width=self.hidden_size, width_name="the AV's hidden size")
            out.append(torch.from_numpy(arr))
        return out, batch

    def _count_prompts(self, n: int) -> None:
        if n > self.limits.max_prompts:
            raise RequestError(f"{n} prompts in one request; the cap is {self.limits.max_prompts} (--max-prompts)",
                             status=413)

    def _check_length(self, n: int, what: str) -> None:
        cap = self.limits.max_prompt_tokens
        if n > cap:
            raise RequestError(f"{what}: {n} tokens; the cap is {cap} tokens per prompt (--max-prompt-tokens)",
                             status=413)
        if self.context and n >= self.context:
            raise RequestError(f"{what}: {n} tokens; the AV has {self.context} positions (max_position_embeddings), "
                               "and the prompt and at least one new token must fit in them: send a shorter prompt")

    def fit_context(self, prompt: torch.Tensor, params: SamplingParams) -> SamplingParams:
        """``params`` with max_new_tokens cut to the AV's positions left after ``prompt`` (a prompt of
        2,000 tokens on a 128-position AV was decoded past them, answered with 200 and degenerate
        text, issue 58; a prompt that leaves no position is refused in ``_check_length``). The
        answer's finish_reason says "length" with the cut count, as SGLang's does at its cap."""
        if not self.context or prompt.shape[0] + params.max_new_tokens <= self.context:
            return params
        return dataclasses.replace(params, max_new_tokens=self.context - prompt.shape[0])

    def _embed_ids(self, ids: list[int], what: str) -> torch.Tensor:
        self._check_length(len(ids), what)
        # Not through the embedding module: its injection hook belongs to the batcher's thread.
        with torch.no_grad():
            return arch.build_input_embeds(self.model, torch.tensor(ids, dtype=torch.long)).float().cpu()

    # ------------------------------------------------------------------ endpoints' model work
    def info(self) -> dict[str, Any]:
        side = self.sidecar
        return {
            "av": self.av_path, "ar": self.ar_path, "d_model": side.d_model, "hidden_size": self.hidden_size,
            "model_type": getattr(self.model.config, "model_type", None),
            "injection_scale": side.injection_scale_value(), "injection_token_id": side.injection_token_id,
            "injection_adapter": side.injection_adapter is not None, "layer_index": side.layer_index,
            # a pair of several blocks: /verbalize and /score need each vector's block ('layer')
            "layers": None if side.layers is None else list(side.layers),
            # a pair trained on centred vectors: a client subtracts extraction.vector_offset (a pair of several
            # blocks: extraction.layer_offsets, the vector's block's) from raw vectors first
            "centred": side.centred,
            "eos_token_id": self.eos_id, "has_ar": self.client.ar is not None,
            "limits": self.limits.to_dict(), "batching": self.batcher.stats(),
        }

    def verbalize(self, vectors: torch.Tensor, **kw: Any) -> list[dict[str, Any]]:
        """The explanations of ``vectors``, decoded ``limits.verbalize_piece`` vectors at a time; past
        ``limits.verbalize_seconds`` of decoding the rest is refused (503), so one request cannot hold
        the server's only model thread for as long as its token budget takes on a slow machine."""
        lim, n = self.limits, vectors.shape[0]
        seed = kw.pop("seed", None)
        blocks = kw.pop("layer", None)
        t0 = time.monotonic()
        out: list[dict[str, Any]] = []
        # one seeded stream over the pieces: the answer is NLAClient.verbalize(vectors, seed=seed,
        # batch_size=verbalize_piece)'s
        device = next(self.client.av_model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, n, lim.verbalize_piece):
                if start and time.monotonic() - t0 > lim.verbalize_seconds:
                    raise RequestError(
                        f"/verbalize: {start} of {n} vectors explained in {time.monotonic() - t0:.0f} s, past this "
                        f"server's limit of {lim.verbalize_seconds:g} s per request (ServeLimits.verbalize_seconds); "
                        "send fewer vectors, samples or max_new_tokens per request", status=503)
                piece = None if blocks is None else blocks[start:start + lim.verbalize_piece]
                got = self.client.verbalize(vectors[start:start + lim.verbalize_piece], seed=None,
                                            batch_size=lim.verbalize_piece, layer=piece, **kw)
                out.extend({**v.to_dict(), "row": start + v.row} for v in got)
        return out

    def score(self, texts: list[str | None], vectors: torch.Tensor, layer: list[int | None] | None = None
              ) -> list[dict[str, Any]]:
        res = self.client.score(texts, vectors, layer=layer)
        return [{"mse_nrm": _nan_to_none(float(m)), "cosine": _nan_to_none(float(c)), "failed": bool(f)}
                for m, c, f in zip(res.mse_nrm.tolist(), res.cosine.tolist(), res.failed.tolist(), strict=True)]


class ServeApp:
    """Route handlers over one :class:`NLAService`."""

    def __init__(self, service: NLAService) -> None:
        self.s = service

    async def _wait(self, future: Any) -> Any:
        return await asyncio.wrap_future(future)

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def model_info(self, request: Request) -> JSONResponse:
        # SGLang's GET /get_model_info
        return JSONResponse({"model_path": self.s.av_path, "tokenizer_path": self.s.av_path, "is_generation": True})

    async def info(self, request: Request) -> JSONResponse:
        return JSONResponse(self.s.info())

    async def generate(self, request: Request) -> JSONResponse:
        body = await read_json_body(request, self.s.limits.max_body_bytes, self.s.limits.body_timeout_s)
        unknown = sorted(set(body) - set(GENERATE_KEYS))
        if unknown:
            raise RequestError(f"unsupported field(s) {unknown}; /generate takes {list(GENERATE_KEYS)}")
        if body.get("stream") not in (None, False) or body.get("return_logprob") not in (None, False):
            raise RequestError("fields 'stream' and 'return_logprob': only false is supported (one JSON answer, "
                             "text only)")
        params = SamplingParams.parse(body.get("sampling_params"), self.s.limits)
        if body.get("text") is not None:
            # The tokenizer is not safe to call from two threads at once (its Rust side may be
            # borrowed by the batcher's decode): text is tokenised on the batcher's thread.
            prompts, batch = await self._wait(self.s.batcher.submit_task(lambda: self.s.prompts(body), count=False))
        else:
            prompts, batch = self.s.prompts(body)
        work = len(prompts) * params.max_new_tokens
        if work > self.s.limits.max_request_tokens:
            raise RequestError(f"{len(prompts)} prompts x sampling_params.max_new_tokens {params.max_new_tokens} = "
                               f"{work} tokens to decode; the cap is {self.s.limits.max_request_tokens} per request: "
                               "send fewer prompts or ask for fewer tokens", status=413)
        jobs = [GenerateJob(p, self.s.fit_context(p, params)) for p in prompts]
        out = await asyncio.gather(*(self._wait(f) for f in self.s.batcher.submit_generate(jobs)))
        return JSONResponse(out if batch else out[0])

    def _vectors(self, body: dict[str, Any], name: str = "vectors") -> torch.Tensor:
        raw = get_field(body, name, list)
        if not raw:
            raise RequestError(f"field {name!r}: is empty; give at least one vector")
        if len(raw) > self.s.limits.max_vectors:
            raise RequestError(f"field {name!r}: {len(raw)} vectors; the cap is {self.s.limits.max_vectors} per request",
                             status=413)
        d = self.s.sidecar.d_model
        return torch.from_numpy(float_array(raw, f"field {name!r}", ndim=2, width=d, width_name="d_model"))

    def _blocks(self, body: dict[str, Any], n: int) -> list[int | None]:
        """Field 'layer': each vector's block (an int for all, or a list), as the pair's sidecar allows
        (a pair of several blocks needs it; nla.client.blocks_of)."""
        from nla.client import blocks_of

        try:
            return blocks_of(body.get("layer"), n, self.s.sidecar, "field 'layer'")
        except NLAClientError as err:
            raise RequestError(str(err)) from None

    async def verbalize(self, request: Request) -> JSONResponse:
        body = await read_json_body(request, self.s.limits.max_body_bytes, self.s.limits.body_timeout_s)
        lim = self.s.limits
        unknown = sorted(set(body) - {"vectors", "greedy", "temperature", "n_samples", "max_new_tokens", "seed", "layer"})
        if unknown:
            raise RequestError(f"unsupported field(s) {unknown}; /verbalize takes vectors, greedy, temperature, "
                             "n_samples, max_new_tokens, seed, layer")
        vectors = self._vectors(body)
        blocks = self._blocks(body, vectors.shape[0])
        greedy = get_field(body, "greedy", bool, True)
        temperature = float(get_field(body, "temperature", float, 1.0))
        n_samples = get_field(body, "n_samples", int, 1)
        max_new_tokens = get_field(body, "max_new_tokens", int, min(150, lim.max_new_tokens))
        seed = get_field(body, "seed", int, None)
        if not 1 <= n_samples <= lim.max_samples:
            raise RequestError(f"field 'n_samples': expected 1..{lim.max_samples}, found {n_samples}")
        if not 1 <= max_new_tokens <= lim.max_new_tokens:
            raise RequestError(f"field 'max_new_tokens': expected 1..{lim.max_new_tokens}, found {max_new_tokens}")
        if not greedy:
            try:  # the one check of sampling settings (nla.util.validation.check_sampling)
                check_sampling(temperature, what="field 'temperature'")
            except InputError as err:
                raise RequestError(str(err)) from None
        work = vectors.shape[0] * n_samples * max_new_tokens
        if work > lim.max_request_tokens:  # the decode work, bounded before any is done
            raise RequestError(f"{vectors.shape[0]} vectors x n_samples {n_samples} x max_new_tokens {max_new_tokens} "
                               f"= {work} tokens to decode; the cap is {lim.max_request_tokens} per request: split "
                               "the vectors over several requests", status=413)
        kw = dict(greedy=greedy, temperature=temperature, n_samples=n_samples, max_new_tokens=max_new_tokens, seed=seed,
                  layer=blocks)
        results = await self._wait(self.s.batcher.submit_task(lambda: self.s.verbalize(vectors, **kw)))
        return JSONResponse({"results": results})

    async def score(self, request: Request) -> JSONResponse:
        body = await read_json_body(request, self.s.limits.max_body_bytes, self.s.limits.body_timeout_s)
        if self.s.client.ar is None:
            raise RequestError("/score needs a reconstructor: this server has none; start it with --ar DIR", status=409)
        unknown = sorted(set(body) - {"texts", "vectors", "layer"})
        if unknown:
            raise RequestError(f"unsupported field(s) {unknown}; /score takes texts, vectors, layer")
        texts = get_field(body, "texts", list)
        if not texts:
            raise RequestError("field 'texts': is empty; give one text (or null) per vector")
        if len(texts) > self.s.limits.max_texts:
            raise RequestError(f"field 'texts': {len(texts)} texts; the cap is {self.s.limits.max_texts}", status=413)
        for i, t in enumerate(texts):
            if t is not None and not isinstance(t, str):
                raise RequestError(f"field 'texts', item {i}: expected a string or null, found {type(t).__name__}")
            if isinstance(t, str):
                check_text(t, f"field 'texts', item {i}")
                if len(t) > self.s.limits.max_text_chars:
                    raise RequestError(f"field 'texts', item {i}: {len(t)} characters; the cap is "
                                     f"{self.s.limits.max_text_chars}", status=413)
        vectors = self._vectors(body)
        if len(texts) != vectors.shape[0]:
            raise RequestError(f"fields 'texts' and 'vectors': {len(texts)} texts for {vectors.shape[0]} vectors; give "
                             "one text (or null) per vector")
        blocks = self._blocks(body, vectors.shape[0])
        results = await self._wait(self.s.batcher.submit_task(lambda: self.s.score(texts, vectors, blocks)))
        return JSONResponse({"results": results})


async def _request_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return error_response(str(exc), exc.status)


async def _client_error(request: Request, exc: Exception) -> JSONResponse:
    # NLAClient's and nla.util.validation's checks of what was sent (a zero vector, an overflowing norm)
    return error_response(str(exc), 400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return error_response(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("serve: %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc,
                 exc_info=exc)
    return error_response(f"internal error ({type(exc).__name__}: {exc}); the server keeps running, see its log",
                          500)


def create_app(service: NLAService, *, allowed_hosts: list[str] | None = None) -> Starlette:
    """The server's app over a loaded :class:`NLAService`; ``allowed_hosts`` turns the Host allow-list on."""
    h = ServeApp(service)
    routes = [
        Route("/health", h.health),
        Route("/get_model_info", h.model_info),
        Route("/info", h.info),
        Route("/generate", h.generate, methods=["POST"]),
        Route("/verbalize", h.verbalize, methods=["POST"]),
        Route("/score", h.score, methods=["POST"]),
    ]
    middleware = ([Middleware(HostAllowList, allowed_hosts=allowed_hosts, label="this server",
                              hint="nla serve --allow-host NAME adds one")] if allowed_hosts else [])
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={RequestError: _request_error,
                                        NLAClientError: _client_error, InputError: _client_error,
                                        HTTPException: _http_error, Exception: _internal_error})
    app.state.limits = service.limits  # the server's connection settings (nla serve, uvicorn_settings)
    return app


def uvicorn_settings(limits: ServeLimits) -> dict[str, Any]:
    """uvicorn's connection bounds for ``limits``: a request's head within ``header_timeout_s``, an
    idle keep-alive connection closed after ``keep_alive_s``, at most ``max_connections`` at once (the
    body's own deadline is read_json_body's)."""
    from nla.util.http import header_timeout_protocol

    return {"timeout_keep_alive": max(1, math.ceil(limits.keep_alive_s)), "limit_concurrency": limits.max_connections,
            "http": header_timeout_protocol(limits.header_timeout_s)}
