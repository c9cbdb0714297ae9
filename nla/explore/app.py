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

import json
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
from nla.explore.engine import ExploreError, ExploreLimits, Explorer
from nla.explore.run import RunSummary
from nla.util.validation import InputError

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
_MISSING = object()


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _json_body(request: Request, limit: int) -> dict[str, Any]:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ExploreError(f"expected a JSON body (Content-Type: application/json), found {ctype or 'none'!r}",
                           status=415)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ExploreError(f"request body is {int(declared)} bytes; the cap is {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ExploreError(f"request body is over the cap of {limit} bytes", status=413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExploreError(f"request body is not valid JSON ({err.msg if hasattr(err, 'msg') else err})") from None
    except RecursionError:
        raise ExploreError("request body is nested too deeply to parse; send flat JSON (an object of fields)") from None
    if not isinstance(body, dict):
        raise ExploreError(f"expected a JSON object, found {type(body).__name__}")
    return body


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """``body[name]`` checked against ``kind`` (bool is never an int here); the error names the field."""
    if name not in body or body[name] is None:
        if default is _MISSING:
            raise ExploreError(f"missing field {name!r}")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ExploreError(f"field {name!r}: expected {names}, found {type(value).__name__}")
    if isinstance(value, str):
        _check_text(value, f"field {name!r}")
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
        raise ExploreError(f"field {name!r}: {value} is out of range (a 64-bit integer)")
    return value


# JSON integers are unbounded; every integer field here is a count, a position, an id or a seed.
INT_LIMIT = 2**63


def _check_text(text: str, what: str) -> None:
    """A JSON string may hold a lone surrogate (``"\\ud800"``), which is no Unicode text: no
    tokenizer can read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ExploreError(f"{what}: character {err.start} is a lone surrogate ({text[err.start]!a}), not valid "
                           "Unicode text; send UTF-8 text") from None


def _int_list(body: dict[str, Any], name: str) -> list[int] | None:
    value = _get(body, name, list, None)
    if value is None:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and -INT_LIMIT <= v < INT_LIMIT for v in value):
        raise ExploreError(f"field {name!r}: expected a list of (64-bit) integers")
    return value


class ExploreApp:
    """Route handlers over one :class:`Explorer` (None when the pair could not be loaded)."""

    def __init__(self, explorer: Explorer | None, run: RunSummary | None, limits: ExploreLimits,
                 setup_error: str | None) -> None:
        if explorer is None and setup_error is None:
            raise ValueError("ExploreApp: give an explorer, or the setup_error that says why there is none")
        self.explorer, self.run, self.limits, self.setup_error = explorer, run, limits, setup_error

    def _need_explorer(self) -> Explorer:
        if self.explorer is None:
            raise ExploreError(f"the models could not be loaded: {self.setup_error}", status=409)
        return self.explorer

    def _input(self, body: dict[str, Any]):
        ex = self._need_explorer()
        return ex.text_input(_get(body, "text", str, None), _get(body, "doc_id", int, None))

    async def info(self, request: Request) -> JSONResponse:
        out: dict[str, Any] = {"setup_error": self.setup_error, "limits": self.limits.to_dict(),
                               "run": self.run is not None}
        if self.explorer is not None:
            out.update(self.explorer.info())
        return JSONResponse(out)

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await _json_body(request, self.limits.max_body_bytes)
        inp = self._input(body)
        return JSONResponse({"text": inp.text, "doc_id": inp.doc.doc_id if inp.doc else None,
                             "n_tokens": inp.n_tokens, "tokens": self.explorer.tokens(inp)})

    async def explain(self, request: Request) -> JSONResponse:
        body = await _json_body(request, self.limits.max_body_bytes)
        inp = self._input(body)
        ex = self.explorer
        kwargs = dict(positions=_int_list(body, "positions"), n_samples=_get(body, "n_samples", int, 0),
                      max_new_tokens=_get(body, "max_new_tokens", int, None),
                      temperature=float(_get(body, "temperature", (int, float), 1.0)),
                      seed=_get(body, "seed", int, 0), return_vectors=_get(body, "return_vectors", bool, False))
        ex.check_positions(inp, kwargs["positions"])  # fail fast, before queueing behind other model work
        results = await run_in_threadpool(ex.explain, inp, **kwargs)
        return JSONResponse({"doc_id": inp.doc.doc_id if inp.doc else None, "n_tokens": inp.n_tokens,
                             "results": results})

    async def score(self, request: Request) -> JSONResponse:
        body = await _json_body(request, self.limits.max_body_bytes)
        ex = self._need_explorer()
        texts = _get(body, "texts", list)
        if not all(t is None or isinstance(t, str) for t in texts):
            raise ExploreError("field 'texts': expected a list of strings (null for a failed sample)")
        for i, t in enumerate(texts):
            if t is not None:
                _check_text(t, f"field 'texts', item {i}")
        facts = None
        if "vectors" in body:
            if any(k in body for k in ("text", "doc_id", "position")):
                raise ExploreError("give either 'vectors' or a token ('text' or 'doc_id' with 'position'), not both")
            raw = _get(body, "vectors", list)
            if any(isinstance(x, bool) for row in raw for x in (row if isinstance(row, list) else [row])):
                raise ExploreError("field 'vectors': expected numbers, found a boolean (true/false are not "
                                   "vector entries)")
            try:
                vectors = torch.tensor(raw, dtype=torch.float32)
            except (TypeError, ValueError):
                raise ExploreError("field 'vectors': expected a list of equal-length lists of numbers") from None
            if vectors.ndim == 1 and vectors.numel() == ex.client.d_model:
                vectors = vectors[None]
        else:
            inp = self._input(body)
            position = _get(body, "position", int)
            ex.check_positions(inp, [position])
            acts = await run_in_threadpool(ex.activations, inp)
            vectors = acts[[position] * len(texts)] if texts else acts[:0]
            truth = ex.facts(inp)
            facts = truth[position] if truth is not None else None
        try:
            results = await run_in_threadpool(ex.score, texts, vectors, facts)
        except (InputError, NLAClientError) as err:  # the client's checks of the vectors: the request's fault
            raise ExploreError(" ".join(str(err).split())) from None
        return JSONResponse({"results": results})

    async def run_summary(self, request: Request) -> JSONResponse:
        if self.run is None:
            raise ExploreError("no run to show: start the explorer with --run RUN_DIR (a quickstart or nla rl "
                               "output dir)", status=404)
        return JSONResponse(self.run.to_dict())

    async def run_plot(self, request: Request) -> Response:
        name = request.path_params["name"]
        if self.run is None or name not in self.run.plots:
            known = sorted(self.run.plots) if self.run else []
            raise ExploreError(f"no plot named {name!r}; this run has {known}", status=404)
        return FileResponse(self.run.plots[name], media_type="image/png")

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


async def _explore_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ExploreError)
    return _error(str(exc), exc.status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("explore: %s %s failed", request.method, request.url.path)
    return _error(f"internal error ({type(exc).__name__}: {exc}); the server keeps running, see its log", 500)


def host_name(header: str) -> str:
    """The host of a ``Host`` header without its port: ``[::1]:8765`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal (RFC 3986): the port follows the bracket
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostAllowList:
    """Answer only requests whose ``Host`` names one of ``allowed_hosts`` (the defence against DNS
    rebinding); others get a JSON 400. Starlette's ``TrustedHostMiddleware`` cuts the header at its
    first colon, so it refuses every request to an IPv6 literal such as ``[::1]``."""

    def __init__(self, app: Any, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed = {h.strip("[]").lower() for h in allowed_hosts}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed:
                response = _error(f"Invalid host header {host!r}: this explorer answers {sorted(self.allowed)} "
                                  "(nla explore --allow-host NAME adds one)", 400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    middleware = [Middleware(HostAllowList, allowed_hosts=allowed_hosts)] if allowed_hosts else []
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={ExploreError: _explore_error, HTTPException: _http_error,
                                         Exception: _internal_error})


class BackgroundServer:
    """The app under a real uvicorn server in a daemon thread (tests, screenshots); a context manager.

    ``port=0`` binds a free port; ``url`` is ``http://host:port``.
    """

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 30.0) -> None:
        import socket
        import threading
        import time

        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name="nla-explore-server")
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the explorer server did not start on {self.url}")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
