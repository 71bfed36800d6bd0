"""`Fleet`: the engines behind the gateway, grouped by the models they serve, and the choice of
one replica for each request.

Where the replicas come from
    The policy's `upstreams:` list (hot-reloaded), or, when it is empty, the one engine of
    `--engine-url` serving every model (the shorthand: no checks, no scraping, as before).
    A reload keeps the `Replica` of an unchanged entry (its pool, health and load); a removed
    or changed one is retired: requests already on it finish there, and its connections close
    when the last one ends.

Health
    Every `health_interval_s` each replica's `/health` is asked; one that answers is (re)admitted
    after its `/v1/models` is read: a model the policy lists but the engine does not serve is
    logged and that replica is not used for it. A policy edit that keeps a replica reads its
    `/v1/models` again (served models, max_model_len), since the edit often follows a change
    of the engine. `eject_after` consecutive connection failures of
    real requests eject a replica until its health check passes again.

Context length (`context_length`)
    A chat reply without max_tokens may fill the model's context, so the gateway reserves its
    engine's `max_model_len` (from `/v1/models`). The --engine-url engine has no health checks
    to read it: its `/v1/models` is read when a request first needs it, and again once the
    answer is `CARDS_TTL_S` old (the engine may have restarted with another context length).

Choosing a replica (`choose`, or `pick` for the replica alone)
    Inside a model's group: the replica holding the request's leading text (prefix affinity),
    unless its load is clearly above the least loaded one (bounded load: more than
    `1.25 x least + 2`), else the least loaded. Each choice says why (`Choice.reason`, a label
    of the gateway's `portcullis_gateway_upstream_requests`): prefix_affinity, least_load,
    spill (the prefix's replica was too busy), round_robin, single (the group has one replica:
    every --engine-url gateway), only_healthy (one replica of several is up) or retry (another replica failed before any byte reached the client). A spilled request does not move the prefix: it
    stays with the replica that holds it. Load is, divided by the replica's weight: the
    larger of the gateway's own in-flight count on it (live) and the engine's running + waiting
    (scraped every `scrape_interval_s` from its `/metrics`, so it sees other gateway workers'
    traffic too), plus waiting again (queueing is what hurts TTFT) and 4 x KV-cache usage.

Why the gateway hashes the text prefix instead of asking the engines which blocks they hold
    Asking needs an engine API and a round trip (or a stream of cache events) per replica, and
    block hashes that depend on the tokenizer and block size; the answer is stale by the time
    the request lands anyway. Hashing the leading characters in fixed chunks costs a few
    microseconds, works with any engine, and, because the gateway itself sent the earlier
    requests there, "the replica this prefix last went to" is what holds those blocks (until
    evicted: the bounded-load rule and least-load for new prefixes keep the spread even). The
    tenant's cache salt is hashed in first, so one tenant's prefix never steers, or reveals
    anything about, another's. Each gateway worker keeps its own table: with several workers the
    same prefix may settle on up to one replica per worker, which still caps the misses.

Strategies (the policy's `upstream_strategy`)
    `prefix` (the default) is the rule above; `least_load` drops the affinity (least loaded,
    ties in turn); `round_robin` ignores load too. The last two exist to compare against
    (`benchmarks/fleet.py workload`) and for engines without a prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from portcullis.gateway.errors import Refusal
from portcullis.gateway.upstream.client import EngineClient

log = structlog.get_logger("gateway.fleet")

DEFAULT_NAME = "engine"  # the one upstream of --engine-url
CHUNK_CHARS = 256  # affinity is decided on whole chunks of the leading text
MAX_CHUNKS = 8  # so at most the first 2,048 characters are hashed
AFFINITY_ENTRIES = 65536  # prefix chunks remembered (LRU)
KV_WEIGHT = 4.0
SPILL_FACTOR, SPILL_SLACK = 1.25, 2.0
CARDS_TTL_S = 60.0  # how long an --engine-url engine's /v1/models answer is trusted
STRATEGIES = ("prefix", "least_load", "round_robin")
_GAUGE = re.compile(rb"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc"
                    rb"|vllm:prefix_cache_queries_total|vllm:prefix_cache_hits_total)"
                    rb"(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.M)


@dataclass(frozen=True)
class ReplicaConfig:
    name: str
    url: str
    token: str
    models: frozenset[str] | None  # None: every model (the --engine-url shorthand)
    weight: float = 1.0


class Replica:
    """One engine process: its client, what it serves, whether it is up and how busy it is."""

    def __init__(self, config: ReplicaConfig, read_timeout_s: float, checked: bool) -> None:
        self.config = config
        self.name = config.name
        self.client = EngineClient(config.url, config.token, read_timeout_s)
        self.checked = checked  # health-checked, ejectable and scraped (every replica of a policy's list)
        self.healthy = not checked  # a listed replica serves once its first check passes
        self.served: frozenset[str] | None = config.models  # the models it is used for
        self.cards: dict[str, dict[str, Any]] = {}  # its /v1/models entries, by id
        self.cards_read_at = -CARDS_TTL_S  # monotonic time an unchecked replica's cards were read
        self.reading_cards = asyncio.Lock()  # one /v1/models read at a time, however many requests wait
        self.failures = 0  # consecutive connection failures of forwarded requests
        self.in_flight = 0
        self.running = self.waiting = self.kv_usage = 0.0
        self.prefix_queries = self.prefix_hits = 0.0  # tokens, since the engine started (its counters)
        self.retired = False

    def serves(self, model: str | None) -> bool:
        return model is None or self.served is None or model in self.served

    def load(self) -> float:
        queue = max(float(self.in_flight), self.running + self.waiting)
        return (queue + self.waiting + KV_WEIGHT * self.kv_usage) / self.config.weight

    def begin(self) -> None:
        self.in_flight += 1

    def end(self, failed: bool, eject_after: int) -> None:
        self.in_flight -= 1
        if failed:
            self.failures += 1
            if self.checked and self.healthy and self.failures >= eject_after:
                self.healthy = False
                log.warning("upstream_ejected", upstream=self.name, failures=self.failures)
        else:
            self.failures = 0
        if self.retired and self.in_flight == 0:
            asyncio.get_running_loop().create_task(self.client.close())

    def read_gauges(self, text: bytes) -> None:
        found = {name: float(value) for name, value in _GAUGE.findall(text)}
        self.running = found.get(b"vllm:num_requests_running", 0.0)
        self.waiting = found.get(b"vllm:num_requests_waiting", 0.0)
        kv = found.get(b"vllm:kv_cache_usage_perc", 0.0)
        self.kv_usage = kv if kv == kv else 0.0  # NaN
        self.prefix_queries = found.get(b"vllm:prefix_cache_queries_total", 0.0)
        self.prefix_hits = found.get(b"vllm:prefix_cache_hits_total", 0.0)

    def adopt_models(self, cards: list[dict[str, Any]]) -> None:
        """Use this replica only for the listed models its engine really serves."""
        self.cards = {str(c.get("id")): c for c in cards if isinstance(c, dict)}
        wanted = self.config.models
        if wanted is None:
            return
        missing = sorted(wanted - self.cards.keys())
        if missing:
            log.error("upstream_models_mismatch", upstream=self.name, missing=missing,
                      serves=sorted(self.cards), hint="fix the policy's upstreams or the engine's "
                      "--served-model-name; this replica is not used for the missing models")
        self.served = frozenset(wanted & self.cards.keys())

    def context_length(self, model: str | None) -> int | None:
        """Its engine's `max_model_len` for `model` (for any model it serves when None), or None
        when its cards do not say."""
        return self._most(model, lambda card: card.get("max_model_len"))

    def prompt_chars(self, model: str | None) -> int | None:
        """The most characters of prompt text its engine can fit for `model`: its context times
        its longest token (`max_token_chars`), or None when its cards do not say."""
        return self._most(model, _prompt_chars)

    def _most(self, model: str | None, read: Callable[[dict], Any]) -> int | None:
        cards = list(self.cards.values()) if model is None else [self.cards.get(model)]
        values = [read(card) for card in cards if card]
        if not values or not all(_count(n) for n in values):
            return None
        return max(values)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _prompt_chars(card: dict) -> int | None:
    length, longest = card.get("max_model_len"), card.get("max_token_chars")
    return length * longest if _count(length) and _count(longest) else None


class Choice(NamedTuple):
    """The replica for one attempt (None: no healthy one serves the model) and why."""

    replica: Replica | None
    reason: str


def affinity_chain(text: str, salt: str | None) -> tuple[bytes, ...]:
    """Hashes of the leading text's whole chunks, each chained on the one before, salted first."""
    chunks = min(len(text) // CHUNK_CHARS, MAX_CHUNKS)
    chain, seed = [], (salt or "").encode()
    for i in range(chunks):
        seed = hashlib.blake2b(seed + text[i * CHUNK_CHARS:(i + 1) * CHUNK_CHARS].encode(), digest_size=12).digest()
        chain.append(seed)
    return tuple(chain)


def leading_text(payload: dict[str, Any]) -> str:
    """The first `CHUNK_CHARS x MAX_CHUNKS` characters of what the engine will render: chat
    messages (role and text) in order, or the (first) prompt."""
    limit = CHUNK_CHARS * MAX_CHUNKS
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts, size = [], 0
        for message in messages:
            if not isinstance(message, dict):
                break
            text = f"{message.get('role')}\n{_content_text(message.get('content'))}\n"
            parts.append(text)
            size += len(text)
            if size >= limit:
                break
        return "".join(parts)[:limit]
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else " ".join(map(str, prompt[:limit // 4]))
    return prompt[:limit] if isinstance(prompt, str) else ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


class Fleet:
    """The replicas now in force, by name, and the choice of one per request (see the module)."""

    def __init__(self, default: ReplicaConfig, read_timeout_s: float = 600.0, health_interval_s: float = 2.0,
                 scrape_interval_s: float = 0.5, eject_after: int = 3) -> None:
        self.default, self.read_timeout_s = default, read_timeout_s
        self.health_interval_s, self.scrape_interval_s = health_interval_s, scrape_interval_s
        self.eject_after = eject_after
        self.replicas: dict[str, Replica] = {}
        self.affinity: OrderedDict[bytes, str] = OrderedDict()
        self._tasks: list[asyncio.Task[None]] = []
        self._checking: set[str] = set()
        self._rereads: set[asyncio.Task[bool]] = set()  # held: the loop keeps only weak references
        self._turn = 0
        self.strategy = "prefix"

    # -- configuration ------------------------------------------------------------------

    def configure(self, rules: Sequence[Any], policy_path: Path, strategy: str = "prefix") -> None:
        """Apply the policy's `upstreams` (empty: the default engine) and `upstream_strategy`;
        replicas whose entry did not change are kept as they are, the others retired once their
        requests end."""
        if strategy not in STRATEGIES:
            raise ValueError(f"upstream_strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
        configs = [self._config(rule, policy_path) for rule in rules] or [self.default]
        checked = bool(rules)
        fresh: dict[str, Replica] = {}
        kept: list[Replica] = []
        for config in configs:
            old = self.replicas.get(config.name)
            if old is not None and old.checked == checked and _same_engine(old.config, config):
                old.config, old.served = config, _narrowed(config.models, old)
                fresh[config.name] = old
                kept.append(old)
            else:
                fresh[config.name] = Replica(config, self.read_timeout_s, checked)
        for name, old in self.replicas.items():
            if fresh.get(name) is not old:
                self._retire(old)
        self.replicas, self.strategy = fresh, strategy
        if checked and self._tasks:
            self._check_new()
            self._reread(kept)

    def _config(self, rule: Any, policy_path: Path) -> ReplicaConfig:
        token = self.default.token
        if rule.token_file:
            path = Path(rule.token_file)
            token = (path if path.is_absolute() else policy_path.parent / path).read_text().strip()
        return ReplicaConfig(rule.name, rule.url, token, frozenset(rule.models), rule.weight)

    def _retire(self, replica: Replica) -> None:
        replica.retired, replica.healthy = True, False
        if replica.in_flight == 0:
            with contextlib.suppress(RuntimeError):  # no loop: closed at shutdown instead
                asyncio.get_running_loop().create_task(replica.client.close())
        log.info("upstream_retired", upstream=replica.name, in_flight=replica.in_flight)

    @property
    def listed(self) -> bool:
        """True when the policy lists the upstreams (not the --engine-url shorthand)."""
        return any(r.checked for r in self.replicas.values())

    # -- routing ------------------------------------------------------------------------

    def knows(self, model: str | None) -> bool:
        """Whether some replica is configured for `model` (up or not)."""
        return any(r.serves(model) for r in self.replicas.values())

    def pick(self, model: str | None, chain: tuple[bytes, ...] = (), exclude: Sequence[Replica] = ()) -> Replica | None:
        """The replica for one request, or None when no healthy one serves `model`."""
        return self.choose(model, chain, exclude).replica

    def choose(self, model: str | None, chain: tuple[bytes, ...] = (), exclude: Sequence[Replica] = ()) -> Choice:
        """`pick`, and why: `exclude` holds the replicas a request already failed on (a retry)."""
        group = [r for r in self.replicas.values() if r.healthy and r.serves(model) and r not in exclude]
        if len(group) <= 1:
            configured = sum(1 for r in self.replicas.values() if r.serves(model))
            reason = "single" if configured == 1 else "only_healthy"  # no choice to make, or none left
            chosen, preferred = (group[0] if group else None), None
        else:
            preferred = self._preferred(group, chain) if self.strategy == "prefix" else None
            chosen, reason = self._balance(group, chain, preferred)
        # A spill leaves the prefix with its owner: the next request goes back once its load
        # eases, rather than the prefix bouncing between replicas and being cached on both.
        if chosen is not None and chain and self.strategy == "prefix" and preferred in (None, chosen):
            self._remember(chain, chosen.name)
        return Choice(chosen, "retry" if exclude else reason)

    def _balance(self, group: list[Replica], chain: tuple[bytes, ...], preferred: Replica | None) -> tuple[Replica, str]:
        self._turn += 1
        if self.strategy == "round_robin":
            return group[self._turn % len(group)], "round_robin"
        loads = [r.load() for r in group]
        least = min(loads)
        if preferred is not None:
            load = loads[group.index(preferred)]
            if load <= SPILL_FACTOR * least + SPILL_SLACK:
                return preferred, "prefix_affinity"
        tied = [r for r, load in zip(group, loads) if load == least]
        # Ties (an idle fleet) are split by the prefix, or in turn, so new prefixes spread out.
        spread = chain[0][0] if chain and self.strategy == "prefix" else self._turn
        return tied[spread % len(tied)], ("spill" if preferred is not None else "least_load")

    def _preferred(self, group: list[Replica], chain: tuple[bytes, ...]) -> Replica | None:
        """The replica the longest known prefix of this request last went to."""
        for key in reversed(chain):
            name = self.affinity.get(key)
            if name is not None:
                for replica in group:
                    if replica.name == name:
                        return replica
        return None

    def _remember(self, chain: tuple[bytes, ...], name: str) -> None:
        table = self.affinity
        for key in chain:
            table[key] = name
            table.move_to_end(key)
        while len(table) > AFFINITY_ENTRIES:
            table.popitem(last=False)

    def unavailable(self, model: str | None) -> Refusal:
        return Refusal(503, "No model server for this model is available right now; retry shortly.",
                       "engine_unavailable", headers={"retry-after": str(max(1, round(self.health_interval_s)))})

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of what the healthy replicas serve, one card per model (its real max_model_len)."""
        cards: dict[str, dict[str, Any]] = {}
        for replica in self.replicas.values():
            if not replica.healthy:
                continue
            for model in sorted(replica.served or ()):
                card = replica.cards.get(model) or {"id": model, "object": "model", "owned_by": "portcullis"}
                cards.setdefault(model, card)
        return list(cards.values())

    def healthy(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    async def context_length(self, model: str | None) -> int | None:
        """The longest context of the replicas that may serve `model` (those up, and those down
        whose cards are known), or None when one of them does not say (see the module)."""
        return await self._most(model, Replica.context_length)

    async def prompt_chars(self, model: str | None) -> int | None:
        """The most prompt characters any replica that may serve `model` can fit, as
        `context_length` reads its cards; None when one of them does not say."""
        return await self._most(model, Replica.prompt_chars)

    async def _most(self, model: str | None, read: Callable[[Replica, str | None], int | None]) -> int | None:
        most = None
        for replica in list(self.replicas.values()):
            if not replica.serves(model) or not (replica.healthy or replica.cards):
                continue
            if not replica.checked:
                await self._read_cards(replica)
            value = read(replica, model)
            if value is None:
                return None
            most = max(most or 0, value)
        return most

    async def _read_cards(self, replica: Replica) -> None:
        async with replica.reading_cards:
            if time.monotonic() - replica.cards_read_at >= CARDS_TTL_S and await self._discover(replica):
                replica.cards_read_at = time.monotonic()

    # -- background checks --------------------------------------------------------------

    async def start(self) -> None:
        """Check every listed replica once (so a gateway starts serving what is up), then keep checking."""
        if self.listed:
            await self.check_all()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._every(self.health_interval_s, self.check_all)),
                       loop.create_task(self._every(self.scrape_interval_s, self.scrape_all))]

    async def _every(self, seconds: float, step: Any) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await step()
            except Exception:  # a dead checker would freeze every replica's state
                log.exception("upstream_check_failed")

    def _reread(self, kept: list[Replica]) -> None:
        """Read a kept replica's models again: until the answer comes it serves as before (its
        old answer narrowed to the new list); one that is down is read when it comes back."""
        loop = asyncio.get_running_loop()
        for replica in kept:
            if replica.healthy:
                task = loop.create_task(self._discover(replica))
                self._rereads.add(task)
                task.add_done_callback(self._rereads.discard)

    def _check_new(self) -> None:
        loop = asyncio.get_running_loop()
        for replica in self.replicas.values():
            if replica.checked and not replica.healthy and replica.name not in self._checking:
                loop.create_task(self.check(replica))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in list(self.replicas.values()) if r.checked))

    async def check(self, replica: Replica) -> None:
        if replica.name in self._checking:
            return
        self._checking.add(replica.name)
        try:
            up = await replica.client.healthy()
            if up and not replica.healthy:
                up = await self._discover(replica)
            if replica.retired:
                return
            if up != replica.healthy:
                log.info("upstream_up" if up else "upstream_down", upstream=replica.name)
            replica.healthy = up
            if up:
                replica.failures = 0
        finally:
            self._checking.discard(replica.name)

    async def _discover(self, replica: Replica) -> bool:
        try:
            response = await replica.client.get("/v1/models")
            cards = response.json().get("data") if response.status_code == 200 else None
        except Exception:  # noqa: BLE001 - any failure: not ready to serve yet
            return False
        if not isinstance(cards, list):
            return False
        replica.adopt_models(cards)
        return True

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(r) for r in list(self.replicas.values()) if r.checked and r.healthy))

    async def _scrape(self, replica: Replica) -> None:
        try:
            response = await replica.client.get("/metrics", timeout=max(0.2, self.scrape_interval_s))
        except Exception:  # noqa: BLE001 - a missed scrape keeps the last values
            return
        if response.status_code == 200:
            replica.read_gauges(response.content)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for replica in self.replicas.values():
            await replica.client.close()


def _same_engine(a: ReplicaConfig, b: ReplicaConfig) -> bool:
    return (a.url, a.token) == (b.url, b.token)


def _narrowed(models: frozenset[str] | None, replica: Replica) -> frozenset[str] | None:
    """A kept replica's new model list, still narrowed by what its engine said it serves."""
    if models is None or not replica.cards:
        return models
    return frozenset(models & replica.cards.keys())
