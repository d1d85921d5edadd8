"""A real headless Chromium driven over the DevTools protocol (no Selenium, no
Playwright download): open a page, wait until its rendered text holds what we
expect, dismiss Dagster's first-visit dialog, take a screenshot.

Used by the UI test (test_dagster_webserver.py) and by docs/refresh_screenshots.py,
so the screenshot in docs/ comes from the same path the test checks.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from websockets.sync.client import connect

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
START_TIMEOUT = 30.0  # seconds for the browser to open its DevTools port
PAGE_TIMEOUT = 60.0  # seconds for a page's rendered text to show what a test waits for
WINDOW = (1400, 900)  # the screenshot size
BACKGROUND_OFF = (
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--no-default-browser-check",
    "--mute-audio",
    "--metrics-recording-only",
    "--disable-features=Translate,MediaRouter,OptimizationHints",
)


def chromium_path() -> str | None:
    return next((p for name in CHROMIUM_CANDIDATES if (p := shutil.which(name))), None)


class Browser:
    """One headless Chromium process and one page, talked to over its DevTools websocket."""

    def __init__(self, executable: str | None = None):
        executable = executable or chromium_path()
        if not executable:
            raise RuntimeError("no Chromium found (Debian: apt-get install chromium)")
        self._profile = tempfile.mkdtemp(prefix="chromium-")
        self._proc = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                # No background work beside the page (what automation tools pass): no component
                # updates, sync, extensions or other network chatter of the browser's own.
                *BACKGROUND_OFF,
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={WINDOW[0]},{WINDOW[1]}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            page = next(t for t in json.loads(resp.read()) if t["type"] == "page")
        self._stack = ExitStack()
        self._ws = self._stack.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024, open_timeout=10)
        )
        self._ids = itertools.count(1)
        self.call("Page.enable")

    def call(self, method: str, **params) -> dict:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv(timeout=PAGE_TIMEOUT))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result.get("result", {}).get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for_text(self, *needles: str, timeout: float = PAGE_TIMEOUT) -> str:
        """The page's rendered text once it contains every needle; AssertionError with what it showed."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.text()
            if all(n in text for n in needles):
                return text
            time.sleep(0.5)
        missing = [n for n in needles if n not in text]
        raise AssertionError(f"page never showed {missing}; it showed: {' '.join(text.split())[:1500]}")

    def dismiss_community_dialog(self, timeout: float = 15.0) -> bool:
        """Dagster's first-visit 'Join the Dagster community' dialog covers the page (it appears a
        moment after the page): wait for it, press Skip, wait until it is gone. False if it never came."""
        click = (
            "(() => { const b = [...document.querySelectorAll('button')]"
            ".find(e => e.innerText.trim() === 'Skip'); if (b) { b.click(); return true; } return false; })()"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.evaluate(click):
                while "Join the Dagster community" in self.text() and time.monotonic() < deadline:
                    time.sleep(0.2)
                return True
            time.sleep(0.3)
        return False

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        stack = getattr(self, "_stack", None)
        if stack is not None:
            stack.close()
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
