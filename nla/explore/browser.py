"""A minimal headless-Chromium driver over the DevTools protocol (for the browser test and the docs screenshot).

It starts the system's Chromium (Debian package ``chromium``; ``$NLA_CHROMIUM`` overrides the
binary) with ``--remote-debugging-port=0``, reads the port Chromium chose from the profile's
``DevToolsActivePort`` file, and talks to the one page over its websocket. Clicks and typing
are real input events (``Input.dispatchMouseEvent`` / ``Input.insertText``), not JavaScript
``click()`` calls. Nothing is downloaded: no driver binary, no browser build.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
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
        from websockets.sync.client import connect

        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError("no Chromium binary found; install the Debian package `chromium` or set $NLA_CHROMIUM")
        self.width, self.height = width, height
        self._profile = Path(tempfile.mkdtemp(prefix="nla-chromium-"))
        self._log = open(self._profile.parent / f"{self._profile.name}.log", "wb")  # noqa: SIM115 (closed in close)
        cmd = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
               "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
               f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"]
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._ids = itertools.count(1)
        try:
            port = self._wait_port(start_timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
                targets = json.loads(resp.read())
            pages = [t for t in targets if t.get("type") == "page"]
            if not pages:
                raise BrowserError(f"Chromium offers no page target (targets: {targets})")
            self._ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
            self.send("Page.enable")
            self.send("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _wait_port(self, timeout: float) -> int:
        port_file = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrowserError(f"Chromium exited with code {self._proc.returncode} at start: {self._log_tail()}")
            if port_file.is_file():
                first = port_file.read_text().split("\n")[0].strip()
                if first.isdigit():
                    return int(first)
            time.sleep(0.05)
        raise BrowserError(f"Chromium did not open its DevTools port within {timeout:.0f} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        self._log.flush()
        lines = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "(no output)"

    # ------------------------------------------------------------------ protocol
    def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events arriving meanwhile are dropped)."""
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"{method}: no answer from Chromium within {timeout:.0f} s")
            msg = json.loads(self._ws.recv(timeout=left))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise BrowserError(f"{method}: {msg['error'].get('message')}")
                return msg.get("result", {})

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
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
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
        ws = getattr(self, "_ws", None)
        if ws is not None:
            try:
                ws.close()
            except Exception:  # closing a dead socket: nothing left to clean
                pass
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        shutil.rmtree(self._profile, ignore_errors=True)
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
