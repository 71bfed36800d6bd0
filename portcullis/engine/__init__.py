"""The Portcullis inference engine.

Owns: the paged KV cache and its block pool with automatic prefix caching (`kv_cache`), the
continuous-batching scheduler (`scheduler`, the only owner of each `Request`, with its FCFS or
priority `waiting_queue`), speculative decoding and Predicted Outputs (`spec_decode`: n-gram
and prediction proposals made by the scheduler, a draft model's made by the runner, all
verified by the runner), the model runner and the Llama-family
models (`model_runner`, `models`, `layers`) with the runner's own request state (`input_batch`),
each step's flattened inputs (`step_batch`), sampling (`sampler`), embeddings (`pooling`, the
"pooling" runner), structured output's grammars (`structured_output`), the tensor-parallel worker
processes (`tp_worker`), the `EngineCore` loop (`core`, which owns the scheduler, the runner and
the workers), the CPU dtype choice (`cpu_dtype`), the dequantization of Hub-quantized checkpoints (GPTQ,
AWQ, FP8, compressed-tensors) as they load (`quantization`), the output processing that `LLM` and the server share (`output_processor`: n
samples, detokenization, stop strings) and the offline `LLM` API (`llm`). Between the parts travel plain
data: `SchedulerOutput` to the runner, `ModelRunnerOutput` back, `StepOutput` to front-ends,
which know the engine through `EngineCore.info`. A request it refuses raises `RequestError`,
which names the field at fault (`errors`). It may import `kernels` (attention and cache ops) and
nothing else of ours; the gateway talks to it only over HTTP.

    from portcullis.engine import LLM, SamplingParams
    llm = LLM("path/to/hf-model")
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=32))
"""
from __future__ import annotations

import importlib

# Imported on first use, so `python -m portcullis.engine --help` and light tools do not pay for torch.
_EXPORTS = {
    "LLM": "portcullis.engine.llm",
    "SamplingParams": "portcullis.engine.sampling_params",
    "PoolingParams": "portcullis.engine.pooling",
    "EngineCore": "portcullis.engine.core",
    "RequestError": "portcullis.engine.errors",
    "RequestOutput": "portcullis.engine.outputs",
    "CompletionOutput": "portcullis.engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'portcullis.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
