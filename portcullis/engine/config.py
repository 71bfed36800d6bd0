"""Engine settings, validated once at start-up; names follow `vllm serve`'s flags."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from portcullis import envs
from portcullis.engine.cpu_dtype import choose_cpu_dtype
from portcullis.engine.model.gguf_checkpoint import is_gguf, sidecar_folder
from portcullis.engine.model.loader import gguf_runs_quantized, resolve_model_path
from portcullis.engine.model.quantization import quant_scheme
from portcullis.engine.pooling import PoolingConfig

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3

log = structlog.get_logger("engine")


METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    # As vLLM: "draft_model" when a `model` is given without a method, else "ngram".
    method: str | None = None
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model's directory (or Hub id): "draft_model" only
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # vLLM's: no proposals while more requests than this run (a full batch already keeps the
    # hardware busy, and scoring proposals that fail costs it more than it saves).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; supported: {', '.join(METHODS)}")
        if self.method == "draft_model" and not isinstance(self.model, str):
            raise ValueError('speculative method draft_model needs "model": the draft checkpoint\'s directory')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative method ngram takes no "model" (proposals come from the prompt); '
                             'use "method": "draft_model" for a draft model')
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be between 1 and 16, got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer, got {self.disable_by_batch_size!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @staticmethod
    def parse(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON, a dict (`LLM(speculative_config=...)`) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        fields = json.loads(value) if isinstance(value, str) else dict(value)
        unknown = set(fields) - set(SpeculativeConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative_config fields: {', '.join(sorted(unknown))}")
        return SpeculativeConfig(**fields)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs of the engine's settings (`EngineConfig.scheduler_config`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"  # or "priority"
    speculative: SpeculativeConfig | None = None


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
    pipeline_parallel_size: int = 1  # contiguous stages of layers, one process (× TP) each
    # Across hosts (vLLM's flags): the processes split evenly over `nnodes` hosts, node 0 holding
    # rank 0 and the rendezvous store at master_addr:master_port (0: any free port, one host only).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    allow_public_master_addr: bool = False  # the channel is unauthenticated: private networks only
    device: str = "auto"
    served_model_name: str | None = None
    speculative_config: str | dict | SpeculativeConfig | None = None  # '{"method": "ngram", ...}', as vLLM
    scheduling_policy: str = "fcfs"  # or "priority": lower `priority` first, with aging
    runner: str = "auto"  # "generate", "pooling" (embeddings), or "auto": pooling for a base model without a head
    gguf_dequantize: bool = False  # dequantize a GGUF's quantized weights at load even on CPUs (or PORTCULLIS_GGUF_DEQUANTIZE=1)
    # "int8": the CPU kernel rounds activations to int8 per block of 32 and sums integer products,
    # as llama.cpp does (Q8_0, Q4_0, Q4_1 weights; others stay float32): faster, and answers that
    # differ a little from the float32 default (agreement measured in the tests). Or PORTCULLIS_GGUF_ACTIVATIONS.
    gguf_activations: str = "float32"

    model_path: Path = field(init=False)
    hf_config: object = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    torch_kv_cache_dtype: torch.dtype = field(init=False)
    torch_device: torch.device = field(init=False)
    pooling: PoolingConfig | None = field(init=False, default=None)  # set when the runner is "pooling"
    draft_model_path: Path | None = field(init=False, default=None)  # speculative method draft_model
    draft_hf_config: object = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.gguf_dequantize = self.gguf_dequantize or envs.GGUF_DEQUANTIZE.flag(False)
        if self.gguf_activations == "float32":
            self.gguf_activations = envs.GGUF_ACTIVATIONS.get() or "float32"
        if self.gguf_activations not in ("float32", "int8"):
            raise ValueError(f"gguf_activations must be 'float32' or 'int8', got {self.gguf_activations!r}")
        if self.gguf_activations == "int8" and self.gguf_dequantize:
            raise ValueError("gguf_activations 'int8' runs the quantized weights as stored; it cannot be combined "
                             "with gguf_dequantize")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.block_size % 8:
            raise ValueError(f"block_size must be a multiple of 8 (e.g. 16 or 32), got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.model_path = resolve_model_path(self.model)
        self.hf_config = self._read_hf_config()
        quant_scheme(self.hf_config)  # refuse a quantization method or variant the loader cannot read
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
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            self._check_draft_model()
        if self.runner == "pooling":
            self.pooling = PoolingConfig.from_checkpoint(self.model_path, self.hf_config)
        self._check_pipeline_parallel()
        self._check_hosts()

    @property
    def world_size(self) -> int:
        """Processes of the engine: pipeline stages × tensor-parallel ranks."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                               self.scheduling_policy, self.speculative_config)

    def _read_hf_config(self):
        """config.json; for a GGUF file, its metadata converted once into a cached folder, which is
        also the tokenizer unless --tokenizer names another."""
        from transformers import AutoConfig

        folder = self.model_path
        if is_gguf(self.model_path):
            folder = sidecar_folder(self.model_path)
            self.tokenizer = self.tokenizer or str(folder)
        return AutoConfig.from_pretrained(folder)

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
        # Mixture-of-experts models shard each expert's (and a shared expert's) features too.
        mlp = [n for n in (cfg.intermediate_size, getattr(cfg, "moe_intermediate_size", None),
                           getattr(cfg, "shared_expert_intermediate_size", None)) if n]
        if heads % tp or (kv % tp and tp % kv) or any(n % tp for n in mlp):
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the model's {heads} attention heads and "
                f"{' and '.join(map(str, mlp))} MLP features, and divide or be a multiple of its {kv} KV heads"
            )

    def _check_hosts(self) -> None:
        from portcullis.engine.worker.rendezvous import check_private

        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes); got node_rank={self.node_rank}, nnodes={self.nnodes}")
        if self.world_size % self.nnodes:
            raise ValueError(f"the {self.world_size} processes (tensor x pipeline parallel size) do not split "
                             f"evenly over {self.nnodes} nodes")
        if not 0 <= self.master_port < 65536 or (self.nnodes > 1 and self.master_port == 0):
            raise ValueError(f"master_port must be a port number (and given, with several nodes); got {self.master_port}")
        check_private(self.master_addr, self.allow_public_master_addr)

    def _check_pipeline_parallel(self) -> None:
        pp, layers = self.pipeline_parallel_size, self.hf_config.num_hidden_layers
        if pp == 1:
            return
        if pp > layers:
            raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {layers} layers")
        if self.runner == "pooling":
            raise ValueError("a pooling runner (embeddings) runs with pipeline_parallel_size 1")

    def _check_draft_model(self) -> None:
        """The draft proposes token ids the target verifies: it must share the target's vocabulary."""
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError("speculative method draft_model runs with tensor_parallel_size and "
                             "pipeline_parallel_size 1 only; use method ngram, or one process")
        from transformers import AutoConfig

        try:
            path = resolve_model_path(self.speculative_config.model)
        except ValueError as exc:
            raise ValueError(f"speculative_config: draft {exc}") from exc
        cfg = AutoConfig.from_pretrained(path)
        if cfg.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {cfg.vocab_size} tokens and the target's "
                             f"{self.hf_config.vocab_size}; a draft must share the target's tokenizer")
        limit = getattr(cfg, "max_position_embeddings", None) or 2048
        if limit < self.max_model_len:
            raise ValueError(f"the draft model handles {limit} positions, fewer than max_model_len="
                             f"{self.max_model_len}; lower --max-model-len to {limit}")
        _check_same_tokenizer(Path(self.tokenizer or self.model_path), path)
        self.draft_model_path, self.draft_hf_config = path, cfg

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
        if not envs.CPU_DTYPE.get() and gguf_runs_quantized(self.model_path, self.torch_device,
                                                                 self.gguf_dequantize, self.tensor_parallel_size):
            # The quantized layers compute in float32 whatever the dtype; bfloat16 around them only
            # adds conversions (SmolLM2 Q4_1 decode: 16.5 ms/token in bfloat16, 10.9 in float32).
            log.info("dtype auto", dtype="float32", reason="a GGUF's quantized layers run in float32 on the CPU kernel")
            return torch.float32
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


def _check_same_tokenizer(target: Path, draft: Path) -> None:
    """Refuse a draft whose tokenizer maps any token to another id than the target's (a draft
    folder without tokenizer files is taken to use the target's: its vocabulary size matched)."""
    if not any((draft / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return
    from transformers import AutoTokenizer

    ours, theirs = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (target, draft))
    if ours != theirs:
        differ = sum(1 for token, i in theirs.items() if ours.get(token) != i) + len(ours.keys() - theirs.keys())
        raise ValueError(f"the draft model's tokenizer differs from the target's ({differ} tokens map to other "
                         f"ids or are missing); a draft must use the target's tokenizer")
