"""What nla's HTTP servers share (``nla explore``, ``nla serve``): JSON bodies with caps, checked
fields, one-line JSON errors, the Host allow-list, and a real server in a thread for tests.

The servers need starlette and uvicorn (the ``explore`` extra), imported where a request is read or
answered; :class:`RequestError` and the field checks import without them, so the engines behind the
servers raise the one request error.

Safety, in the order a request meets it:

1. :class:`HostAllowList`: only requests addressed to the allowed host names are answered (the
   defence against DNS rebinding). ``host_name`` reads the ``Host`` header strictly: a bracketed
   IPv6 literal may be followed by ``:port`` and nothing else, a name by ``:port`` only.
2. :func:`read_json_body`: ``application/json`` only (a cross-site form cannot send it without a CORS
   preflight, which is never granted), at most ``limit`` bytes, read whole within ``timeout_s``
   seconds (a client that sends a byte a second is cut off, not waited for), a JSON object with no
   key given twice (which of two values counts differs between parsers). A client that disconnects
   mid-body ends its request quietly, with one log line and no traceback.
3. :func:`get_field`, :func:`int_list`, :func:`float_array`: every field checked; a bad one raises
   :class:`RequestError`, which the apps answer as ``{"error": "<one line>"}`` with its 4xx status.

Before any of these, the connection: :func:`header_timeout_protocol` is uvicorn's HTTP protocol with
a deadline on a request's head (its line and headers), which uvicorn does not bound: a client
sending a header byte a second held a connection for as long as it liked, and enough of them every
connection the server allows (issue 58).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import JSONResponse

__all__ = [
    "FLOAT32_MAX",
    "INT_LIMIT",
    "LOOPBACK",
    "MISSING",
    "BackgroundServer",
    "HostAllowList",
    "RequestError",
    "allowed_hosts",
    "check_bind_host",
    "check_text",
    "error_response",
    "float_array",
    "get_field",
    "header_timeout_protocol",
    "host_name",
    "int_list",
    "port_flag",
    "read_json_body",
]

MISSING = object()  # get_field's "no default": the field is required
# JSON integers are unbounded; every integer field is a count, a position, an id or a seed.
INT_LIMIT = 2**63
FLOAT32_MAX = float(np.finfo(np.float32).max)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
ALL_INTERFACES = ("0.0.0.0", "::", "")
# Bodies above this size are parsed in a worker thread, not on the event loop.
_THREAD_PARSE_BYTES = 256 * 1024


class RequestError(ValueError):
    """A request the server cannot serve; ``status`` is the HTTP status to answer with (4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int) -> JSONResponse:
    """``{"error": message}`` on one line, with ``status``."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RequestError(f"request body: the key {key[:80]!r} is given twice in one object; send each field "
                               "once (which of the two values counts differs between JSON parsers)")
        out[key] = value
    return out


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null", object_pairs_hook=_unique_keys)
    except RequestError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"request body is not valid JSON ({err.msg if hasattr(err, 'msg') else err})") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply to parse; send flat JSON (an object of fields)") from None
    except ValueError as err:  # e.g. an integer of more than 4,300 digits (Python's int-conversion limit)
        raise RequestError(f"request body is not usable JSON ({' '.join(str(err).split())})") from None


# The whole body must arrive within this many seconds (a slow client holds a connection and its buffer).
BODY_TIMEOUT_S = 30.0


async def read_json_body(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> dict[str, Any]:
    """The request's JSON object: 415 unless ``application/json``, 413 over ``limit`` bytes, 408 when the
    body takes over ``timeout_s`` seconds to arrive, 400 unless an object (keys unique)."""
    import asyncio

    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect

    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise RequestError(f"expected a JSON body (Content-Type: application/json), found {ctype or 'none'!r}",
                           status=415)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body is {int(declared)} bytes; the cap is {limit}", status=413)
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"request body is over the cap of {limit} bytes", status=413)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(f"request body did not arrive within {timeout_s:g} s ({sum(map(len, chunks))} bytes "
                           "came); send the whole body at once", status=408) from None
    except ClientDisconnect:
        raise RequestError("the client closed the connection before its request body ended", status=400) from None
    raw = b"".join(chunks)
    body = await run_in_threadpool(_parse_json, raw) if len(raw) > _THREAD_PARSE_BYTES else _parse_json(raw)
    if not isinstance(body, dict):
        raise RequestError(f"expected a JSON object, found {type(body).__name__}")
    return body


def check_text(text: str, what: str) -> None:
    """A JSON string may hold a lone surrogate (``"\\ud800"``), which is no Unicode text: no
    tokenizer can read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(f"{what}: character {err.start} is a lone surrogate ({text[err.start]!a}), not valid "
                           "Unicode text; send UTF-8 text") from None


def get_field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = MISSING) -> Any:
    """``body[name]`` checked against ``kind`` (bool is never an int or a float here); the error names the field.

    A float field accepts integers too when ``kind`` includes ``float``; a float must be finite."""
    if name not in body or body[name] is None:
        if default is MISSING:
            raise RequestError(f"missing field {name!r}")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and int not in kinds:
        kinds = (*kinds, int)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(f"field {name!r}: expected {names}, found {type(value).__name__}")
    if isinstance(value, str):
        check_text(value, f"field {name!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        if float in kinds:
            if not abs(value) <= FLOAT32_MAX:
                digits = str(abs(value))
                raise RequestError(f"field {name!r}: an integer of {len(digits)} digits is too large; expected a "
                                   f"finite float32 number (|x| <= {FLOAT32_MAX:.4g})")
        elif not -INT_LIMIT <= value < INT_LIMIT:
            raise RequestError(f"field {name!r}: {value} is out of range (a 64-bit integer)")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"field {name!r}: expected a finite number, found {value}")
    return value


def int_list(body: dict[str, Any], name: str) -> list[int] | None:
    """``body[name]`` as a list of 64-bit integers, or None when absent."""
    value = get_field(body, name, list, None)
    if value is None:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and -INT_LIMIT <= v < INT_LIMIT for v in value):
        raise RequestError(f"field {name!r}: expected a list of (64-bit) integers")
    return value


def _not_a_number(value: Any) -> str | None:
    """What the first leaf of a nested list that is no JSON number is ("a boolean", "a string", ...), or None."""
    if isinstance(value, list):
        for v in value:
            found = _not_a_number(v)
            if found:
                return found
        return None
    if isinstance(value, bool):
        return "a boolean (true/false are not entries)"
    if isinstance(value, (int, float)):
        return None
    return f"a {type(value).__name__} ({str(value)[:20]!r})" if isinstance(value, str) else \
        f"{'null' if value is None else type(value).__name__}"


def float_array(value: Any, what: str, *, ndim: int, width: int | None = None, width_name: str = "d") -> np.ndarray:
    """A JSON array of ``ndim`` nesting levels of numbers as a float32 array, or a 400 naming ``what``:
    not a list, ragged, not numbers, booleans (``true`` is no entry), the last axis not ``width``, or an
    entry that is not a finite float32 (NaN, Infinity, ``1e400``, ``10**400``, ``1e39``)."""
    shape_word = "[" + ", ".join(["N", "T", "d"][3 - ndim:] if ndim <= 3 else ["..."]) + "]"
    if not isinstance(value, list):
        raise RequestError(f"{what}: expected a {shape_word} list of numbers, found {type(value).__name__}")
    leaf = _not_a_number(value)
    if leaf:  # numpy would read "0.1" as 0.1 and true as 1: a string number is not a number (issue 58)
        raise RequestError(f"{what}: expected numbers, found {leaf}")
    try:
        arr = np.array(value, dtype=np.float64)
    except OverflowError:
        raise RequestError(f"{what}: an entry is too large for a number (it overflows float64); expected finite "
                           "float32 numbers") from None
    except (TypeError, ValueError):
        raise RequestError(f"{what}: expected a {shape_word} list of equal-length lists of numbers") from None
    if arr.ndim != ndim:
        raise RequestError(f"{what}: expected a {shape_word} list of equal-length lists of numbers, found "
                           f"{arr.ndim} nesting level(s) (shape {tuple(arr.shape)})")
    if width is not None and arr.shape[-1] != width:
        raise RequestError(f"{what}: expected {width_name} = {width} numbers per row, found {arr.shape[-1]} "
                           f"(shape {tuple(arr.shape)})")
    bad = ~np.isfinite(arr) | (np.abs(arr) > FLOAT32_MAX)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise RequestError(f"{what}: entry {list(where)} is {float(arr[where])}; expected finite float32 numbers "
                           f"(|x| <= {FLOAT32_MAX:.4g}; {int(bad.sum())} such entries)")
    return arr.astype(np.float32)


def host_name(header: str) -> str:
    """The host of a ``Host`` header without its port: ``[::1]:8765`` -> ``::1``, ``a.b:80`` -> ``a.b``.

    Strict: after an IPv6 literal's ``]`` only ``:port`` may follow, and a name's port must be digits;
    anything else comes back whole (so it matches no allowed name): ``[::1]evil.com`` is not ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal (RFC 3986): the port follows the bracket
        end = header.find("]")
        if end < 0:
            return header
        rest = header[end + 1:]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return header
        return header[1:end]
    if header.count(":") == 1:
        name, port = header.split(":")
        return name if port.isdigit() else header
    return header


class HostAllowList:
    """Answer only requests whose ``Host`` names one of ``allowed_hosts`` (the defence against DNS
    rebinding); others get a JSON 400. Starlette's ``TrustedHostMiddleware`` cuts the header at its
    first colon, so it refuses every request to an IPv6 literal such as ``[::1]``.

    ``label`` names the server in the refusal, ``hint`` says how to add a name."""

    def __init__(self, app: Any, allowed_hosts: list[str], label: str = "this server",
                 hint: str = "--allow-host NAME adds one") -> None:
        self.app = app
        self.allowed = {h.strip("[]").lower() for h in allowed_hosts}
        self.label, self.hint = label, hint

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed:
                response = error_response(f"Invalid host header {host!r}: {self.label} answers "
                                          f"{sorted(self.allowed)} ({self.hint})", 400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def interface_addresses() -> set[str]:
    """This machine's own addresses: the IPv4 address of every interface (Linux ``SIOCGIFADDR``), its
    IPv6 addresses (``/proc/net/if_inet6``), the source address of the default route, and what its
    host name resolves to. ``getaddrinfo(hostname)`` alone often gives only 127.0.x.1, so a server
    bound to 0.0.0.0 refused requests addressed to the machine's real address (issue 48)."""
    import ipaddress

    found: set[str] = set()
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _index, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue
                found.add(socket.inet_ntoa(packed[20:24]))
    except (ImportError, AttributeError, OSError):  # not Linux
        pass
    try:
        with open("/proc/net/if_inet6") as fh:
            for line in fh:
                raw = line.split()[0]
                found.add(str(ipaddress.IPv6Address(bytes.fromhex(raw))))
    except (OSError, ValueError, IndexError):
        pass
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:  # connecting a UDP socket sends nothing; it picks the route's source address
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                found.add(s.getsockname()[0])
        except OSError:
            pass
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            found.update(info[4][0] for info in socket.getaddrinfo(name, None))
        except OSError:
            pass
    return {a.split("%")[0] for a in found if a}  # a Host header carries no zone id


def allowed_hosts(bind: str, extra: list[str]) -> list[str]:
    """The host names a server bound to ``bind`` answers (the explorer, ``nla serve``): never "any" (the DNS-rebinding defence stays on for
    every bind). Loopback: the loopback names. All interfaces: those, this machine's names and
    the addresses of every interface (:func:`interface_addresses`). One address: it and this
    machine's names. Plus ``--allow-host`` names."""

    names = set(extra)
    if bind in LOOPBACK:
        names.update(LOOPBACK)
    else:
        names.update({socket.gethostname(), socket.getfqdn()})
        if bind in ALL_INTERFACES:
            names.update(LOOPBACK)
            names.update(interface_addresses())
        else:
            names.add(bind)
    return sorted(n for n in names if n)


def port_flag(text: str) -> int:
    """argparse type of ``--port``: an integer 1-65535, checked before any model loads."""
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer port 1-65535, found {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 1-65535, found {port}")
    return port


def check_bind_host(host: str) -> str:
    """``--host``: an address or a name this machine can bind to, checked before any model loads
    (a typo used to fail only at bind time); a ValueError names the flag."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise ValueError(f"--host: cannot resolve {host!r} to an address to bind ({err}); give an address of this "
                         "machine such as 127.0.0.1 (the default) or 0.0.0.0") from None
    return host


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 HTTP protocol with a deadline on each request's head: a connection whose request
    line and headers have not all arrived ``seconds`` after it opened (or after its previous response)
    is answered ``408 Request Timeout`` and closed. Pass it as uvicorn's ``http=``.

    Why our own subclass: uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) and
    the app bounds the body (:func:`read_json_body`), but nothing bounds the head; h11 and uvicorn have
    no such setting (uvicorn 0.55)."""
    import asyncio

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ValueError(f"header timeout: expected a positive number of seconds, found {seconds!r}")

    class HeaderTimeoutH11Protocol(H11Protocol):
        head_timeout_s = float(seconds)
        _head_deadline: asyncio.TimerHandle | None = None

        def _arm_head_deadline(self) -> None:
            self._cancel_head_deadline()
            self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

        def _cancel_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            # IDLE: the request's head has not been parsed yet (after it, h11 is in SEND_BODY or DONE)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                body = b'{"error": "the request line and headers did not arrive within %g s"}' % self.head_timeout_s
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the head is in: the app's deadlines take over
                self._cancel_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # keep-alive: the next request's head has the same bound
                self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_deadline()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol


class BackgroundServer:
    """An ASGI app under a real uvicorn server in a daemon thread (tests, screenshots, benchmarks);
    a context manager. ``port=0`` binds a free port; ``url`` is ``http://host:port``."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 30.0,
                 name: str = "nla-http-server", **uvicorn_config: Any) -> None:
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    **uvicorn_config))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name=name)
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
