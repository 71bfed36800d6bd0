"""`python -m portcullis.engine [MODEL] [flags]` (and `portcullis engine ...`, which runs exactly this).

Flags follow `vllm serve` where the meaning is the same, so a vLLM user can switch by changing
the program name. The engine listens on a Unix socket (mode 0600) by default, or on
`--host/--port`. Every route but `/health` needs the internal token, read from
PORTCULLIS_ENGINE_TOKEN or `--token-file`. Without a token the server refuses to start, except
on a Unix socket with `--no-token` (local development; the socket's mode is the only guard).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import structlog
from pydantic import SecretStr, ValidationError

from portcullis.engine.sampling_params import generation_config_defaults
from portcullis.engine.server.reasoning import REASONING_PARSERS
from portcullis.engine.server.settings import GenerationDefaults, ServerSettings
from portcullis.engine.server.tool_parsers import TOOL_PARSERS, parser_from_template
from portcullis.oplog import FORMATS, configure_logging
from portcullis.protocol.channel import DEFAULT_ENGINE_SOCKET, ENGINE_TOKEN_ENV
from portcullis.protocol.engine_flags import add_shared_flags

log = structlog.get_logger("engine")

DEFAULT_PORT = 8001  # not vLLM's 8000: that is the gateway's port, often on the same host
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def human_int(text: str) -> int:
    """`65536`, `64k`, `64Ki`, `2G`, `1.5GiB`: decimal suffixes are powers of 1000, `i` ones of 1024."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number like 4096, 4k or 2GiB")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    power = " kmgt".index(unit) if unit else 0
    return int(number * (1024 if binary else 1000) ** power)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="portcullis engine", allow_abbrev=False,  # `portcullis serve` reads some flags too, unabbreviated
        description="The Portcullis engine's private OpenAI-compatible server (flags as `vllm serve`).",
        epilog=(f"Listens on a Unix socket (mode 0600) unless --host/--port is given. Every route but "
                f"/health needs the internal token, from ${ENGINE_TOKEN_ENV} or --token-file; without one the "
                "server refuses to start, except with --no-token on a Unix socket (development)."),
    )
    p.add_argument("model", nargs="?", help="Hugging Face model directory or Hub id (default: the bundled demo model)")
    p.add_argument("--model", dest="model_flag", help=argparse.SUPPRESS)
    _channel_flags(p.add_argument_group("listening and access"))
    _engine_flags(p.add_argument_group("engine"))
    _server_flags(p.add_argument_group("server"))
    _reply_flags(p.add_argument_group("tool calls and reasoning"))
    return p


def _channel_flags(g) -> None:
    g.add_argument("--uds", type=Path, help=f"Unix socket path (default {DEFAULT_ENGINE_SOCKET} unless --host/--port)")
    g.add_argument("--host", help="listen on TCP at this address (default 127.0.0.1 with --port)")
    g.add_argument("--port", type=int, help=f"listen on TCP at this port (default {DEFAULT_PORT} with --host)")
    g.add_argument("--token-file", type=Path, help=f"file holding the internal token (else ${ENGINE_TOKEN_ENV})")
    g.add_argument("--api-key", help="the internal token on the command line, as vLLM (visible in ps: prefer --token-file)")
    g.add_argument("--no-token", action="store_true", help="serve a Unix socket without a token (development only)")


def _engine_flags(g) -> None:
    add_shared_flags(g)  # --served-model-name, --max-num-seqs: `portcullis serve` reads them too
    g.add_argument("--tokenizer", help="tokenizer directory or id (default: the model's)")
    g.add_argument("--dtype", default="auto", help="auto: the checkpoint's on GPUs; on CPUs bfloat16 where a "
                   "start-up probe finds it >= 1.3x faster than float32, else float32 (logged)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="dtype of the KV cache (auto: the model's)")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--max-model-len", type=human_int, help="context length, e.g. 4096 or 4k (default: the model's)")
    g.add_argument("--max-num-batched-tokens", type=human_int, default=2048, help="tokens per engine step")
    g.add_argument("--kv-cache-memory", type=human_int, help="KV-cache size in bytes, e.g. 2GiB (CPU default 2GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached prompt blocks")
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="shard the model over this many processes (Gloo on CPUs, NCCL on GPUs)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers into this many stages, one process (times -tp) each")
    _hosts_flags(g)
    g.add_argument("--speculative-config", help='speculative decoding, as vLLM: \'{"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\' or '
                   '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\' (a small model with '
                   'the same tokenizer; "model" without "method" means draft_model)')
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="waiting order: first come first served, or lowest `priority` value first (waiting ages a request)")
    g.add_argument("--runner", choices=("auto", "generate", "pooling"), default="auto",
                   help="generate text, or compute embeddings (pooling: /v1/embeddings); auto: pooling for a "
                        "checkpoint without an LM head")
    g.add_argument("--gguf-dequantize", action="store_true",
                   help="dequantize a GGUF's quantized weights to the dtype at load instead of running them as "
                        "stored on the CPU kernel (the reference path; also PORTCULLIS_GGUF_DEQUANTIZE=1)")
    g.add_argument("--gguf-activations", choices=("float32", "int8"), default="float32",
                   help="int8: round activations to int8 per block of 32 for integer products on the CPU kernel, as "
                        "llama.cpp does (Q8_0/Q4_0/Q4_1 weights): faster, answers differ a little from float32's "
                        "(also PORTCULLIS_GGUF_ACTIVATIONS)")
    g.add_argument("--generation-config", default="auto",
                   help="'auto': sampling defaults from the model's generation_config.json; 'vllm': none; or a folder")


def _hosts_flags(g) -> None:
    """Several hosts, as vLLM's multi-node flags: node 0 serves, the others run --headless."""
    g.add_argument("--nnodes", type=int, default=1, help="hosts the engine's processes split over (evenly)")
    g.add_argument("--node-rank", type=int, default=0, help="this host's place: 0 serves and schedules; others --headless")
    g.add_argument("--master-addr", default="127.0.0.1",
                   help="node 0's private address, where every process meets (refused if public)")
    g.add_argument("--master-port", type=int, help="node 0's rendezvous port (default: any free port on one host, "
                   "29501 with --nnodes > 1)")
    g.add_argument("--headless", action="store_true",
                   help="a node past the first: run this node's ranks only (no server); they rejoin the group "
                   "each time node 0 starts it")
    g.add_argument("--allow-public-master-addr", action="store_true",
                   help="let --master-addr be a public address (the processes' channel is unauthenticated)")
    g.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                   help="how the processes start: mp (one process per rank, started by each node); ray is not supported")


def _server_flags(g) -> None:
    g.add_argument("--max-waiting", type=int, default=1024, help="waiting requests beyond which new ones get 503")
    g.add_argument("--status-interval", type=float, default=10.0, help="seconds between status lines while busy")
    g.add_argument("--log-format", choices=FORMATS, default="json")
    g.add_argument("--uvicorn-log-level", default="warning")
    g.add_argument("--otlp-traces-endpoint", metavar="URL", help="send OpenTelemetry traces to this OTLP/HTTP "
                   "collector URL, e.g. http://otel-collector:4318/v1/traces (needs the otel extra)")


def _reply_flags(g) -> None:
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                   help="the format of the model's tool calls (default with --enable-auto-tool-choice: the chat template's)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='read tool calls from replies when tool_choice is "auto" (or not given)')
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="split <think>...</think> off replies into reasoning_content")
    g.add_argument("--structured-outputs-config", type=_structured_outputs_config, default={},
                   help='JSON, as vLLM: {"enable_in_reasoning": true} constrains the reasoning too')


def _structured_outputs_config(text: str) -> dict:
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(config, dict) or not set(config) <= {"enable_in_reasoning", "backend"} \
            or config.get("backend", "xgrammar") not in ("auto", "xgrammar"):
        raise argparse.ArgumentTypeError('takes {"enable_in_reasoning": true|false} (and "backend": "xgrammar")')
    return config


class UsageError(Exception):
    pass


def read_token(args: argparse.Namespace) -> SecretStr | None:
    if args.token_file is not None:
        try:
            return SecretStr(args.token_file.read_text().strip())
        except OSError as exc:
            raise UsageError(f"cannot read --token-file {args.token_file}: {exc.strerror}") from exc
    token = args.api_key or os.environ.get(ENGINE_TOKEN_ENV)
    return SecretStr(token) if token else None


def generation_defaults(choice: str, model_path: Path) -> GenerationDefaults:
    """Sampling defaults from generation_config.json, as vLLM's --generation-config does."""
    try:
        fields = generation_config_defaults(choice, model_path)
    except FileNotFoundError as exc:
        raise UsageError(f"--generation-config {choice}: no generation_config.json there") from exc
    try:
        return GenerationDefaults(**fields)
    except ValidationError as exc:
        names = ", ".join(str(e["loc"][0]) for e in exc.errors())
        file = (model_path if choice == "auto" else Path(choice)) / "generation_config.json"
        raise UsageError(f"{file}: sampling defaults out of range ({names}); fix the file or pass "
                         "--generation-config vllm") from exc


def server_settings(args: argparse.Namespace, served_names: list[str], generation: GenerationDefaults) -> ServerSettings:
    tcp = args.host is not None or args.port is not None
    if tcp and args.uds is not None:
        raise UsageError("give either --uds or --host/--port, not both")
    if args.no_token and tcp:
        raise UsageError("--no-token is only allowed on a Unix socket")
    try:
        return ServerSettings(
            served_model_names=served_names, token=read_token(args), allow_no_token=args.no_token,
            uds=None if tcp else (args.uds or DEFAULT_ENGINE_SOCKET),
            host=(args.host or "127.0.0.1") if tcp else None,
            port=(args.port if args.port is not None else DEFAULT_PORT) if tcp else None,
            max_waiting=args.max_waiting, status_interval_s=args.status_interval, generation=generation,
            tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
            structured_outputs_in_reasoning=bool(args.structured_outputs_config.get("enable_in_reasoning")),
        )
    except ValidationError as exc:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise UsageError(problems) from exc


def tool_call_parser_default(settings: ServerSettings, tokenizer_dir) -> ServerSettings:
    """With --enable-auto-tool-choice but no --tool-call-parser, the format the chat template asks for."""
    if not settings.enable_auto_tool_choice:
        if settings.tool_call_parser:
            log.warning("--tool-call-parser has no effect without --enable-auto-tool-choice (as in vLLM)")
        return settings
    if settings.tool_call_parser:
        return settings
    from transformers import AutoTokenizer

    name = parser_from_template(AutoTokenizer.from_pretrained(tokenizer_dir).chat_template)
    if name is None:
        raise UsageError("--enable-auto-tool-choice needs --tool-call-parser: the chat template names several "
                         "tool-call formats (hermes, llama3_json, mistral); say which")
    log.info("tool-call parser picked from the chat template", tool_call_parser=name)
    return settings.model_copy(update={"tool_call_parser": name})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except UsageError as exc:
        print(f"engine: {exc}", file=sys.stderr)
        return 2


def resolve_model(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The model to load and the names to serve it under: with no MODEL, the bundled demo
    model, served as "demo"; otherwise MODEL as given, as vLLM names it."""
    from portcullis.engine.assets import DEMO_MODEL_DIR

    model = args.model or args.model_flag
    served = args.served_model_name or [model or "demo"]
    return model or str(DEMO_MODEL_DIR), served


def _run(args: argparse.Namespace) -> int:
    model, served = resolve_model(args)
    if args.distributed_executor_backend == "ray":
        raise UsageError("--distributed-executor-backend ray is not supported: use mp (the default), with "
                         "--nnodes/--node-rank/--master-addr and --headless on the other nodes")
    if args.headless:
        return _run_headless(args, model, served[0])
    if args.node_rank != 0:
        raise UsageError("a node past the first runs --headless; node 0 serves")
    # Settings first: a refused channel or token fails in milliseconds, not after loading a model.
    settings = server_settings(args, served, GenerationDefaults())
    configure_logging(args.log_format, force=True)
    config = _engine_config(args, model, served[0])
    settings = settings.model_copy(update={"generation": generation_defaults(args.generation_config, config.model_path)})
    settings = tool_call_parser_default(settings, config.tokenizer or config.model_path)
    return _serve(args, config, settings)


def _run_headless(args: argparse.Namespace, model: str, served_name: str) -> int:
    """This node's ranks only: no server, so no channel or token of its own."""
    from portcullis.engine.worker.tp_worker import run_headless

    configure_logging(args.log_format, force=True)
    if args.nnodes < 2 or args.node_rank < 1:
        raise UsageError("--headless is for the nodes past the first: give --nnodes N (N > 1) and --node-rank 1..N-1")
    return run_headless(_engine_config(args, model, served_name))


def _engine_config(args: argparse.Namespace, model: str, served_name: str):
    from portcullis.engine.config import EngineConfig

    try:
        return EngineConfig(
            model=model, tokenizer=args.tokenizer, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
            seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size, device=args.device,
            nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port if args.master_port is not None else (29501 if args.nnodes > 1 else 0),
            allow_public_master_addr=args.allow_public_master_addr,
            served_model_name=served_name, runner=args.runner, scheduling_policy=args.scheduling_policy,
            speculative_config=args.speculative_config, gguf_dequantize=args.gguf_dequantize,
            gguf_activations=args.gguf_activations,
        )
    except (ValueError, OSError) as exc:
        raise UsageError(f"cannot load model {model!r}: {exc}") from exc


def _tracer(endpoint: str):
    from portcullis.engine.server.app import otlp_tracer

    try:
        return otlp_tracer(endpoint)
    except ImportError as exc:
        raise UsageError("--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'portcullis-llm[otel]'") from exc


def _serve(args: argparse.Namespace, config, settings: ServerSettings) -> int:
    from portcullis.engine.core.engine_core import EngineCore
    from portcullis.engine.server.app import create_app
    from portcullis.engine.server.run import ListenError, bind_tcp_socket, bind_unix_socket, serve

    tracer = _tracer(args.otlp_traces_endpoint) if args.otlp_traces_endpoint else None
    core = EngineCore(config)
    app = create_app(core, settings, tracer=tracer)
    try:
        sock = bind_unix_socket(settings.uds) if settings.uds else bind_tcp_socket(settings.host, settings.port)
    except ListenError as exc:
        raise UsageError(str(exc)) from exc
    where = f"unix:{settings.uds}" if settings.uds else f"http://{settings.host}:{sock.getsockname()[1]}"
    log.info("engine ready", listen=where, model=settings.served_model_names, max_model_len=config.max_model_len,
             kv_cache_blocks=core.info.num_kv_blocks, auth="token" if settings.token else "none")
    engine = app.state.server.engine
    serve(app, sock, args.uvicorn_log_level, engine=engine)
    if engine.failure is not None:
        log.error("exiting: the engine stopped on an internal error (see above); a supervisor may restart it")
        return 1
    return 0
