"""torch.compile (Inductor, CPU) of the engine's decoder against eager, same workload, same run.

Issue 19, item 3. Two `engine.LLM`s of one model in one process: one eager, one whose decoder
runs through `torch.compile(dynamic=True)` with each layer's paged attention left out
(`torch.compiler.disable`: its C++ decode kernel is a ctypes call, a graph break anyway). So
Inductor fuses what lies between attention calls (RMSNorm, rotary, SiLU*mul, residual adds);
the linears stay the engine's oneDNN matmuls on weights packed at load, behind an op Inductor
calls but does not lower (`--linears freezing`: unpacked weights, packed by Inductor's
freezing, one graph per layer). Two patches, on the compiled engine's instances only, were
needed: that op, and a rotary without the engine's identity-keyed row cache (dynamo guards on
the positions tensor's identity: it recompiled every step). Each round is a new seeded
workload (engine only, greedy, ignore_eos) on both engines in alternating order; ratios are
medians of per-round ratios. Compile seconds: dynamo's own timer over the warm-up round.

    .venv/bin/python benchmarks/compile_cpu.py [--workload demo qwen0.5b] [--dtype float32 bfloat16]
        [--requests 32] [--rounds 3] [--linears packed|freezing] [--out benchmarks/results/compile_cpu.json]

Measured 2026-12-02, 23:38-23:55 UTC, AMD EPYC (family 25 model 17, 2 cores, AVX-512 BF16),
torch 2.13.0+cpu, 2 threads, load average 0.8-2.0 (uptime; each run alone under the benchmark
lock, the load mostly its own 2 threads), `--linears packed`. Compiled/eager tokens/s, two runs each:

| workload | dtype | run 1 | run 2 | eager tok/s | compile s | graphs | recompiles | outputs differ |
|---|---|---|---|---|---|---|---|---|
| demo, 32 req, 3 / 7 rounds | float32 | 1.12x | 0.97x | 1384 / 1873 | 4.4 / 4.1 | 12 | 0 | 0/128, 0/256 |
| demo, 32 req, 3 / 7 rounds | bfloat16 | 0.96x | 0.93x | 1549 / 1754 | 1.9 / 1.6 | 12 | 0 | 0/128, 0/256 |
| qwen0.5b, 16 req, 3 rounds | float32 | 1.04x | 1.03x | 57 / 54 | 15.3 / 4.2 | 12 | 0 | 0/64, 0/64 |
| qwen0.5b, 16 req, 3 rounds | bfloat16 | 0.97x | 1.07x | 103 / 83 | 14.9 / 4.9 | 12 | 0 | 61/64, 61/64 |

Per-round ratios spread 0.87-1.17 on the demo model (2-3 s rounds), 0.94-1.16 on qwen0.5b.
Compile took 15 s in the first two qwen0.5b runs and 4-5 s in the last two (each process
starts a fresh Inductor cache; some other cache or the load made the difference). No gain
beyond noise. Likely why (not profiled): the oneDNN linears, untouched, dominate the step, and
each layer is split into four compiled frames around the attention break, whose guards and
calls cost about what the fusions save. `--linears freezing` (demo, float32, 32 req, 3 rounds,
23:56): 0.87x, 24.4 s compile, 52 graphs (a set per layer), outputs identical. bf16 outputs differ because Inductor's fused kernels keep float32
between ops where eager rounds each op to bf16; on random weights near-tied argmaxes flip.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

import torch
import torch._dynamo
from torch._dynamo.utils import compilation_time_metrics, counters

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("PORTCULLIS_CPU_DTYPE", "float32")
# A cold Inductor cache, so the compile time is what a first start-up pays.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

from offline_throughput import (  # noqa: E402
    WORKLOADS,
    _cpu_model,
    make_workload,
    workload_model,
)

from portcullis.engine import LLM, SamplingParams  # noqa: E402
from portcullis.engine.model import loader as engine_loader  # noqa: E402
from portcullis.engine.model.layers import (  # noqa: E402
    ReplicatedLinear,
    RotaryEmbedding,
    RowParallelLinear,
    rotate,
)

# Should a layer's frame be compiled once per layer module, the default limit of 8 would send
# the later layers back to eager without a word; counted below instead.
torch._dynamo.config.cache_size_limit = 256
torch._dynamo.config.accumulated_cache_size_limit = 1024


@torch.library.custom_op("portcullis_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The engine's oneDNN matmul on its packed weight, as one op Inductor calls but does not
    lower (its own lowering takes only weights frozen into the graph as constants)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


class _PackedLinear(ReplicatedLinear):
    """Mixed into each linear's own class (so its weight loader stays): forward through the op
    above. A class, not a per-instance forward, so dynamo does not guard on each layer's id."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self, RowParallelLinear):  # its bias goes after the (TP) reduction
            y = packed_linear(x, self.packed, None)
            return y if self.bias is None else y + self.bias
        return packed_linear(x, self.packed, self.bias)


class _UncachedRotary(RotaryEmbedding):
    """The engine's rotary without its per-forward cache of gathered rows: that cache is keyed
    on the positions tensor's identity, which dynamo guards on, so it recompiled every step."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def build(path: Path, max_len: int, dtype: str, backend: str | None, linears: str) -> LLM:
    """An engine; with `backend`, its decoder runs through torch.compile on that backend,
    paged attention excluded. `linears`: "packed" keeps the engine's oneDNN weights behind an
    opaque op (one graph serves every layer); "freezing" loads them unpacked and lets
    Inductor's freezing pack them (a graph per layer: weights become constants)."""
    os.environ["PORTCULLIS_CPU_DTYPE"] = dtype  # read when the engine picks its CPU dtype
    unpacked = backend and linears == "freezing"
    with patch.object(engine_loader, "pack_linear_weights", lambda model: 0) if unpacked else nullcontext():
        llm = LLM(str(path), max_model_len=max_len, seed=0, skip_tokenizer_init=True, kv_cache_memory=1 << 30)
    if backend:
        _compile_decoder(llm.engine.model_runner.model, backend)
    return llm


def _compile_decoder(model: torch.nn.Module, backend: str) -> None:
    """Patches this model's instances only: the eager engine in the same process is untouched."""
    for attn in model.attention_layers():
        attn.forward = torch.compiler.disable(attn.forward)
    rope = model.model.layers[0].self_attn.rope
    dtype = model.model.embed_tokens.weight.dtype
    rope.cos, rope.sin = rope.cos.to(dtype), rope.sin.to(dtype)
    rope.__class__ = _UncachedRotary
    for layer in model.model.modules():
        if isinstance(layer, ReplicatedLinear) and layer.packed is not None:
            layer.__class__ = _packed_class(type(layer))
    model.model = torch.compile(model.model, dynamic=True, backend=backend)


@functools.cache
def _packed_class(cls: type) -> type:
    return type(f"Packed{cls.__name__}", (_PackedLinear, cls), {})


def run(llm: LLM, work: list[tuple[list[int], int]], tag: str) -> tuple[float, list[list[int]]]:
    """Seconds for the whole workload, and each request's output tokens."""
    core = llm.engine
    outputs: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(work))}
    for rid, (prompt, olen) in zip(outputs, work):
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True))
    start = time.perf_counter()
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return time.perf_counter() - start, list(outputs.values())


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def compile_seconds() -> float:
    """Dynamo's own timer over every frame compilation so far (tracing plus Inductor)."""
    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def bench(name: str, path: Path, vocab: int, dtype: str, requests: int, rounds: int, backend: str,
          linears: str) -> dict:
    torch._dynamo.reset()  # each model and dtype compiles from nothing, as at a start-up
    spec = dict(WORKLOADS[name], requests=requests)
    works = [make_workload(spec, vocab, seed=r) for r in range(rounds + 1)]
    max_len = max(len(p) + o for w in works for p, o in w) + 16
    eager, comp = build(path, max_len, dtype, None, linears), build(path, max_len, dtype, backend, linears)
    # Warm-up round (seed 0): the compiled side compiles here.
    eager_s, eager_out = run(eager, works[0], "warm")
    graphs_before, compile_before = graphs_compiled(), compile_seconds()
    comp_s, comp_out = run(comp, works[0], "warm")
    result = {"workload": name, "dtype": dtype, "requests": requests,
              "warmup": {"eager_s": eager_s, "compiled_s": comp_s, "compile_s": compile_seconds() - compile_before,
                         "graphs_compiled": graphs_compiled() - graphs_before},
              "rounds": []}
    mismatches = _mismatches(eager_out, comp_out)
    graphs_after_warmup, compile_after_warmup = graphs_compiled(), compile_seconds()
    for r in range(1, rounds + 1):
        order = [("eager", eager), ("compiled", comp)] if r % 2 else [("compiled", comp), ("eager", eager)]
        tokens = sum(o for _, o in works[r])
        row, outs = {"output_tokens": tokens}, {}
        for label, llm in order:
            seconds, outs[label] = run(llm, works[r], f"r{r}")
            row[f"{label}_tok_s"] = tokens / seconds
        row["ratio"] = row["compiled_tok_s"] / row["eager_tok_s"]
        mismatches += _mismatches(outs["eager"], outs["compiled"])
        result["rounds"].append(row)
        print(f"  {name} {dtype} round {r}: eager {row['eager_tok_s']:.0f} tok/s, "
              f"compiled {row['compiled_tok_s']:.0f} tok/s ({row['ratio']:.2f}x)", flush=True)
    med = {k: statistics.median(row[k] for row in result["rounds"]) for k in ("eager_tok_s", "compiled_tok_s", "ratio")}
    result.update(median=med, graphs_compiled_after_warmup=graphs_compiled() - graphs_after_warmup,
                  compile_s_after_warmup=compile_seconds() - compile_after_warmup,
                  requests_with_different_tokens=mismatches, requests_compared=requests * (rounds + 1))
    return result


def _mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: dynamo's own cost only)")
    ap.add_argument("--linears", choices=("packed", "freezing"), default="packed",
                    help="compiled side: the engine's packed oneDNN weights, or Inductor's freezing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/compile_cpu.json"))
    args = ap.parse_args()
    torch._inductor.config.freezing = args.linears == "freezing"
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": _cpu_model(),
               "torch": torch.__version__, "backend": args.backend, "linears": args.linears, "torch_threads": torch.get_num_threads(),
               "load_avg_at_start": os.getloadavg(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workload:
            path, vocab = workload_model(name, Path(tmp))
            for dtype in args.dtype:
                results["runs"].append(bench(name, path, vocab, dtype, args.requests, args.rounds,
                                             args.backend, args.linears))
    results["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}\n")
    print("| workload | dtype | eager tok/s | compiled tok/s | compiled/eager (median of rounds) | compile s | graphs | graphs after warm-up | differing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        m = r["median"]
        print(f"| {r['workload']} ({r['requests']} req) | {r['dtype']} | {m['eager_tok_s']:.0f} | "
              f"{m['compiled_tok_s']:.0f} | {m['ratio']:.2f}x | {r['warmup']['compile_s']:.1f} | "
              f"{r['warmup']['graphs_compiled']} | {r['graphs_compiled_after_warmup']} | "
              f"{r['requests_with_different_tokens']}/{r['requests_compared']} |")


if __name__ == "__main__":
    main()
