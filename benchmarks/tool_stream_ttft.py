"""Time to first streamed token of a chat request with tools, against the same request without.

Before issue 15 a streamed chat request with `tools` was buffered whole and sent at the end, so
its first token came when the whole reply was done; now tool calls are parsed while they stream.
This runs an engine server (`python -m portcullis.engine`, on a Unix socket, `--tool-call-parser hermes
--enable-auto-tool-choice`) on the demo model and sends, one at a time and alternating, the same
streamed conversation with `tools` (tool_choice "auto") and without. The reply is the model's
text (no call), greedy, `ignore_eos`, a fixed length. Reported per kind: time to the first body
byte, to the first chunk that carries a token (content or tool_calls), and to the end; medians
and p90 in ms.

    .venv/bin/python benchmarks/tool_stream_ttft.py [--rounds 30] [--max-tokens 128] [--out FILE]

`--engine-root DIR --plain-engine` runs an engine from another checkout without the new flags
(e.g. `git worktree add /tmp/before <commit>`), to measure the old behaviour the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write a function that returns the weather in Paris."}]


def start_engine(root: Path, sock: Path, plain: bool) -> subprocess.Popen:
    flags = [] if plain else ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    cmd = [sys.executable, "-m", "portcullis.engine", "--uds", str(sock), "--no-token", "--max-model-len", "1024",
           "--kv-cache-memory", "256MiB", "--log-format", "console", *flags]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(client: httpx.Client, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine exited with code {proc.returncode}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("the engine did not become healthy")


def one_request(client: httpx.Client, tools: bool, max_tokens: int) -> dict[str, float]:
    body = {"messages": MESSAGES, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if tools:
        body |= {"tools": TOOLS, "tool_choice": "auto"}
    start = time.perf_counter()
    first_byte = first_token = None
    text = ""
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            now = time.perf_counter()
            first_byte = first_byte or now
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                if delta.get("content") or delta.get("tool_calls"):
                    first_token = first_token or now
                    text += delta.get("content") or ""
    end = time.perf_counter()
    return {"first_byte_ms": (first_byte - start) * 1e3, "first_token_ms": (first_token - start) * 1e3,
            "total_ms": (end - start) * 1e3, "chars": len(text)}


def summary(samples: list[dict]) -> dict[str, float]:
    out = {}
    for key in ("first_byte_ms", "first_token_ms", "total_ms"):
        values = sorted(s[key] for s in samples)
        out[key.replace("_ms", "")] = {"p50": round(statistics.median(values), 1),
                                       "p90": round(values[int(0.9 * (len(values) - 1))], 1)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="requests of each kind (alternating)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engine-root", type=Path, default=ROOT, help="the checkout whose engine to run")
    p.add_argument("--plain-engine", action="store_true", help="start the engine without the tool-call flags")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "engine.sock"
        proc = start_engine(args.engine_root.resolve(), sock, args.plain_engine)
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=120)
        try:
            wait_ready(client, proc)
            for tools in (False, True, False, True):  # warm-up
                one_request(client, tools, args.max_tokens)
            runs: dict[str, list[dict]] = {"without_tools": [], "with_tools": []}
            for _ in range(args.rounds):
                runs["without_tools"].append(one_request(client, False, args.max_tokens))
                runs["with_tools"].append(one_request(client, True, args.max_tokens))
        finally:
            client.close()
            proc.terminate()
            proc.wait(30)
    result = {kind: summary(samples) for kind, samples in runs.items()}
    same_text = {s["chars"] for s in runs["without_tools"]} == {s["chars"] for s in runs["with_tools"]}
    result["settings"] = {"rounds": args.rounds, "max_tokens": args.max_tokens, "plain_engine": args.plain_engine,
                          "same_reply_length": same_text}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
