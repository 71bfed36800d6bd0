"""A run's metrics under `vllm bench serve`'s names and definitions, and its result table.

TTFT: request sent to first token chunk. TPOT: (E2EL - TTFT) / (output tokens - 1), for
requests of more than one token. ITL: every gap between token chunks. E2EL: sent to last
token. Goodput: completed requests per second that met every --goodput bound.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from portcullis.bench.client import RequestResult
from portcullis.bench.errors import BenchError

LATENCIES = {  # key -> (short name, section title)
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
WIDTH = 50


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`ttft:500,tpot:50` or vLLM's `ttft:500 tpot:50`: milliseconds per metric."""
    bounds: dict[str, float] = {}
    for pair in (p for item in items or () for p in item.split(",") if p.strip()):
        name, _, value = pair.partition(":")
        try:
            bounds[name.strip()] = float(value)
        except ValueError:
            raise BenchError(f"--goodput {pair!r}: write METRIC:MILLISECONDS, e.g. ttft:500,tpot:50") from None
        if name.strip() not in GOODPUT_METRICS or bounds[name.strip()] < 0:
            raise BenchError(f"--goodput {pair!r}: the metric is one of {', '.join(GOODPUT_METRICS)} "
                             "and the bound a non-negative number of milliseconds")
    return bounds


def tpot(result: RequestResult) -> float:
    """0 for a one-token reply: counted as meeting any TPOT bound, as vLLM does."""
    tokens = result.output_tokens or 0
    return (result.latency - result.ttft) / (tokens - 1) if tokens > 1 else 0.0


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float],
              percentiles: Sequence[float]) -> dict[str, Any]:
    done = [r for r in results if r.success]
    inputs = sum(r.prompt_len for r in done)
    outputs = sum(r.output_tokens or 0 for r in done)
    samples = {"ttft": [r.ttft for r in done], "tpot": [tpot(r) for r in done if (r.output_tokens or 0) > 1],
               "itl": [gap for r in done for gap in r.itl], "e2el": [r.latency for r in done]}
    summary: dict[str, Any] = {
        "duration": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(done) / duration,
        "request_goodput": _good(done, goodput) / duration if goodput else None,
        "output_throughput": outputs / duration, "total_token_throughput": (inputs + outputs) / duration,
        **_peaks(done),
    }
    for key, values in samples.items():
        ms = np.array(values or [0.0]) * 1000
        summary.update({f"mean_{key}_ms": float(ms.mean()), f"median_{key}_ms": float(np.median(ms)),
                        f"std_{key}_ms": float(ms.std())})
        summary.update({f"p{_word(p)}_{key}_ms": float(np.percentile(ms, p)) for p in percentiles})
    return summary


def _good(done: list[RequestResult], bounds: dict[str, float]) -> int:
    def value(r: RequestResult, key: str) -> float:
        return {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.latency}[key]

    return sum(all(value(r, key) * 1000 <= limit for key, limit in bounds.items()) for r in done)


def _peaks(done: list[RequestResult]) -> dict[str, float]:
    """The busiest second's token chunks and the most requests in flight at once (vLLM's
    max_output_tokens_per_s and max_concurrent_requests)."""
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start_time for r in done)
    seconds = np.concatenate([token_times(r) - t0 for r in done]).astype(int)
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency, -1) for r in done])
    in_flight = np.cumsum([delta for _, delta in events])
    return {"max_output_tokens_per_s": float(np.bincount(seconds).max()),
            "max_concurrent_requests": int(in_flight.max())}


def token_times(result: RequestResult) -> np.ndarray:
    """When each token chunk arrived, on the perf_counter clock."""
    return result.start_time + result.ttft + np.cumsum([0.0, *result.itl])


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def error_counts(results: list[RequestResult]) -> list[tuple[str, int]]:
    return Counter(r.error for r in results if not r.success).most_common()


def table(summary: dict[str, Any], rate: float, max_concurrency: int | None, percentiles: Sequence[float],
          errors: list[tuple[str, int]]) -> str:
    """The result as `vllm bench serve` prints it, plus the failures grouped by message."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if rate != float("inf"):
        row("Request rate configured (RPS):", rate)
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if summary["request_goodput"] is not None:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"])
    row("Peak concurrent requests:", summary["max_concurrent_requests"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for key, (name, title) in LATENCIES.items():
        lines.append(title.center(WIDTH, "-"))
        row(f"Mean {name} (ms):", summary[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", summary[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{_word(p)} {name} (ms):", summary[f"p{_word(p)}_{key}_ms"])
    if errors:
        lines.append(" Failed requests by error ".center(WIDTH, "-"))
        lines += [f"{count:>6} x {message}" for message, count in errors[:10]]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def sweep_table(runs: list[tuple[float, dict[str, Any]]]) -> str:
    """One line per request rate: how latency grows with load."""
    head = (f"{'rate (req/s)':>12} {'req/s':>8} {'out tok/s':>10} {'TTFT med':>9} {'TTFT p99':>9} "
            f"{'TPOT med':>9} {'ITL p99':>9} {'E2EL med':>9} {'failed':>6}")
    lines = [head, "-" * len(head)]
    for rate, s in runs:
        lines.append(f"{rate:>12g} {s['request_throughput']:>8.2f} {s['output_throughput']:>10.1f} "
                     f"{s['median_ttft_ms']:>9.1f} {s.get('p99_ttft_ms', float('nan')):>9.1f} "
                     f"{s['median_tpot_ms']:>9.1f} {s.get('p99_itl_ms', float('nan')):>9.1f} "
                     f"{s['median_e2el_ms']:>9.1f} {s['failed']:>6}")
    return "\n".join(lines) + "\n(latencies in ms)"
