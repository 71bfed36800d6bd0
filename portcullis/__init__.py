"""Portcullis: self-hosted LLM serving, a paged-attention inference engine behind a secure gateway.

The one import package of the `portcullis-llm` distribution; nothing else is installed at the
top level. Its rooms, and what each may import of ours:

    kernels/     attention and KV-cache kernels (Triton, native C++, PyTorch); nothing of ours
    engine/      the inference engine and its private OpenAI-compatible server; `kernels`
    gateway/     the public, policy-enforcing front; never the engine: it talks HTTP to it
    supervisor/  `portcullis serve`: starts, watches and stops engines and the gateway as programs
    cli/         the `portcullis` command line, one module per command
    bench/       `portcullis bench serve`, an HTTP client of either half
    envs, host   every environment variable read (`envs`) and this machine's CPU (`host`):
                 standard-library leaves that any room may import

The base install is the gateway's (no torch); the `engine` extra adds the deep-learning stack.
"""

DISTRIBUTION = "portcullis-llm"  # the name on the package index; `portcullis` is someone else's
