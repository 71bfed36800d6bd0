"""Real engine servers for the tests: uvicorn on a real Unix socket (or TCP port) in a
background thread, a real EngineCore on a small random-weight checkpoint, and the official
`openai` client talking to it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from portcullis.engine import LLM
from portcullis.engine.assets import DEMO_MODEL_DIR
from portcullis.engine.config import EngineConfig
from portcullis.engine.core.engine_core import EngineCore
from portcullis.engine.server import ServerSettings, create_app
from portcullis.engine.server.run import ServerThread, bind_tcp_socket, bind_unix_socket
from portcullis.engine.server.state import ServerState

TOKEN = "test-internal-token"
MODEL_NAME = "tiny-llama"
ENGINE_DEFAULTS = dict(max_model_len=512, kv_cache_memory=64 << 20, seed=0)


@dataclass
class RunningServer:
    core: EngineCore
    state: ServerState
    thread: ServerThread
    uds: Path | None = None
    port: int | None = None

    @property
    def base_url(self) -> str:
        return "http://engine" if self.uds else f"http://127.0.0.1:{self.port}"

    def transport(self) -> httpx.HTTPTransport:
        return httpx.HTTPTransport(uds=str(self.uds)) if self.uds else httpx.HTTPTransport()

    def http(self, token: str | None = TOKEN, **kw) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        kw.setdefault("timeout", 60)
        return httpx.Client(transport=self.transport(), base_url=self.base_url, headers=headers, **kw)

    def client(self, token: str = TOKEN) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=token, max_retries=0,
                             http_client=httpx.Client(transport=self.transport(), timeout=60))

    def async_client(self, token: str = TOKEN) -> openai.AsyncOpenAI:
        transport = httpx.AsyncHTTPTransport(uds=str(self.uds)) if self.uds else httpx.AsyncHTTPTransport()
        limits = httpx.Limits(max_connections=200)
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=token, max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport, timeout=120, limits=limits))

    def stop(self) -> None:
        self.thread.stop()


def start_server(model: Path, sock_dir: Path, *, tcp: bool = False, engine: dict | None = None,
                 name: str = MODEL_NAME, **settings) -> RunningServer:
    core = EngineCore(EngineConfig(model=str(model), served_model_name=name, **{**ENGINE_DEFAULTS, **(engine or {})}))
    settings = {"served_model_names": [name], "token": TOKEN, **settings}
    if tcp:
        settings["port"] = 0
    app = create_app(core, ServerSettings(**settings))
    uds = sock_dir / "engine.sock"
    sock = bind_tcp_socket("127.0.0.1", 0) if tcp else bind_unix_socket(uds)
    thread = ServerThread(app, sock).start()
    return RunningServer(core, app.state.server, thread, None if tcp else uds, sock.getsockname()[1] if tcp else None)


@pytest.fixture(scope="session")
def server_model(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def server(server_model, tmp_path_factory) -> RunningServer:
    """The shared server most tests talk to."""
    running = start_server(server_model, tmp_path_factory.mktemp("engine"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def agent_server(server_model, tmp_path_factory) -> RunningServer:
    """As `portcullis serve` runs an engine for agents: automatic tool choice (the generic format:
    this template has no tool syntax) and the model's whole context, as tools described in the
    prompt take room (nested schemas: 900 tokens of this toy vocabulary)."""
    running = start_server(server_model, tmp_path_factory.mktemp("agents"), engine={"max_model_len": 2048},
                           tool_call_parser="generic", enable_auto_tool_choice=True)
    yield running
    running.stop()


@pytest.fixture
def server_factory(server_model, tmp_path_factory):
    """`server_factory(tcp=..., engine={...}, **settings)`: a dedicated server, stopped after the test."""
    started: list[RunningServer] = []

    def make(**kw) -> RunningServer:
        started.append(start_server(server_model, tmp_path_factory.mktemp("engine"), **kw))
        return started[-1]

    yield make
    for s in started:
        with contextlib.suppress(Exception):
            s.stop()


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory) -> RunningServer:
    """The bundled demo model, served as "demo" (its weights must exist)."""
    running = start_server(DEMO_MODEL_DIR, tmp_path_factory.mktemp("demo"), name="demo")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def offline(server_model) -> LLM:
    """The offline API on the same checkpoint and settings: the reference for server output."""
    return LLM(str(server_model), **ENGINE_DEFAULTS)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return server.client()


QWEN_FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


@pytest.fixture(scope="session")
def fim_model(tmp_path_factory) -> Path:
    """A random-weight qwen2 checkpoint whose tokenizer (and embedding) has Qwen2.5-Coder's FIM tokens."""
    from transformers import AutoTokenizer

    from tests.conftest import build_checkpoint

    out = build_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2-fim-ckpt"), vocab_size=4096 + len(QWEN_FIM_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens(list(QWEN_FIM_TOKENS), special_tokens=True)
    tokenizer.save_pretrained(out)
    return out
