"""Policy-file faults against a running gateway: the file replaced by garbage or by a huge
file, deleted, swapped through symlinks as a Kubernetes ConfigMap does, or flapping every 100 ms.

In every case the last good policy keeps serving, each refusal is logged once (not at every
poll), and /readyz says the files on disk were refused until a good version is back.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from structlog.testing import capture_logs

from tests.gateway.conftest import RunningGateway  # the `gw` fixture comes from ./conftest.py

COMPLETION = {"model": "other", "prompt": "hi", "max_tokens": 2}


async def _wait(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.02)


def _replace(path: Path, data: bytes) -> None:
    """Write as editors and `kubectl` do: a new file renamed over the old one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _refusals(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "policy_reload_refused"]


async def _serves_the_last_good_policy(gw: RunningGateway) -> None:
    async with gw.client() as client:
        response = await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())
        assert response.status_code == 200, response.text
        ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["policy"]["reload_refused"] is True


async def test_garbage_is_refused_once_and_the_last_good_policy_serves(gw):
    with capture_logs() as logs:
        _replace(gw.policy_path, b"\x89PNG\r\n\x1a\n\x00\x00 not a policy {{{")
        await _wait(lambda: gw.gateway.store.last_error is not None)
        await asyncio.sleep(0.5)  # several polls: the refusal is not logged again
    (event,) = _refusals(logs)
    assert event["file"] == str(gw.policy_path) and event["still_serving_generation"] == 0
    await _serves_the_last_good_policy(gw)


async def test_a_huge_file_is_refused_without_reading_it_all(gw):
    with capture_logs() as logs:
        with open(gw.policy_path.with_name("big.tmp"), "wb") as big:
            big.truncate(65 * 1024 * 1024)  # sparse: no disk used
        os.replace(gw.policy_path.with_name("big.tmp"), gw.policy_path)
        await _wait(lambda: gw.gateway.store.last_error is not None)
    (event,) = _refusals(logs)
    assert "larger than 64 MiB" in event["reason"]
    await _serves_the_last_good_policy(gw)


async def test_deleted_policy_is_refused_and_its_return_applies(gw):
    good = gw.policy_path.read_bytes()
    with capture_logs() as logs:
        gw.policy_path.unlink()
        await _wait(lambda: gw.gateway.store.last_error is not None)
        await asyncio.sleep(0.5)
    (event,) = _refusals(logs)
    assert "No such file" in event["reason"]
    await _serves_the_last_good_policy(gw)
    changed = yaml.safe_load(good)
    changed["tenants"]["acme"]["models"] = ["demo"]
    _replace(gw.policy_path, yaml.safe_dump(changed).encode())
    await _wait(lambda: gw.gateway.store.generation == 1)
    assert gw.gateway.store.last_error is None
    async with gw.client() as client:
        assert (await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())).status_code == 403


def _configmap_version(folder: Path, name: str, text: str) -> None:
    """Publish a version as the kubelet does: a new `..NAME` folder, then `..data` swapped to it
    by a rename, so `policy.yaml -> ..data/policy.yaml` changes target in one step."""
    version = folder / f"..{name}"
    version.mkdir()
    (version / "policy.yaml").write_text(text)
    link = folder / "..data_tmp"
    link.symlink_to(version.name)
    os.replace(link, folder / "..data")


async def test_configmap_symlink_swaps_are_followed(gw):
    """Symlinks are followed: a ConfigMap update is a symlink swap, and must apply."""
    folder, good = gw.folder, gw.policy_path.read_text()
    _configmap_version(folder, "v1", good)
    gw.policy_path.unlink()
    gw.policy_path.symlink_to("..data/policy.yaml")
    await asyncio.sleep(0.3)
    assert gw.gateway.store.generation == 0 and gw.gateway.store.last_error is None  # same policy
    changed = yaml.safe_load(good)
    changed["tenants"]["acme"]["models"] = ["demo"]
    _configmap_version(folder, "v2", yaml.safe_dump(changed))
    await _wait(lambda: gw.gateway.store.generation == 1)
    async with gw.client() as client:
        assert (await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())).status_code == 403
    with capture_logs() as logs:
        _configmap_version(folder, "v3", "routes: [\n")  # a broken version is refused like any edit
        await _wait(lambda: gw.gateway.store.last_error is not None)
    (event,) = _refusals(logs)
    assert event["file"] == str(gw.policy_path) and "YAML error" in event["reason"]
    (folder / "..data").unlink()  # dangling: refused too, v2 keeps serving
    await _wait(lambda: gw.gateway.store.refusals == 2)
    async with gw.client() as client:
        response = await client.post("/v1/completions", json={**COMPLETION, "model": "demo"}, headers=gw.auth())
    assert response.status_code == 200 and gw.gateway.store.generation == 1


async def test_flapping_file_keeps_serving_and_logs_the_refusal_once(gw):
    good, bad = gw.policy_path.read_bytes(), b"routes: [\n  {method: GET\n"
    stop = threading.Event()

    def flap() -> None:
        while not stop.is_set():
            for data in (bad, good):
                _replace(gw.policy_path, data)
                time.sleep(0.1)

    flapper = threading.Thread(target=flap, daemon=True)
    statuses = []
    with capture_logs() as logs:
        flapper.start()
        try:
            async with gw.client() as client:
                ends = time.monotonic() + 2.0
                while time.monotonic() < ends:
                    response = await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())
                    statuses.append(response.status_code)
                    await asyncio.sleep(0.02)
        finally:
            stop.set()
            flapper.join()
        _replace(gw.policy_path, good)
        await _wait(lambda: gw.gateway.store.last_error is None)
    assert statuses and set(statuses) == {200}
    assert gw.gateway.store.refusals >= 2  # seen several times ...
    assert len(_refusals(logs)) == 1  # ... logged once
    assert gw.gateway.store.generation == 0  # the good version is the one in force: nothing to apply
    async with gw.client() as client:
        assert (await client.get("/readyz")).json() == {"status": "ready"}
