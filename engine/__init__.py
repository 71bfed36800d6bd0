"""The Portcullis inference engine.

Owns: the paged KV cache and its block pool with automatic prefix caching (`kv_cache`), the
continuous-batching scheduler (`scheduler`), the model runner and the Llama-family models
(`model_runner`, `models`, `layers`), sampling (`sampler`), the `EngineCore` loop (`core`) and
the offline `LLM` API (`llm`). It may import `kernels` (attention and cache ops) and nothing
else of ours; the gateway talks to it only over HTTP.

    from engine import LLM, SamplingParams
    llm = LLM("path/to/hf-model")
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=32))
"""
from engine.core import EngineCore
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineCore", "RequestOutput", "CompletionOutput"]
