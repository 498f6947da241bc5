"""Headless Chromium with WebGPU, driven over the DevTools protocol through a pipe (no websocket,
no driver, no dependency): what `normkit export-web --demo` and tests/test_web.py use.

    with serve(folder) as url, Chromium() as browser:
        browser.open(url + "/index.html")
        browser.evaluate("navigator.gpu.requestAdapter().then(a => !!a)")

Chromium finds a software WebGPU adapter (SwiftShader, Vulkan on the CPU) with the FLAGS below; a
real GPU is not needed. find_chromium() says where the browser is, or why there is none.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Chromium 156 (Debian 12): --enable-unsafe-webgpu is what exposes navigator.gpu on Linux;
# --use-webgpu-adapter=swiftshader picks the CPU adapter (it reports 'subgroups', not 'shader-f16'),
# --enable-unsafe-swiftshader allows it where Chromium would refuse a software adapter.
FLAGS = ("--headless=new", "--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader", "--enable-unsafe-swiftshader",
         "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-gpu-sandbox",
         "--hide-scrollbars", "--mute-audio")
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
INSTALL_HINT = "install it (Debian/Ubuntu: apt-get install chromium) or set NORMKIT_CHROMIUM to its path"


class BrowserError(RuntimeError):
    """The browser could not be started or a page failed (the message says which and why)."""


class PageError(BrowserError):
    """JavaScript evaluated in the page threw; .text is the page's message."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def find_chromium() -> tuple[str | None, str]:
    """(path, "") or (None, one sentence saying why there is none)."""
    forced = os.environ.get("NORMKIT_CHROMIUM")
    if forced:
        path = shutil.which(forced)
        return (path, "") if path else (None, f"NORMKIT_CHROMIUM={forced!r} is not an executable")
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path, ""
    return None, f"no Chromium browser found (looked for {', '.join(NAMES)} on PATH); {INSTALL_HINT}"


class Chromium:
    """One headless Chromium with one page, driven through --remote-debugging-pipe."""

    def __init__(self, path: str | None = None, *, extra_flags=(), timeout: float = 60.0):
        if path is None:
            path, why = find_chromium()
            if path is None:
                raise BrowserError(why)
        self.timeout = timeout
        self.console: list[str] = []  # the page's console lines and uncaught exceptions, for error messages
        self._profile = tempfile.TemporaryDirectory(prefix="normkit-chromium-")
        flags = list(FLAGS) + list(extra_flags) + [f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        flags += os.environ.get("NORMKIT_CHROMIUM_FLAGS", "").split()
        to_browser, self._write_end = _high(os.pipe())
        self._read_end, from_browser = _high(os.pipe())
        self._log = tempfile.TemporaryFile()
        # the browser reads commands on fd 3 and writes replies on fd 4; a small Python trampoline
        # moves the pipe ends there (a preexec_fn would not be safe next to the HTTP server's thread)
        trampoline = ("import os, sys; a, b = int(sys.argv[1]), int(sys.argv[2]); os.dup2(a, 3); os.dup2(b, 4); "
                      "os.close(a); os.close(b); os.execv(sys.argv[3], sys.argv[3:])")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", trampoline, str(to_browser), str(from_browser), path, *flags, "about:blank"],
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, pass_fds=(to_browser, from_browser))
        except OSError as e:
            raise BrowserError(f"could not start {path}: {e}") from None
        finally:
            os.close(to_browser)
            os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self.session = None
        try:
            self.version = self.call("Browser.getVersion")["product"]
            pages = [t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
            target = pages[0]["targetId"] if pages else self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------- protocol

    def _send(self, method: str, params: dict, session) -> int:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._write_end, json.dumps(message).encode() + b"\0")
        return self._next_id

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read_end], [], [], left)[0]:
                raise BrowserError(f"Chromium did not answer in time{self._tail()}")
            chunk = os.read(self._read_end, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium exited (code {self._proc.poll()}){self._tail()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\0", 1)
        message = json.loads(line)
        self._note(message)
        return message

    def _note(self, message: dict) -> None:
        method = message.get("method")
        if method == "Runtime.consoleAPICalled":
            args = message["params"]["args"]
            self.console.append(f"console.{message['params']['type']}: " +
                                " ".join(str(a.get("value", a.get("description", ""))) for a in args))
        elif method == "Runtime.exceptionThrown":
            details = message["params"]["exceptionDetails"]
            self.console.append("uncaught: " + details.get("exception", {}).get("description", details.get("text", "")))

    def call(self, method: str, params: dict | None = None, *, timeout: float | None = None):
        """Sends one command (to the page's session once attached) and returns its result."""
        browser_level = method.split(".")[0] in ("Browser", "Target")
        wanted = self._send(method, params or {}, None if browser_level else self.session)
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            message = self._receive(deadline)
            if message.get("id") == wanted:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error'].get('message')}")
                return message["result"]

    def wait_event(self, method: str, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            message = self._receive(deadline)
            if message.get("method") == method:
                return message.get("params", {})

    def _tail(self) -> str:
        lines = self.console[-10:]
        if self._proc.poll() is not None:  # the browser's own last words
            self._log.seek(0)
            lines += [line for line in self._log.read().decode(errors="replace").splitlines()
                      if line.strip() and "dbus" not in line][-10:]
        return (": " + " | ".join(lines)) if lines else ""

    # ------------------------------------------------------------------------- page

    def open(self, url: str, timeout: float | None = None) -> None:
        """Loads url in the page and waits for its load event."""
        result = self.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"could not open {url}: {result['errorText']}")
        self.wait_event("Page.loadEventFired", timeout)

    def evaluate(self, expression: str, timeout: float | None = None):
        """The value of a JavaScript expression in the page (promises are awaited), as JSON data.
        A thrown error becomes a PageError carrying the page's message."""
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True,
                                                "timeout": int(1000 * (timeout or self.timeout))}, timeout=timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text", "error")
            raise PageError(text)
        return result["result"].get("value")

    def screenshot(self, path: Path, width: int = 1200) -> None:
        """A PNG of the whole page at the given CSS width."""
        height = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)"))
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            with contextlib.suppress(Exception):
                self._send("Browser.close", {}, None)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for fd in (getattr(self, "_write_end", None), getattr(self, "_read_end", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._write_end = self._read_end = None
        self._profile.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _high(fds):
    """The fds moved to numbers >= 10, so the shell's redirections to 3 and 4 cannot clobber them."""
    moved = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in fds)
    for fd in fds:
        os.close(fd)
    return moved


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".js": "text/javascript",
                      ".mjs": "text/javascript", ".wasm": "application/wasm"}

    def log_message(self, *args):
        pass

    def end_headers(self):
        self.send_header("Cache-Control", "no-store")
        super().end_headers()


@contextlib.contextmanager
def serve(folder: Path):
    """Serves folder on http://127.0.0.1:<free port> (a secure context, as WebGPU requires)."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
