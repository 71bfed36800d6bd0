"""`portcullis bench serve`: load a running OpenAI-compatible server (the gateway with an API
key, or an engine) as `vllm bench serve` does, once per request rate, and report the metrics
as a table, a JSON result and, with --plot, PNGs."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from portcullis import envs
from portcullis.bench import datasets
from portcullis.bench.client import CHAT, COMPLETIONS, ENDPOINTS, RequestPlan, RequestResult, send
from portcullis.bench.errors import BenchError
from portcullis.bench.metrics import error_counts, parse_goodput, summarize, sweep_table, table
from portcullis.bench.plots import Run, require_matplotlib, write_plots

DATASETS = ("random", "sharegpt", "prefix-repetition")
READ_TIMEOUT_S = 600.0  # one silent gap this long in a stream fails the request

EPILOG = """\
examples:
  portcullis bench serve --api-key ptc_... --num-prompts 200 --random-input-len 256 --random-output-len 64
  portcullis bench serve --api-key ptc_... --request-rate 1,2,4 --max-concurrency 64 --save-result --plot
  portcullis bench serve --base-url http://gw:8000 --model qwen --tokenizer ./Qwen2.5-0.5B \\
      --endpoint /v1/chat/completions --dataset-name sharegpt --dataset-path sharegpt.json

Flags and metrics follow `vllm bench serve`. The tokenizer builds the prompts: the demo
model's own when the model is "demo", else --tokenizer (a local folder) or the model name.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("server")
    where.add_argument("--base-url", help="the server's root URL (default http://HOST:PORT)")
    where.add_argument("--host", default="127.0.0.1")
    where.add_argument("--port", type=int, default=8000)
    where.add_argument("--endpoint", default=COMPLETIONS, choices=ENDPOINTS)
    where.add_argument("--model", help="model name in the API (default: the first the server lists)")
    where.add_argument("--api-key", default=envs.OPENAI_API_KEY.get() or None,
                       help="sent as a bearer token, e.g. the key `portcullis serve` printed (default $OPENAI_API_KEY)")
    where.add_argument("--tokenizer", help="local tokenizer or model folder (default: the demo model's for "
                       "the model 'demo', else the model name)")
    data = p.add_argument_group("workload")
    data.add_argument("--dataset-name", default="random", choices=(*DATASETS, "prefix_repetition"))
    data.add_argument("--dataset-path", help="a ShareGPT-format JSON file (--dataset-name sharegpt)")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (exact)")
    data.add_argument("--random-output-len", type=int, default=128, help="output tokens (sent with ignore_eos)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    data.add_argument("--random-prefix-len", type=int, default=0, help="tokens of one prefix all prompts share")
    data.add_argument("--sharegpt-output-len", type=int, help="output tokens (default: the reply's length)")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--seed", type=int, default=0)
    traffic = p.add_argument_group("traffic")
    traffic.add_argument("--request-rate", default="inf", help="requests/s, Poisson arrivals; 'inf' sends all at "
                         "once; a list such as 1,2,4 runs a sweep, one run per rate (default inf)")
    traffic.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    traffic.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    traffic.add_argument("--ignore-eos", action="store_true", help="generate every output token (always on "
                         "for the random dataset)")
    traffic.add_argument("--temperature", type=float, help="default: the server's")
    traffic.add_argument("--extra-body", type=json.loads, help='JSON merged into each request, e.g. \'{"top_k": 1}\'')
    traffic.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-")
    report = p.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                        help="bounds for goodput, e.g. ttft:500,tpot:50 (ttft, tpot, e2el in ms)")
    report.add_argument("--metric-percentiles", default="90,99", help="percentiles to report (default 90,99)")
    report.add_argument("--save-result", action="store_true", help="write the result JSON (one per rate)")
    report.add_argument("--save-detailed", action="store_true", help="add per-request lists to the JSON")
    report.add_argument("--result-dir", default=".", help="where JSON and PNG files go (default .)")
    report.add_argument("--result-filename", help="JSON file name (a sweep adds -RATEqps)")
    report.add_argument("--label", default="portcullis", help="file name prefix (default portcullis)")
    report.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="recorded in the JSON")
    report.add_argument("--plot", action="store_true", help="write PNGs: latency distributions, throughput "
                        "over time, latency against load for a sweep (needs portcullis-llm[bench])")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    rates, percentiles = _rates(args.request_rate), _percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError("--max-concurrency must be at least 1")
    if args.num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    metadata = _metadata(args.metadata)
    if args.plot:
        require_matplotlib()
    base = _base_url(args)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = _check_server(base, headers, args.model)
    tokenizer, tokenizer_id = datasets.load_tokenizer(args.tokenizer, model)
    requests = _requests(args, tokenizer)
    plan = RequestPlan(base + args.endpoint, args.endpoint, model, headers,
                       ignore_eos=args.ignore_eos or args.dataset_name == "random",
                       extra_body=_extra_body(args))
    print(f"{len(requests)} prompts ({args.dataset_name}) to {plan.url}, model {model}, tokenizer {tokenizer_id}")
    runs = []
    for rate in rates:
        results, duration = asyncio.run(_benchmark(plan, requests, rate, args))
        _count_missing_tokens(results, tokenizer)
        runs.append(Run(rate, results, summarize(results, duration, goodput, percentiles)))
        print(table(runs[-1].summary, rate, args.max_concurrency, percentiles, error_counts(results)))
    if len(runs) > 1:
        print(sweep_table([(r.rate, r.summary) for r in runs]))
    _save(runs, args, {"model_id": model, "tokenizer_id": tokenizer_id, **metadata})
    if not any(run.summary["completed"] for run in runs):
        print("portcullis bench: every request failed (see the errors above)", file=sys.stderr)
        return 1
    return 0


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise BenchError(f"--request-rate {text!r}: give requests per second, 'inf', or a list like 1,2,4") from None
    if any(not rate > 0 for rate in rates):
        raise BenchError("--request-rate must be positive (or inf)")
    return rates


def _metadata(items: list[str] | None) -> dict[str, str]:
    pairs = [item.partition("=") for item in items or ()]
    if bad := [key for key, sep, _ in pairs if not sep]:
        raise BenchError(f"--metadata {bad[0]!r}: write KEY=VALUE")
    return {key.strip(): value.strip() for key, _, value in pairs}


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 0 < v <= 100 for v in values):
        raise BenchError(f"--metric-percentiles {text!r}: give percentiles in (0, 100], e.g. 90,99")
    return values


def _base_url(args: argparse.Namespace) -> str:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    # The OpenAI SDK's base_url ends in /v1; the endpoint already has it.
    return base.removesuffix("/v1")


def _check_server(base: str, headers: dict[str, str], model: str | None) -> str:
    """Fail fast, in one line, when the server is unreachable or refuses the key; the model
    to use (the first listed when --model is not given)."""
    try:
        response = httpx.get(f"{base}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {base} ({type(exc).__name__}: {exc or 'no answer'}); is the server "
                         "running? `portcullis serve` listens on http://127.0.0.1:8000") from None
    if response.status_code in (401, 403):
        raise BenchError(f"{base} refused the API key (HTTP {response.status_code}); pass --api-key, "
                         "e.g. the key `portcullis serve` printed")
    served = []
    if response.status_code == 200:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            served = [m["id"] for m in response.json()["data"]]
    if model:
        if served and model not in served:
            raise BenchError(f"{base} does not serve model {model!r}; it serves: {', '.join(served)}")
        return model
    if not served:
        raise BenchError(f"could not list the models of {base} (HTTP {response.status_code}); pass --model")
    return served[0]


def _requests(args: argparse.Namespace, tokenizer: Any) -> list[datasets.SampleRequest]:
    name = args.dataset_name.replace("_", "-")
    if name == "random":
        return datasets.random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                        args.random_range_ratio, args.random_prefix_len, args.seed)
    if name == "sharegpt":
        return datasets.sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len,
                                          args.seed)
    return datasets.prefix_repetition_requests(
        tokenizer, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
        args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.seed)


def _extra_body(args: argparse.Namespace) -> dict[str, Any]:
    body = {} if args.temperature is None else {"temperature": args.temperature}
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise BenchError("--extra-body must be a JSON object")
    return {**body, **(args.extra_body or {})}


def arrival_offsets(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start at which each request is sent: gamma-distributed gaps (Poisson
    for burstiness 1), scaled as vLLM does so the last one is sent at count / rate."""
    if math.isinf(rate):
        return np.zeros(count)
    times = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count))
    return times * (count / rate) / times[-1]


async def _benchmark(plan: RequestPlan, requests: list[datasets.SampleRequest], rate: float,
                     args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    offsets = arrival_offsets(len(requests), rate, args.burstiness, np.random.default_rng(args.seed))
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    # httpx caps a pool at 100 connections by default, which would cap concurrency unseen.
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=30.0, pool=None)
    label = "rate inf" if math.isinf(rate) else f"rate {rate:g}/s"
    with tqdm(total=len(requests), desc=label, disable=args.disable_tqdm) as progress:
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            start = time.perf_counter()

            async def one(i: int) -> RequestResult:
                await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
                async with gate:
                    result = await send(client, plan, requests[i], f"{args.request_id_prefix}{i}")
                progress.update(1)
                return result

            results = await asyncio.gather(*(one(i) for i in range(len(requests))))
            return list(results), time.perf_counter() - start


def _count_missing_tokens(results: list[RequestResult], tokenizer: Any) -> None:
    """A server that sent no usage: count the text's tokens, as vLLM does."""
    for r in results:
        if r.success and r.output_tokens is None:
            r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False))


def _save(runs: list[Run], args: argparse.Namespace, setup: dict[str, str]) -> None:
    """One JSON per rate (--save-result) and the PNGs (--plot), in --result-dir."""
    if not (args.save_result or args.plot):
        return
    folder = Path(args.result_dir)
    folder.mkdir(parents=True, exist_ok=True)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    model_tag = setup["model_id"].split("/")[-1]
    for run in runs if args.save_result else ():
        path = folder / _result_name(args, run.rate, model_tag, date, sweep=len(runs) > 1)
        path.write_text(json.dumps(_result_json(run, args, setup, date), indent=2) + "\n")
        print(f"saved {path}")
    if args.plot:
        stem = Path(args.result_filename).stem if args.result_filename else f"{args.label}-{model_tag}-{date}"
        for path in write_plots(runs, folder / stem):
            print(f"plotted {path}")


def _result_name(args: argparse.Namespace, rate: float, model_tag: str, date: str, sweep: bool) -> str:
    if args.result_filename:
        name = Path(args.result_filename)
        return f"{name.stem}-{rate:g}qps{name.suffix}" if sweep else name.name
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    return f"{args.label}-{rate:g}qps{concurrency}-{model_tag}-{date}.json"


def _result_json(run: Run, args: argparse.Namespace, setup: dict[str, str], date: str) -> dict[str, Any]:
    """vLLM's saved result: set-up, then the metrics, then (--save-detailed) per-request lists."""
    backend = "openai-chat" if args.endpoint == CHAT else "openai"
    result: dict[str, Any] = {"date": date, "endpoint_type": backend, "backend": backend, "label": args.label,
                              "num_prompts": args.num_prompts, "dataset_name": args.dataset_name, **setup}
    result.update(request_rate="inf" if math.isinf(run.rate) else run.rate, burstiness=args.burstiness,
                  max_concurrency=args.max_concurrency, **run.summary)
    if args.save_detailed:
        rs = run.results
        result.update(input_lens=[r.prompt_len for r in rs], output_lens=[r.output_tokens or 0 for r in rs],
                      ttfts=[r.ttft for r in rs], itls=[r.itl for r in rs], latencies=[r.latency for r in rs],
                      start_times=[r.start_time for r in rs], generated_texts=[r.generated_text for r in rs],
                      errors=[r.error for r in rs])
    return result
