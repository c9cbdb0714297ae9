"""The explorer's ASGI app: a JSON API (docs/explore.md) and the static page that uses only it.

Safety, in the order a request meets it:

1. Only the host names given (``allowed_hosts``; the CLI passes the loopback names when it
   binds to loopback) are answered, which stops DNS-rebinding pages from reaching the API.
2. POST bodies must be ``application/json`` (a cross-site form cannot send that without a
   CORS preflight, which is never granted) and at most ``max_body_bytes`` long.
3. Every field is checked; a bad one is a JSON ``{"error": "<one line>"}`` with a 4xx status.
   Models are loaded only from the paths given on the command line; nothing is unpickled.
4. Model work runs in a worker thread, one call at a time; an unexpected exception is logged
   and answered with a 500, and the server keeps running.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from nla.client import NLAClientError
from nla.explore.engine import ExploreLimits, Explorer
from nla.explore.run import RunSummary
from nla.util.http import (
    HostAllowList,
    RequestError,
    check_text,
    error_response,
    float_array,
    get_field,
    int_list,
    read_json_body,
)
from nla.util.validation import InputError

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"

__all__ = ["ExploreApp", "STATIC_DIR", "create_app"]


def _error(message: str, status: int) -> JSONResponse:
    return error_response(message, status)


class ExploreApp:
    """Route handlers over one :class:`Explorer` (None when the pair could not be loaded)."""

    def __init__(self, explorer: Explorer | None, run: RunSummary | None, limits: ExploreLimits,
                 setup_error: str | None) -> None:
        if explorer is None and setup_error is None:
            raise ValueError("ExploreApp: give an explorer, or the setup_error that says why there is none")
        self.explorer, self.run, self.limits, self.setup_error = explorer, run, limits, setup_error

    def _need_explorer(self) -> Explorer:
        if self.explorer is None:
            raise RequestError(f"the models could not be loaded: {self.setup_error}", status=409)
        return self.explorer

    def _input(self, body: dict[str, Any]):
        ex = self._need_explorer()
        return ex.text_input(get_field(body, "text", str, None), get_field(body, "doc_id", int, None))

    async def info(self, request: Request) -> JSONResponse:
        out: dict[str, Any] = {"setup_error": self.setup_error, "limits": self.limits.to_dict(),
                               "run": self.run is not None}
        if self.explorer is not None:
            out.update(self.explorer.info())
        return JSONResponse(out)

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await read_json_body(request, self.limits.max_body_bytes)
        inp = self._input(body)
        return JSONResponse({"text": inp.text, "doc_id": inp.doc.doc_id if inp.doc else None,
                             "n_tokens": inp.n_tokens, "tokens": self.explorer.tokens(inp)})

    async def explain(self, request: Request) -> JSONResponse:
        body = await read_json_body(request, self.limits.max_body_bytes)
        inp = self._input(body)
        ex = self.explorer
        kwargs = dict(positions=int_list(body, "positions"), n_samples=get_field(body, "n_samples", int, 0),
                      max_new_tokens=get_field(body, "max_new_tokens", int, None),
                      temperature=float(get_field(body, "temperature", (int, float), 1.0)),
                      seed=get_field(body, "seed", int, 0), return_vectors=get_field(body, "return_vectors", bool, False),
                      layer=get_field(body, "layer", int, None))
        ex.check_positions(inp, kwargs["positions"])  # fail fast, before queueing behind other model work
        ex.block(kwargs["layer"])
        results = await run_in_threadpool(ex.explain, inp, **kwargs)
        return JSONResponse({"doc_id": inp.doc.doc_id if inp.doc else None, "n_tokens": inp.n_tokens,
                             "results": results})

    async def score(self, request: Request) -> JSONResponse:
        body = await read_json_body(request, self.limits.max_body_bytes)
        ex = self._need_explorer()
        texts = get_field(body, "texts", list)
        if not all(t is None or isinstance(t, str) for t in texts):
            raise RequestError("field 'texts': expected a list of strings (null for a failed sample)")
        for i, t in enumerate(texts):
            if t is not None:
                check_text(t, f"field 'texts', item {i}")
        facts, read = None, None
        layer = get_field(body, "layer", int, None)  # the block the vectors are read at (a pair for several)
        if "vectors" in body:
            if any(k in body for k in ("text", "doc_id", "position")):
                raise RequestError("give either 'vectors' or a token ('text' or 'doc_id' with 'position'), not both")
            raw = get_field(body, "vectors", list)
            # A 400 naming the field for booleans, ragged rows and entries that are no finite float32
            # (NaN, 1e400, 10**400: the last used to be a 500)
            vectors = torch.from_numpy(float_array(raw, "field 'vectors'", ndim=2 if raw and isinstance(raw[0], list)
                                                   else 1))
            if vectors.ndim == 1 and vectors.numel() == ex.client.d_model:
                vectors = vectors[None]
        else:
            inp = self._input(body)
            position = get_field(body, "position", int)
            ex.check_positions(inp, [position])
            acts = await run_in_threadpool(ex.activations, inp, layer)
            vectors = acts[[position] * len(texts)] if texts else acts[:0]
            truth = ex.facts(inp)
            facts = truth[position] if truth is not None else None
            read = ex.read_to(inp, position)
        try:
            results = await run_in_threadpool(ex.score, texts, vectors, facts, read, layer)
        except (InputError, NLAClientError) as err:  # the client's checks of the vectors: the request's fault
            raise RequestError(" ".join(str(err).split())) from None
        return JSONResponse({"results": results})

    async def run_summary(self, request: Request) -> JSONResponse:
        if self.run is None:
            raise RequestError("no run to show: start the explorer with --run RUN_DIR (a quickstart or nla rl "
                               "output dir)", status=404)
        return JSONResponse(self.run.to_dict())

    async def run_plot(self, request: Request) -> Response:
        name = request.path_params["name"]
        if self.run is None or name not in self.run.plots:
            known = sorted(self.run.plots) if self.run else []
            raise RequestError(f"no plot named {name!r}; this run has {known}", status=404)
        return FileResponse(self.run.plots[name], media_type="image/png")

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


async def _explore_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return _error(str(exc), exc.status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("explore: %s %s failed", request.method, request.url.path)
    return _error(f"internal error ({type(exc).__name__}: {exc}); the server keeps running, see its log", 500)


def create_app(explorer: Explorer | None, *, run: RunSummary | None = None, limits: ExploreLimits | None = None,
               setup_error: str | None = None, allowed_hosts: list[str] | None = None) -> Starlette:
    """The explorer app; ``explorer=None`` with a ``setup_error`` serves the page and says why models are missing."""
    limits = limits or (explorer.limits if explorer is not None else ExploreLimits())
    h = ExploreApp(explorer, run, limits, setup_error)
    routes = [
        Route("/", h.index),
        Route("/api/info", h.info),
        Route("/api/tokenize", h.tokenize, methods=["POST"]),
        Route("/api/explain", h.explain, methods=["POST"]),
        Route("/api/score", h.score, methods=["POST"]),
        Route("/api/run", h.run_summary),
        Route("/api/run/plots/{name}", h.run_plot),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    middleware = ([Middleware(HostAllowList, allowed_hosts=allowed_hosts, label="this explorer",
                             hint="nla explore --allow-host NAME adds one")] if allowed_hosts else [])
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={RequestError: _explore_error,
                                         HTTPException: _http_error, Exception: _internal_error})
