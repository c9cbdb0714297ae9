"""A minimal headless-Chromium driver over the DevTools protocol: a test helper (the browser test and the docs screenshot).

It starts the system's Chromium (Debian package ``chromium``; ``$NLA_CHROMIUM`` overrides the
binary) with ``--remote-debugging-pipe`` and talks to it over two pipes (fd 3 in, fd 4 out,
NUL-separated JSON), so it needs no network port, no websocket client and no driver binary.
Clicks and typing are real input events (``Input.dispatchMouseEvent`` / ``Input.insertText``),
not JavaScript ``click()`` calls. Nothing is downloaded.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["BrowserError", "HeadlessChromium", "find_chromium"]

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class BrowserError(RuntimeError):
    """Chromium could not be started or driven; the message says what happened."""


def find_chromium() -> str | None:
    """Path of a Chromium binary: ``$NLA_CHROMIUM``, else the first of chromium / google-chrome on PATH."""
    env = os.environ.get("NLA_CHROMIUM")
    if env:
        return env if Path(env).is_file() else None
    for name in _CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class HeadlessChromium:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, binary: str | None = None, *, width: int = 1280, height: int = 900,
                 start_timeout: float = 30.0) -> None:
        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError("no Chromium binary found; install the Debian package `chromium` or set $NLA_CHROMIUM")
        self.width, self.height = width, height
        self._profile = Path(tempfile.mkdtemp(prefix="nla-chromium-"))
        self._log = open(self._profile / "chromium.log", "wb")  # noqa: SIM115 (closed in close)
        cmd = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
               "--remote-debugging-pipe", f"--user-data-dir={self._profile / 'profile'}",
               f"--window-size={width},{height}", "about:blank"]
        # --remote-debugging-pipe: Chromium reads commands on fd 3 and writes replies on fd 4, NUL-terminated.
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        keep = (os.dup(to_child_r), os.dup(from_child_w))  # out of the way of 3 and 4 before dup2

        def fds_3_and_4() -> None:
            os.dup2(keep[0], 3)
            os.dup2(keep[1], 4)

        self._buf = b""
        self._ids = itertools.count(1)
        self._session: str | None = None
        try:
            self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          pass_fds=(3, 4), preexec_fn=fds_3_and_4)
        finally:
            for fd in (to_child_r, from_child_w, *keep):
                os.close(fd)
        try:
            targets = self.send("Target.getTargets", timeout=start_timeout)["targetInfos"]
            pages = [t for t in targets if t.get("type") == "page"]
            if not pages:
                raise BrowserError(f"Chromium offers no page target (targets: {targets})")
            self._session = self.send("Target.attachToTarget", targetId=pages[0]["targetId"], flatten=True)["sessionId"]
            self.send("Page.enable")
            self.send("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _log_tail(self) -> str:
        self._log.flush()
        lines = (self._profile / "chromium.log").read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "(no output)"

    def _read_message(self, deadline: float, method: str) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"{method}: no answer from Chromium within the timeout")
            ready, _, _ = select.select([self._from_child], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise BrowserError(f"{method}: Chromium closed its DevTools pipe: {self._log_tail()}")
                self._buf += chunk
            elif self._proc.poll() is not None:
                raise BrowserError(f"{method}: Chromium exited with code {self._proc.returncode}: {self._log_tail()}")
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    # ------------------------------------------------------------------ protocol
    def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send one DevTools command (to the page once attached) and return its result; events are dropped."""
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
        if self._session is not None:
            msg["sessionId"] = self._session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._to_child, data):]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline, method)
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        """Value of a JavaScript expression in the page (promises are awaited)."""
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            detail = res["exceptionDetails"]
            text = detail.get("exception", {}).get("description") or detail.get("text")
            raise BrowserError(f"JavaScript error in {expression[:80]!r}: {text}")
        return res.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 60.0, poll: float = 0.1) -> Any:
        """Poll ``expression`` until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out after {timeout:.0f} s waiting for {expression!r}")
            time.sleep(poll)

    # ------------------------------------------------------------------ actions
    def goto(self, url: str, timeout: float = 30.0) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for(f"document.readyState === 'complete' && location.href.startsWith({json.dumps(url)})", timeout)

    def _center(self, selector: str) -> tuple[float, float]:
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center'});"
            # An inline element that wraps (a token whose leading space ends one line and whose word
            # starts the next) has one box per line; the centre of their union lies between the two
            # and hits nothing, so aim at the widest box, where a reader would click.
            " const rs = [...e.getClientRects()]; const r = rs.length"
            " ? rs.reduce((a, b) => (b.width > a.width ? b : a)) : e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        if box is None:
            raise BrowserError(f"no element matches {selector!r}")
        return box[0], box[1]

    def click(self, selector: str) -> None:
        """A real left click (press and release) at the centre of the first element matching ``selector``."""
        x, y = self._center(selector)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type_text(self, selector: str, text: str) -> None:
        """Focus the element (by clicking it) and type ``text`` as keyboard input."""
        self.click(selector)
        self.send("Input.insertText", text=text)

    def screenshot(self, path: str | os.PathLike, full_page: bool = True) -> Path:
        """Save a PNG of the page (the whole page when ``full_page``)."""
        height = self.height
        if full_page:
            height = max(self.height, int(self.evaluate("document.documentElement.scrollHeight")))
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=height, deviceScaleFactor=1,
                  mobile=False)
        try:
            data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=full_page)["data"]
        finally:
            self.send("Emulation.clearDeviceMetricsOverride")
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                self._session = None
                self.send("Browser.close", timeout=5)
                proc.wait(timeout=10)
            except (BrowserError, OSError, subprocess.TimeoutExpired):
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:  # already closed
                pass
        self._log.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
