"""Headless Chromium driven over the DevTools protocol (a websocket), for tests of the web
dashboard in a real browser. Debian's `chromium` package; .ci/run installs it when missing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

NAMES = ("chromium", "chromium-browser", "google-chrome")
ARTIFACTS_ENV = "REPLICAPLANE_TEST_ARTIFACTS"
"""A directory tests copy screenshots to, when set (CI keeps it)."""


def find() -> str | None:
    """The Chromium executable, or None."""
    for name in NAMES:
        if path := shutil.which(name):
            return path
    return None


def keep_artifact(path: str) -> str | None:
    """Copy `path` to $REPLICAPLANE_TEST_ARTIFACTS, if set; returns the copy's path."""
    folder = os.environ.get(ARTIFACTS_ENV)
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    return shutil.copy(path, os.path.join(folder, os.path.basename(path)))


class PageError(AssertionError):
    """The page threw, or a DevTools command failed."""


class Page:
    """One browser tab."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.exceptions: list[str] = []
        self.console: list[str] = []
        self.navigations = 0
        """Top-level documents loaded: a reload would add one."""
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                self.exceptions.append(str(details.get("exception", {}).get("description") or details.get("text")))
            elif method == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
            elif method == "Page.frameNavigated" and not params.get("frame", {}).get("parentId"):
                self.navigations += 1
        for future in self._pending.values():
            if not future.done():
                future.set_exception(PageError("the browser closed the connection"))

    async def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        """Run a DevTools command; returns its result."""
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self._ws.send_str(json.dumps({"id": self._next_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, timeout)
        if "error" in reply:
            raise PageError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise PageError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Wait (bounded) until `expression` is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.1)
        raise PageError(f"not true after {timeout:.0f} s: {expression} (last value {value!r})")

    async def navigate(self, url: str, timeout: float = 30.0) -> None:
        """Load `url` and wait until its document is complete."""
        await self.send("Page.navigate", url=url)
        await self.wait_for(f"location.href.startsWith({json.dumps(url.split('#')[0])})", timeout)
        await self.wait_for("document.readyState === 'complete'", timeout)

    async def screenshot(self, path: str) -> str:
        """Save a PNG of the whole page; returns `path`."""
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 4000), "scale": 1}
        shot = await self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
        await asyncio.to_thread(_write, path, base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        """Stop reading and close the connection."""
        await self._ws.close()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def _launch(exe: str, workdir: str, width: int, height: int) -> tuple[subprocess.Popen[bytes], str]:
    """Start Chromium with its profile and log in `workdir`; returns it and its profile dir."""
    profile = os.path.join(workdir, "chromium-profile")
    os.makedirs(profile, exist_ok=True)
    with open(os.path.join(workdir, "chromium.log"), "wb") as log:
        proc = subprocess.Popen(
            [
                exe,
                "--headless",
                "--no-sandbox",  # tests may run as root, where the sandbox refuses to start
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, profile


def _devtools_port(proc: subprocess.Popen[bytes], profile: str, timeout: float) -> int:
    """The DevTools port Chromium writes into its profile once it listens."""
    port_file = os.path.join(profile, "DevToolsActivePort")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(port_file, encoding="utf-8") as fh:
                line = fh.readline().strip()
            if line.isdigit():
                return int(line)
        except FileNotFoundError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise PageError(f"chromium did not start (exit code {proc.poll()}); see chromium.log beside {profile}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.asynccontextmanager
async def chromium(workdir: str, *, width: int = 1440, height: int = 1000) -> AsyncIterator[Page]:
    """A headless Chromium with one tab, stopped at the end. Its profile and log live in `workdir`.

    Raises:
        PageError: Chromium did not start in 60 s.
    """
    exe = find()
    if exe is None:
        raise PageError("no chromium executable")
    proc, profile = await asyncio.to_thread(_launch, exe, workdir, width, height)
    session = aiohttp.ClientSession()
    page: Page | None = None
    try:
        port = await asyncio.to_thread(_devtools_port, proc, profile, 60.0)
        deadline = time.monotonic() + 30
        ws_url = ""
        while not ws_url:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            ws_url = next((t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"), "")
            if not ws_url:
                if time.monotonic() > deadline:
                    raise PageError("chromium opened no tab")
                await asyncio.sleep(0.1)
        ws = await session.ws_connect(ws_url, max_msg_size=0)
        page = Page(ws)
        for domain in ("Page", "Runtime"):
            await page.send(f"{domain}.enable")
        yield page
    finally:
        if page is not None:
            await page.close()
        await session.close()
        await asyncio.to_thread(_stop, proc)
