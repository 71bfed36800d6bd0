"""Engine settings, validated once at start-up; names follow `vllm serve`'s flags."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from engine.cpu_dtype import choose_cpu_dtype
from engine.loader import resolve_model_path
from engine.pooling import PoolingConfig
from engine.spec_decode import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3

log = structlog.get_logger("engine")


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # on CPUs: bfloat16 where this CPU runs it clearly faster (engine/cpu_dtype.py)
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; or "bfloat16", "float32"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes; default: 2 GiB on CPU, sized by profiling on GPU
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    device: str = "auto"
    served_model_name: str | None = None
    speculative_config: str | dict | SpeculativeConfig | None = None  # '{"method": "ngram", ...}', as vLLM
    scheduling_policy: str = "fcfs"  # or "priority": lower `priority` first, with aging
    runner: str = "auto"  # "generate", "pooling" (embeddings), or "auto": pooling for a base model without a head

    model_path: Path = field(init=False)
    hf_config: object = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    torch_kv_cache_dtype: torch.dtype = field(init=False)
    torch_device: torch.device = field(init=False)
    pooling: PoolingConfig | None = field(init=False, default=None)  # set when the runner is "pooling"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.block_size % 8:
            raise ValueError(f"block_size must be a multiple of 8 (e.g. 16 or 32), got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.model_path = resolve_model_path(self.model)
        from transformers import AutoConfig

        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self._check_tensor_parallel()
        self.torch_device = self._pick_device()
        self.torch_dtype = self._pick_dtype()
        self.torch_kv_cache_dtype = self._pick_kv_cache_dtype()
        self.max_model_len = self._pick_max_model_len()
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.served_model_name is None:
            self.served_model_name = self.model
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        self.runner = self._pick_runner()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.runner == "pooling":
            raise ValueError("speculative decoding is for generation; a pooling runner computes embeddings")
        if self.runner == "pooling":
            self.pooling = PoolingConfig.from_checkpoint(self.model_path, self.hf_config)

    def _pick_runner(self) -> str:
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.runner != "auto":
            return self.runner
        names = getattr(self.hf_config, "architectures", None) or []
        # A checkpoint saved without its LM head (`Qwen3Model`, `LlamaModel`) can only embed.
        return "pooling" if names and all(not n.endswith("ForCausalLM") for n in names) else "generate"

    def _check_tensor_parallel(self) -> None:
        tp, cfg = self.tensor_parallel_size, self.hf_config
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % tp or (kv % tp and tp % kv) or cfg.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the model's {heads} attention heads and "
                f"{cfg.intermediate_size} MLP features, and divide or be a multiple of its {kv} KV heads"
            )

    def _pick_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def _pick_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            if self.dtype not in _DTYPES:
                raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
            return _DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return self._pick_cpu_dtype()
        ckpt = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(ckpt, str):
            ckpt = _DTYPES.get(ckpt)
        return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16

    def _pick_cpu_dtype(self) -> torch.dtype:
        cfg = self.hf_config
        choice = choose_cpu_dtype(cfg.hidden_size, cfg.intermediate_size // self.tensor_parallel_size)
        speedup = None if choice.bf16_speedup is None else float(f"{choice.bf16_speedup:.3g}")
        log.info("dtype auto", dtype=str(choice.dtype).removeprefix("torch."), reason=choice.reason,
                 bf16_speedup=speedup, cpu_bf16_flags=choice.cpu_flags)
        return choice.dtype

    def _pick_kv_cache_dtype(self) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto, bfloat16 or float32, got {self.kv_cache_dtype!r}")
        return _KV_CACHE_DTYPES[self.kv_cache_dtype]

    def _pick_max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            return limit
        if not 1 <= self.max_model_len <= limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} must be between 1 and the model's "
                f"max_position_embeddings ({limit})"
            )
        return self.max_model_len
