"""The hostile tenant of test_noisy_neighbour.py, in a process of its own: its client work (bodies
of megabytes, eight streams read event by event) must not take the interpreter lock from the
in-process gateway it attacks, or the harness would measure itself.

    python tests/reliability/hostile_load.py URL KEY PATH COPIES STREAM BODIES_FILE

Reads commands on stdin, one a line. `go`: each of the COPIES clients whose last request has
ended sends the next body of BODIES_FILE (one JSON body a line, taken in turn) to PATH; answers
`ok` once those requests are under way (STREAM=1: once each has its first bytes back). So the
hostile tenant has one request of its class in flight per victim round, not a flood of cheap
refusals. `stop` (or EOF): hangs up what is in flight and prints {"statuses": {...}, "seconds": [...]}.
"""
from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from collections import Counter

import httpx


class HostileClient:
    """One client: sends a request when told to, unless its last one is still in flight."""

    def __init__(self, url: str, key: str, path: str, bodies, stop: threading.Event, record) -> None:
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        self.client = httpx.Client(base_url=url, headers=headers, timeout=300)
        self.path, self.bodies, self.stop, self.record = path, bodies, stop, record
        self.thread: threading.Thread | None = None

    def go(self) -> threading.Event | None:
        """Start the next request if the last has ended; the event is set once its first bytes are back."""
        if self.thread is not None and self.thread.is_alive():
            return None
        started = threading.Event()
        self.thread = threading.Thread(target=self._send, args=(next(self.bodies), started), daemon=True)
        self.thread.start()
        return started

    def _send(self, body: bytes, started: threading.Event) -> None:
        began = time.perf_counter()
        try:
            with self.client.stream("POST", self.path, content=body) as reply:
                for _ in reply.iter_raw():  # read and drop
                    started.set()
                    if self.stop.is_set():
                        break  # hang up mid-reply: the engine aborts the request
            self.record(reply.status_code, time.perf_counter() - began)
        finally:
            started.set()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=300)
        self.client.close()


def main(url: str, key: str, path: str, copies: int, stream: bool, bodies_file: str) -> None:
    with open(bodies_file, "rb") as f:
        bodies = itertools.cycle([line.rstrip(b"\n") for line in f if line.strip()])
    lock, stop = threading.Lock(), threading.Event()
    statuses, seconds = Counter(), []

    def record(status: int, took: float) -> None:
        with lock:
            statuses[status] += 1
            seconds.append(took)

    clients = [HostileClient(url, key, path, bodies, stop, record) for _ in range(copies)]
    for command in sys.stdin:
        if command.strip() != "go":
            break
        started = [event for event in (c.go() for c in clients) if event is not None]
        for event in started if stream else ():
            event.wait(timeout=300)
        print("ok", flush=True)
    stop.set()
    for client in clients:
        client.close()
    print(json.dumps({"statuses": statuses, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6])
