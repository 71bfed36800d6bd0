"""The model: layers that know tensor parallelism (`layers`), paged attention (`attention`), the
families written with them (`families`: Llama and kin, Gemma, Phi-3, mixtures of experts), and
how checkpoints become weights (`loader`, `gguf_checkpoint`, and `quantization` for Hub-quantized
ones). It imports `kernels` and nothing of the core or the worker.
"""
