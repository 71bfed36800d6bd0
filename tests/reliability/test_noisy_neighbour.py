"""Noisy neighbours (issue 29): one hostile request of each class the second red-team review
found runs against a real engine through an in-process gateway while a victim tenant keeps
sending small completions and short streams. The victim's small-request latency must stay
within 3x its baseline and its streams' time per token within 1.5x.

The baseline is the victim alone, or, for a hostile request that is large by what it pays for
(prompt tokens, samples, streams), the victim beside its *twin*: a plain request of the same
billed size. On two cores such a request slows its neighbours whoever sends it (the report shows
by how much); what must not happen is that hostile content makes it cost more than its twin.

Each hostile request is sent at the size the product admits (the caps of `portcullis.protocol`,
the gateway's default body limit), or at the red team's size where that is now refused. One is
sent with each round of victim traffic (a small completion, then a stream), from a process of
its own, unless the last is still running: one hostile request in flight at a time, not a flood
of cheap refusals. Times are medians of several rounds, and the baseline is taken both before
and after the load, so a busy shared machine moves both sides alike.

And the engine's memory under unique grammars at the caps: within a stated bound while they
keep coming (the grammar cache, as the process holds it, and a compile's scratch space), no
longer growing once the cache is full, and no higher after an idle pause.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from portcullis.protocol.caps import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_CHOICES_CHARS,
    MAX_GRAMMAR_CHARS,
)
from portcullis.protocol.requests import MAX_PROMPT_LOGPROB_ENTRIES
from tests.reliability.conftest import (
    DEMO,
    REPO,
    EngineProcess,
    GatewayFactory,
    base_policy,
    healthy_engine,
    report,
)

# As `portcullis serve` runs the demo model (its whole 2,048-token context, the default step
# budget of 2,048 tokens), so the red team's requests are admitted as they were; the KV cache is
# smaller than serve's 2 GiB but holds every request here at once.
NEIGHBOUR_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory", "192MiB"]
CONTEXT = 2048

SMALL_LIMIT = 3.0  # x the victim's baseline small-request latency
TPT_LIMIT = 1.5  # x the victim's baseline time per output token
BASELINE_ROUNDS = 4  # before the load, and again after it
LOADED_ROUNDS = 6
STREAM_TOKENS = 32
HOSTILE_LOAD = Path(__file__).with_name("hostile_load.py")


@pytest.fixture(scope="module")
def neighbour_engine() -> Iterator[EngineProcess]:
    with healthy_engine("neighbours", NEIGHBOUR_FLAGS) as running:
        yield running


@pytest.fixture
def gateway_url(gateways: GatewayFactory, neighbour_engine: EngineProcess) -> tuple[str, dict[str, str]]:
    """The gateway's URL and the keys: `alice` (tenant acme) is the victim, `carol` (globex) hostile."""
    policy = base_policy()
    policy["tenants"]["acme"]["models"] = [DEMO]
    policy["defaults"] = {"max_tokens": CONTEXT}  # and the product's default body limit, 4 MiB
    running = gateways.start(policy, engine_url=f"unix://{neighbour_engine.sock}")
    return running.url, running.keys


# ---- the victim -----------------------------------------------------------------------------

SMALL = {"model": DEMO, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
STREAM = {"model": DEMO, "prompt": "def main():", "max_tokens": STREAM_TOKENS, "temperature": 0,
          "ignore_eos": True, "stream": True}


@dataclass
class Victim:
    client: httpx.Client
    small: list[float] = field(default_factory=list)  # seconds per small completion
    # Seconds per token, one figure per stream, from sending it to its last token: a stall
    # before the first token counts too (tokens held up, then sent in a burst, would not).
    tpt: list[float] = field(default_factory=list)

    def round(self) -> None:
        started = time.perf_counter()
        reply = self.client.post("/v1/completions", json=SMALL)
        self.small.append(time.perf_counter() - started)
        assert reply.status_code == 200, reply.text
        arrivals, started = [], time.perf_counter()
        with self.client.stream("POST", "/v1/completions", json=STREAM) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    arrivals.append(time.perf_counter())
        assert len(arrivals) >= STREAM_TOKENS // 2, f"the victim's stream gave {len(arrivals)} events"
        self.tpt.append((arrivals[-1] - started) / len(arrivals))


def victim_rounds(client: httpx.Client, rounds: int, before_each: Callable[[], None] = lambda: None) -> Victim:
    victim = Victim(client)
    for _ in range(rounds):
        before_each()
        victim.round()
    return victim


# ---- the hostile tenant -----------------------------------------------------------------------

@dataclass(frozen=True)
class Hostile:
    """A hostile request (or a group of `copies` at once), sent by `hostile_load.py` in a process
    of its own at the start of each victim round, unless the last one is still running."""

    path: str
    bodies: Callable[[], list[bytes]]  # raw JSON, taken in turn (unique grammars: one each)
    copies: int = 1
    stream: bool = False  # the victim's round starts once each has its first bytes back
    twin: Hostile | None = None  # a plain request of the same billed size: the baseline, if given

    @contextlib.contextmanager
    def running(self, url: str, key: str, folder: Path) -> Iterator[HostileLoad]:
        bodies = folder / "hostile-bodies.jsonl"
        bodies.write_bytes(b"\n".join(self.bodies()) + b"\n")
        proc = subprocess.Popen([sys.executable, str(HOSTILE_LOAD), url, key, self.path, str(self.copies),
                                 str(int(self.stream)), str(bodies)],
                                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        load = HostileLoad(proc)
        try:
            yield load
        finally:
            out, _ = proc.communicate("stop\n", timeout=300)
            load.seen.update(json.loads(out.splitlines()[-1]))


@dataclass
class HostileLoad:
    proc: subprocess.Popen
    seen: dict = field(default_factory=dict)  # at the end: {"statuses": {code: count}, "seconds": [...]}

    def go(self) -> None:
        """The next hostile request is under way (a stream: sending; a whole reply: sent)."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "ok\n", f"the hostile client failed ({self.proc.wait()})"


def dumps(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def unique_choices(n: int, count: int = MAX_CHOICES, chars: int = 0) -> list[str]:
    """`count` choices of `chars` characters (at the caps by default), none seen before: the
    grammar cache cannot help."""
    chars = chars or min(MAX_CHOICE_CHARS, MAX_CHOICES_CHARS // count)
    return [f"{n}-{i}-".ljust(chars, "abcdefghij"[i % 10]) for i in range(count)]


def _unique_choice_requests(count: int) -> Callable[[], list[bytes]]:
    serial = itertools.count(int(time.time()))
    return lambda: [dumps({"model": DEMO, "prompt": "Pick one:", "max_tokens": 128,
                           "guided_choice": unique_choices(next(serial))}) for _ in range(count)]


def _constant(body: dict) -> Callable[[], list[bytes]]:
    return lambda: [dumps(body)]  # built when the test runs, not at import


def _unique_prompts(prompts: int, tokens: int, **body) -> Callable[[], list[bytes]]:
    """One body per round, each with `prompts` token-id prompts no earlier body had: the prefix
    cache cannot make the twin cheaper than what it pays for."""
    serial = itertools.count()

    def make() -> dict:
        k = next(serial)
        return {"model": DEMO, "prompt": [[3 + (k * 7919 + p * 104729 + i * 31) % 4000 for i in range(tokens)]
                                          for p in range(prompts)], **body}

    return lambda: [dumps(make()) for _ in range(LOADED_ROUNDS)]


# The largest echo-with-logprobs request under the product cap: n x prompt tokens x (20 + 1)
# entries, the red team's 4 samples of 4 prompts with each prompt as long as the cap allows.
LOGPROB_PROMPT_TOKENS = MAX_PROMPT_LOGPROB_ENTRIES // (4 * 4 * 21)
assert 4 * 4 * LOGPROB_PROMPT_TOKENS * 21 <= MAX_PROMPT_LOGPROB_ENTRIES
# Demo tokenizer: "timeout" is token 1536, bytes 00 06 00 00, and "!" token 6, 06 00 00 00: the
# output's tokens match across every boundary of the prediction's (the red team's 256 vs 1, in text).
ADVERSARIAL_PREDICTION = "timeout" * 2040
FORCED_TOKEN = 6

HOSTILE = {
    # 1. 380,000 `[[]]` in an extra field: 1.9 MB, under the 4 MiB body limit.
    "json_containers": Hostile("/v1/completions", _constant(
        {"model": DEMO, "prompt": "hi", "max_tokens": 1, "extra": [[[]]] * 380_000})),
    # 2. A 3.5 MB prompt, to /tokenize and to a completion (a body limit of 4 MiB admits it).
    "huge_prompt_tokenize": Hostile("/tokenize", _constant({"model": DEMO, "prompt": "hello world " * 300_000})),
    "huge_prompt_completion": Hostile("/v1/completions", _constant(
        {"model": DEMO, "prompt": "hello world " * 300_000, "max_tokens": 1})),
    # 3. The red team's echo + logprobs request, and the largest one the product cap admits.
    "prompt_logprobs_red_team": Hostile("/v1/completions", _constant(
        {"model": DEMO, "prompt": [[7] * 1000] * 4, "n": 4, "echo": True, "logprobs": 20, "max_tokens": 1})),
    "prompt_logprobs_at_cap": Hostile("/v1/completions", _constant(
        {"model": DEMO, "prompt": [[7] * LOGPROB_PROMPT_TOKENS] * 4, "n": 4, "echo": True, "logprobs": 20,
         "max_tokens": 1}), twin=Hostile("/v1/completions", _unique_prompts(4, LOGPROB_PROMPT_TOKENS, n=4, max_tokens=1))),
    # 4. Eight streams whose prediction matches the forced output across every token boundary.
    "adversarial_prediction": Hostile("/v1/completions", _constant(
        {"model": DEMO, "prompt": "Hi", "max_tokens": CONTEXT - 16, "stream": True, "ignore_eos": True,
         "prediction": {"type": "content", "content": ADVERSARIAL_PREDICTION},
         "allowed_token_ids": [FORCED_TOKEN]}), copies=8, stream=True,
        twin=Hostile("/v1/completions", _constant(
            {"model": DEMO, "prompt": "Hi", "max_tokens": CONTEXT - 16, "stream": True, "ignore_eos": True,
             "allowed_token_ids": [FORCED_TOKEN]}), copies=8, stream=True)),
    # 5. A unique choice list at the caps each time (no compiled grammar to reuse): 256 choices
    # of 64 characters (the total cap, 16,384).
    "guided_choice": Hostile("/v1/completions", _unique_choice_requests(LOADED_ROUNDS)),
}


def median(values: list[float]) -> float:
    return statistics.median(values)


def _under(load: Hostile, client: httpx.Client, url: str, key: str, folder: Path,
           engine: EngineProcess) -> tuple[Victim, dict]:
    with load.running(url, key, folder) as running:
        victim = victim_rounds(client, LOADED_ROUNDS, before_each=running.go)
    engine.wait_idle(timeout=60)
    return victim, running.seen


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_request_does_not_slow_the_victim(request, kind, gateway_url, neighbour_engine, tmp_path):
    url, keys = gateway_url
    hostile = HOSTILE[kind]
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {keys['alice']}"}, timeout=120) as client:
        victim_rounds(client, 2)  # warm-up: connections, first-use costs
        before = victim_rounds(client, BASELINE_ROUNDS)
        twin = _under(hostile.twin, client, url, keys["carol"], tmp_path, neighbour_engine)[0] if hostile.twin else None
        loaded, seen = _under(hostile, client, url, keys["carol"], tmp_path, neighbour_engine)
        after = victim_rounds(client, BASELINE_ROUNDS)

    alone_small, alone_tpt = median(before.small + after.small), median(before.tpt + after.tpt)
    base_small, base_tpt = (median(twin.small), median(twin.tpt)) if twin else (alone_small, alone_tpt)
    load_small, load_tpt = median(loaded.small), median(loaded.tpt)
    beside = (f"; beside its twin {1000 * base_small:.1f} ms ({base_small / alone_small:.2f}x alone), "
              f"{1000 * base_tpt:.1f} ms per token ({base_tpt / alone_tpt:.2f}x)") if twin else ""
    report(request, f"noisy neighbour {kind}: small {1000 * alone_small:.1f} ms alone -> {1000 * load_small:.1f} ms "
                    f"({load_small / base_small:.2f}x baseline), time per token {1000 * alone_tpt:.1f} -> "
                    f"{1000 * load_tpt:.1f} ms ({load_tpt / base_tpt:.2f}x){beside}; hostile {seen['statuses']} "
                    f"in {len(seen['seconds'])} requests, median {median(seen['seconds'] or [0]):.2f} s")
    assert all(int(code) < 500 for code in seen["statuses"]), f"hostile requests answered {seen['statuses']}"
    assert load_small <= SMALL_LIMIT * base_small, (
        f"{kind}: the victim's small requests took {1000 * load_small:.1f} ms (median) under load, "
        f"baseline {1000 * base_small:.1f} ms")
    assert load_tpt <= TPT_LIMIT * base_tpt, (
        f"{kind}: the victim's streams took {1000 * load_tpt:.1f} ms per token (median) under load, "
        f"baseline {1000 * base_tpt:.1f} ms")


# ---- memory under unique grammars -----------------------------------------------------------

def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def unique_schema(n: int) -> dict:
    """A JSON Schema of about MAX_GRAMMAR_CHARS characters (as JSON text), its property names unique to `n`."""
    properties, size = {}, 0
    while size < MAX_GRAMMAR_CHARS - 200:
        name = f"p{n}_{len(properties):04d}"
        properties[name] = {"type": "string", "maxLength": 8}
        size += len(json.dumps({name: properties[name]})) + 4  # and its place in "required"
    schema = {"type": "object", "properties": properties, "required": list(properties)[:8]}
    assert len(json.dumps(schema)) <= MAX_GRAMMAR_CHARS
    return schema


def grammar_request(n: int) -> dict:
    """Every third a schema at the cap, else a choice list at the caps; unique to `n` either way."""
    if n % 3 == 2:
        return {"model": DEMO, "prompt": "JSON:", "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": unique_schema(n)}}}
    return {"model": DEMO, "prompt": "Pick one:", "max_tokens": 8, "guided_choice": unique_choices(n)}


def test_unique_grammars_keep_engine_memory_bounded_and_it_returns_when_idle(request):
    """What unique grammars cost, on an engine of its own: after the hostile classes above, the
    shared engine's heap is fragmented by what it served (+121 to +195 MiB here, against +95 to
    +104 alone), which would measure them and not the grammars."""
    with healthy_engine("grammars", NEIGHBOUR_FLAGS) as engine:
        _grammar_memory(request, engine)


def _grammar_memory(request, engine: EngineProcess) -> None:
    pid, serial = engine.proc.pid, itertools.count(int(time.time() * 1000))
    with engine.http(timeout=120) as client:
        for _ in range(3):  # warm-up: xgrammar's first compile and every code path once
            assert client.post("/v1/completions", json=grammar_request(next(serial))).status_code == 200
        time.sleep(1)
        start, peak, half = rss_mib(pid), 0.0, 0.0
        for i in range(GRAMMARS):
            reply = client.post("/v1/completions", json=grammar_request(next(serial)))
            assert reply.status_code == 200, reply.text
            peak = max(peak, rss_mib(pid))
            half = peak if i == 2 * GRAMMARS // 3 else half
        deadline = time.monotonic() + IDLE_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
        idle = rss_mib(pid)
    report(request, f"engine RSS under {GRAMMARS} unique grammars: {start:.0f} MiB after warm-up, peak {peak:.0f} "
                    f"(+{peak - start:.0f}; +{half - start:.0f} two thirds of the way), after {IDLE_S} s idle {idle:.0f} "
                    f"(+{idle - start:.0f})")
    assert peak - start <= GROWTH_BOUND_MIB, f"the engine grew {peak - start:.0f} MiB (bound {GROWTH_BOUND_MIB})"
    # A bound, not a slope: the last third of the grammars (the cache long full) adds little.
    assert peak - half <= PLATEAU_MIB, f"the engine kept growing: +{half - start:.0f} MiB, then +{peak - half:.0f}"
    assert idle - start <= IDLE_BOUND_MIB, f"after idle the engine still holds +{idle - start:.0f} MiB"


GRAMMARS = 60  # 40 choice lists and 20 schemas: many times what the cache holds
IDLE_S = 3
# The stated bound (structured_output.py has the measurements): what the cache keeps, as the
# process holds it, and a compile's scratch space, however many unique grammars come.
GROWTH_BOUND_MIB = 192
IDLE_BOUND_MIB = 192
PLATEAU_MIB = 32
