"""PNG plots of a run or a request-rate sweep, with matplotlib (the `bench` extra): latency
distributions, throughput and requests in flight over time, and latency against load."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from portcullis.bench.client import RequestResult
from portcullis.bench.errors import BenchError
from portcullis.bench.metrics import LATENCIES, token_times, tpot

INSTALL_HINT = "--plot needs matplotlib: pip install 'portcullis-llm[bench]'"
BUCKETS = 40  # time buckets across the longest run


@dataclass
class Run:
    rate: float
    results: list[RequestResult]
    summary: dict[str, Any]

    @property
    def label(self) -> str:
        return "rate inf" if self.rate == float("inf") else f"rate {self.rate:g}/s"


def require_matplotlib() -> None:
    """Checked before the benchmark runs, so a missing extra costs no benchmark time."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError(INSTALL_HINT) from None


def write_plots(runs: list[Run], stem: Path) -> list[Path]:
    paths = [_latency(runs, stem.with_name(stem.name + "-latency.png")),
             _over_time(runs, stem.with_name(stem.name + "-throughput.png"))]
    if len(runs) > 1:
        paths.append(_against_load(runs, stem.with_name(stem.name + "-ttft-vs-load.png")))
    return paths


def _figure(rows: int, cols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    fig = Figure(figsize=size, layout="constrained")
    return fig, np.atleast_1d(fig.subplots(rows, cols)).ravel()


def _samples_ms(run: Run, key: str) -> np.ndarray:
    done = [r for r in run.results if r.success]
    values = {"ttft": [r.ttft for r in done], "tpot": [tpot(r) for r in done if (r.output_tokens or 0) > 1],
              "itl": [g for r in done for g in r.itl], "e2el": [r.latency for r in done]}[key]
    return np.array(values) * 1000


def _latency(runs: list[Run], path: Path) -> Path:
    fig, axes = _figure(2, 2, (11, 7.5))
    for ax, (key, (name, title)) in zip(axes, LATENCIES.items()):
        for run in runs:
            values = _samples_ms(run, key)
            if len(values):
                ax.hist(values, bins=30, histtype="step", linewidth=1.5, label=run.label)
        ax.set(title=title, xlabel=f"{name} (ms)", ylabel="count" if key != "itl" else "token gaps")
        ax.legend(fontsize="small")
    fig.suptitle("Latency distributions")
    fig.savefig(path, dpi=110)
    return path


def _over_time(runs: list[Run], path: Path) -> Path:
    fig, (tokens, flight) = _figure(2, 1, (10, 7))
    longest = max(run.summary["duration"] for run in runs)
    width = max(longest / BUCKETS, 0.05)
    for run in runs:
        done = [r for r in run.results if r.success]
        if not done:
            continue
        t0 = min(r.start_time for r in run.results)
        edges = np.arange(0, run.summary["duration"] + width, width)
        counts, _ = np.histogram(np.concatenate([token_times(r) - t0 for r in done]), bins=edges)
        tokens.plot(edges[:-1] + width / 2, counts / width, label=run.label)
        events = sorted([(r.start_time - t0, 1) for r in done] + [(r.start_time + r.latency - t0, -1) for r in done])
        flight.step([0.0] + [t for t, _ in events], np.cumsum([0] + [d for _, d in events]),
                    where="post", label=run.label)
    tokens.set(title="Output throughput over time (token chunks per second)", xlabel="time (s)", ylabel="tokens/s")
    flight.set(title="Requests in flight", xlabel="time (s)", ylabel="requests")
    for ax in (tokens, flight):
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def _against_load(runs: list[Run], path: Path) -> Path:
    """Achieved request throughput on x, as an `inf` rate has no configured value to plot."""
    fig, (ttft, tpot_ax) = _figure(1, 2, (11, 4.5))
    x = [run.summary["request_throughput"] for run in runs]
    for ax, key, name in ((ttft, "ttft", "TTFT"), (tpot_ax, "tpot", "TPOT")):
        for stat in ("median", "p90", "p99", "mean"):
            column = f"{stat}_{key}_ms"
            if column in runs[0].summary:
                ax.plot(x, [run.summary[column] for run in runs], marker="o", label=stat)
        for run, xi in zip(runs, x):
            ax.annotate(run.label.removeprefix("rate "), (xi, run.summary[f"median_{key}_ms"]),
                        textcoords="offset points", xytext=(4, 4), fontsize="small")
        ax.set(title=f"{name} against load", xlabel="achieved request throughput (req/s)", ylabel=f"{name} (ms)")
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path
