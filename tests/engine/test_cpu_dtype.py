"""`--dtype auto` on CPUs (bfloat16 only where a probe finds it clearly faster) and `--kv-cache-dtype`."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import structlog
import torch

from portcullis.engine import LLM, SamplingParams, cpu_dtype
from portcullis.engine.assets import DEMO_MODEL_DIR
from portcullis.engine.config import EngineConfig


@pytest.fixture
def probe(monkeypatch):
    """The CPU as the test says: `probe.flags` (None: no /proc/cpuinfo) and `probe.speedup`;
    `probe.calls` counts the probes. The suite's float32 pin is lifted, the cache emptied."""
    monkeypatch.delenv(cpu_dtype.DTYPE_ENV, raising=False)

    class Fake:
        flags: tuple[str, ...] | None = ("avx512_bf16",)
        speedup = 2.0
        calls = 0

        def measure(self, hidden: int, intermediate: int) -> float:
            self.calls += 1
            return self.speedup

    fake = Fake()
    monkeypatch.setattr(cpu_dtype, "cpu_bf16_flags", lambda: fake.flags)
    monkeypatch.setattr(cpu_dtype, "measure_bf16_speedup", fake.measure)
    cpu_dtype.choose_cpu_dtype.cache_clear()
    yield fake
    cpu_dtype.choose_cpu_dtype.cache_clear()


def _config(path: Path, **kwargs) -> tuple[EngineConfig, list[dict]]:
    with structlog.testing.capture_logs() as logs:
        config = EngineConfig(str(path), device="cpu", **kwargs)
    return config, [e for e in logs if e["event"] == "dtype auto"]


@pytest.mark.parametrize(("speedup", "want"), [(2.0, torch.bfloat16), (1.3, torch.bfloat16),
                                               (1.29, torch.float32), (0.004, torch.float32)])
def test_auto_takes_bf16_only_when_clearly_faster(probe, checkpoint_factory, speedup, want):
    probe.speedup = speedup
    config, logs = _config(checkpoint_factory("llama"))
    assert config.torch_dtype == want and config.torch_kv_cache_dtype == want
    assert len(logs) == 1
    assert logs[0]["dtype"] == str(want).removeprefix("torch.")
    assert logs[0]["bf16_speedup"] == speedup and logs[0]["cpu_bf16_flags"] == ("avx512_bf16",)


def test_a_cpu_without_bf16_instructions_is_not_probed(probe, checkpoint_factory):
    probe.flags = ()
    config, logs = _config(checkpoint_factory("llama"))
    assert config.torch_dtype == torch.float32 and probe.calls == 0
    assert logs[0]["bf16_speedup"] is None and "no bf16" in logs[0]["reason"]


def test_without_cpu_flags_the_probe_decides(probe, checkpoint_factory):
    probe.flags = None  # not Linux: nothing to read
    assert _config(checkpoint_factory("llama"))[0].torch_dtype == torch.bfloat16
    assert probe.calls == 1


def test_the_probe_runs_once_per_process_and_shape(probe, checkpoint_factory):
    for _ in range(3):
        _config(checkpoint_factory("llama"))
    _config(checkpoint_factory("qwen2"))  # the same MLP shapes as the llama fixture
    _config(DEMO_MODEL_DIR)
    assert probe.calls == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dtype_flag_overrides_the_probe(probe, checkpoint_factory, dtype):
    probe.speedup = 0.5 if dtype == "bfloat16" else 4.0
    config, logs = _config(checkpoint_factory("llama"), dtype=dtype)
    assert config.torch_dtype == getattr(torch, dtype) and probe.calls == 0 and not logs


def test_environment_pins_what_auto_means(probe, monkeypatch, checkpoint_factory):
    monkeypatch.setenv(cpu_dtype.DTYPE_ENV, "float32")
    config, logs = _config(checkpoint_factory("llama"))
    assert config.torch_dtype == torch.float32 and probe.calls == 0
    assert cpu_dtype.DTYPE_ENV in logs[0]["reason"]
    monkeypatch.setenv(cpu_dtype.DTYPE_ENV, "fast")
    cpu_dtype.choose_cpu_dtype.cache_clear()
    with pytest.raises(ValueError, match=cpu_dtype.DTYPE_ENV):
        _config(checkpoint_factory("llama"))


def test_bf16_flags_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile\n\nflags : x\n")
    assert set(cpu_dtype.cpu_bf16_flags(info)) == {"avx512_bf16", "amx_bf16"}
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_dtype.cpu_bf16_flags(info) == ()
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")  # aarch64
    assert cpu_dtype.cpu_bf16_flags(info) == ("bf16",)
    assert cpu_dtype.cpu_bf16_flags(tmp_path / "missing") is None


def test_the_real_probe_is_short_and_leaves_threads_alone():
    threads = torch.get_num_threads()
    start = time.process_time()
    speedup = cpu_dtype.measure_bf16_speedup(896, 4864)  # Qwen2.5-0.5B's MLP
    assert time.process_time() - start < 2.0  # tens of ms of CPU here; loose for slow runners
    assert math.isfinite(speedup) and speedup > 0
    assert torch.get_num_threads() == threads


# -- KV-cache dtype ------------------------------------------------------------------------------
def test_kv_cache_dtype_auto_follows_the_model(checkpoint_factory):
    path = checkpoint_factory("llama")
    assert EngineConfig(str(path), device="cpu", dtype="bfloat16").torch_kv_cache_dtype == torch.bfloat16
    config = EngineConfig(str(path), device="cpu", dtype="bfloat16", kv_cache_dtype="float32")
    assert config.torch_dtype == torch.bfloat16 and config.torch_kv_cache_dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(str(path), device="cpu", kv_cache_dtype="fp8")


def test_cli_flags_reach_the_config(checkpoint_factory):
    from portcullis.engine.server.cli import _engine_config, build_parser

    path = str(checkpoint_factory("llama"))
    args = build_parser().parse_args([path, "--dtype", "float32", "--kv-cache-dtype", "bfloat16"])
    config = _engine_config(args, path, "m")
    assert config.torch_dtype == torch.float32 and config.torch_kv_cache_dtype == torch.bfloat16
    with pytest.raises(SystemExit):
        build_parser().parse_args([path, "--kv-cache-dtype", "fp8"])


PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "for i in range(10):",
           "def count_words(text):\n    counts = {}\n    for word in text.split():",
           "import re\n\n\ndef parse_version(text):", "class Error(Exception):"]


GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=1)


def _demo(kv_cache_dtype: str, **kwargs) -> LLM:
    return LLM(str(DEMO_MODEL_DIR), dtype="float32", kv_cache_dtype=kv_cache_dtype,
               max_model_len=256, kv_cache_memory=8 << 20, seed=0, **kwargs)


def test_bf16_cache_under_a_float32_model():
    """Half the bytes per block, and the demo model still writes what it writes with a float32
    cache (bf16 rounding of K/V may move a late token, not the start)."""
    wide, narrow = _demo("float32"), _demo("bfloat16")
    runner = narrow.engine.model_runner
    key, value = runner.model.attention_layers()[0].kv_cache
    assert key.dtype == value.dtype == torch.bfloat16
    assert 2 * runner.kv_bytes_per_block() == wide.engine.model_runner.kv_bytes_per_block()
    assert narrow.engine.info.num_kv_blocks == 2 * wide.engine.info.num_kv_blocks
    got = narrow.generate(PROMPTS, GREEDY, use_tqdm=False)
    want = wide.generate(PROMPTS, GREEDY, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids[:8] == w.outputs[0].token_ids[:8]
        assert all(math.isfinite(e.top[0][1]) for e in g.outputs[0].logprobs)
    same = sum(g.outputs[0].token_ids == w.outputs[0].token_ids for g, w in zip(got, want))
    assert same >= len(PROMPTS) // 2
