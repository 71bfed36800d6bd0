"""Portcullis: self-hosted LLM serving, a paged-attention inference engine behind a secure gateway.

The one import package of the `portcullis-llm` distribution; nothing else is installed at the
top level. Its rooms, and what each may import of ours:

    kernels/     attention and KV-cache kernels (Triton, native C++, PyTorch); nothing of ours
    engine/      the inference engine and its private OpenAI-compatible server; `kernels`
    gateway/     the public, policy-enforcing front; never the engine: it talks HTTP to it
    supervisor/  `portcullis serve`: starts, watches and stops engines and the gateway as programs
    cli/         the `portcullis` command line, one module per command
    bench/       `portcullis bench serve`, an HTTP client of either half
    envs, host,  every environment variable read (`envs`), this machine's CPU (`host`) and
    oplog        the operational log's set-up (`oplog`): leaves that import nothing of ours,
                 which any room may import

Where a chat request goes (`portcullis serve`): the client's `POST /v1/chat/completions` reaches
the gateway (`gateway.app.ProbesOrProxy`, then the stages of `gateway.routers.proxy` on one
`gateway.proxy_call.ProxyCall`: credentials, allowlist, models, body caps, rate limits and budgets);
`gateway.upstream.forward.Exchange` sends it over the private channel (`gateway.upstream.client`,
a Unix socket) to the engine's server (`engine.server`: validated, chat template rendered,
tokenized), which adds it to `engine.frontend.async_engine.AsyncEngine`; on the engine's thread
`engine.core.engine_core.EngineCore` steps it (`core.scheduler` plans, `worker.model_runner` runs
the model from `engine.model` on `kernels` and samples); tokens go back as Server-Sent Events the
same way, and the gateway settles usage and writes the audit line (`gateway.audit`).

The base install is the gateway's (no torch); the `engine` extra adds the deep-learning stack.
"""

DISTRIBUTION = "portcullis-llm"  # the name on the package index; `portcullis` is someone else's
