"""Headless Chromium driven over the DevTools protocol, for the console's end-to-end tests:
Debian's `chromium` (installed by `.ci/run`) and the `websockets` client, no driver binary.

The browser answers HTTP auth challenges with the credentials it was given, as a person types
them into the login prompt; every other request goes on untouched.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

# Flags for a closed network and a root user (the CI machine): no sandbox, no background calls home.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--remote-allow-origins=*", "--window-size=1280,900"]


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="portcullis-chromium-")
        port = _free_port()
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--remote-debugging-port={port}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ws = connect(self._page_socket(port), max_size=None, open_timeout=30)
        self.credentials: tuple[str, str] | None = None
        self._id = 0
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Fetch.enable", handleAuthRequests=True, patterns=[{"urlPattern": "*"}])

    def _page_socket(self, port: int) -> str:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as reply:
                    pages = [t for t in json.load(reply) if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        mine = self._id
        self.ws.send(json.dumps({"id": mine, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == mine:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict[str, Any]) -> None:
        """Paused requests go on; an auth challenge gets the credentials (or is cancelled)."""
        method, params = message.get("method"), message.get("params", {})
        if method == "Fetch.requestPaused":
            self._reply("Fetch.continueRequest", requestId=params["requestId"])
        elif method == "Fetch.authRequired":
            answer = ({"response": "ProvideCredentials", "username": self.credentials[0],
                       "password": self.credentials[1]} if self.credentials else {"response": "CancelAuth"})
            self._reply("Fetch.continueWithAuth", requestId=params["requestId"], authChallengeResponse=answer)

    def _reply(self, method: str, **params: Any) -> None:
        self._id += 1  # its answer is read and dropped by whichever loop comes next
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None  # the page is between documents
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"still false after {timeout} s: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)


def needs_chromium() -> str:
    """The browser's path; a machine without it skips, except in CI (`.ci/run` installs it)."""
    import pytest

    binary = executable()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs Debian's chromium (.ci/run): the console's browser tests must run")
        pytest.skip("no chromium here (apt-get install chromium)")
    return binary
