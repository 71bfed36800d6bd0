"""The Portcullis inference engine, in rooms by job:

- `core/`: the `EngineCore` step loop (`engine_core`), the continuous-batching `scheduler` (the
  only owner of each `Request`, with its FCFS or priority `waiting_queue`), the paged KV cache
  and prefix cache (`kv_cache`), speculative decoding's proposals (`spec_decode`), structured
  output's grammars (`structured_output`), and `output`: what the scheduler hands the runner.
- `worker/`: the `model_runner` with its own request state (`input_batch`), each step's
  flattened inputs (`step_batch`), the `sampler`, the `pooler`, and the other ranks of tensor and
  pipeline parallelism (`tp_worker`), on this host or others (`rendezvous`).
- `model/`: parallel `layers`, paged `attention`, the model `families`, and loading (`loader`,
  `gguf_checkpoint`, `quantization` for Hub-quantized checkpoints).
- `frontend/`: the offline `LLM` API (`llm`), the server's `AsyncEngine` (`async_engine`), and
  what they share (`output_processor`: n samples, stop strings; `detokenizer`).
- `server/`: the private OpenAI-compatible HTTP server.
- `compat/`: the only code that touches libraries' internals (oneDNN's packed linear in torch,
  uvicorn's signal capture), each pinned by a contract test.
- Here: settings (`config`), request options (`sampling_params`, `pooling`), what the engine
  returns (`outputs`), the parallel grid and its collectives and hand-offs (`distributed`), the CPU dtype choice
  (`cpu_dtype`) and OpenMP's spin (`openmp`).

Between the rooms travel plain data: `SchedulerOutput` to the runner, `ModelRunnerOutput` back,
`StepOutput` to front ends, which know the engine through `EngineCore.info`. A request it
refuses raises `RequestError`, which names the field at fault (`errors`). It may import
`kernels` (attention and cache ops), `protocol` and the leaves every room may (`envs`, `host`,
`oplog`), and nothing else of ours; the gateway talks to it only over HTTP.

    from portcullis.engine import LLM, SamplingParams
    llm = LLM("path/to/hf-model")
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=32))
"""
from __future__ import annotations

import importlib

# Imported on first use, so `python -m portcullis.engine --help` and light tools do not pay for torch.
_EXPORTS = {
    "LLM": "portcullis.engine.frontend.llm",
    "SamplingParams": "portcullis.engine.sampling_params",
    "PoolingParams": "portcullis.engine.pooling",
    "EngineCore": "portcullis.engine.core.engine_core",
    "RequestError": "portcullis.engine.errors",
    "RequestOutput": "portcullis.engine.outputs",
    "CompletionOutput": "portcullis.engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'portcullis.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
