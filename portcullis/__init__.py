"""Portcullis: self-hosted LLM serving, a paged-attention inference engine behind a secure gateway.

The one import package of the `portcullis-llm` distribution; nothing else is installed at the
top level. Its rooms, and what each may import of ours:

    kernels/     attention and KV-cache kernels (Triton, native C++, PyTorch); nothing of ours
    engine/      the inference engine and its private OpenAI-compatible server; `kernels`, `protocol`
    gateway/     the public, policy-enforcing front; `protocol`, never the engine: it talks HTTP to it
    protocol/    what the gateway and the engine must agree on (request rules, error bodies); nothing
    testing/     a stub engine for tests and benchmarks, torch-free like the gateway; `protocol`
    supervisor/  `portcullis serve`: starts, watches and stops engines and the gateway as programs
    cli/         the `portcullis` command line, one module per command
    bench/       `portcullis bench serve`, an HTTP client of either half
    envs, host,  every environment variable read (`envs`), this machine's CPU (`host`) and
    oplog        the operational log's set-up (`oplog`): leaves that import nothing of ours,
                 which any room may import

Where a chat request goes (`portcullis serve`): the client's `POST /v1/chat/completions` reaches
the gateway (`gateway.connection`'s guarded HTTP/1.1, `gateway.app`'s audit layer and
`ProbesOrProxy`), then the stages of `gateway.routers.proxy` on one `gateway.proxy_call.ProxyCall`,
in its order: allowlist, failed-auth throttle, authentication, route scope, body, model and caps,
rate limits (budgets among them), prompt length. `gateway.upstream.forward.Exchange` sends it over
the private channel (`gateway.upstream.client`, a Unix socket) to the engine's server
(`engine.server.routers.chat`: validated, chat template rendered by `engine.server.prompts`,
tokenized), which adds it to `engine.frontend.async_engine.AsyncEngine`; on the engine's thread
`engine.core.engine_core.EngineCore` steps it: `core.scheduler` plans, `worker.model_runner` runs
the model from `engine.model` on `kernels`, and `worker.sampler` picks each next token.

The way back: each step's tokens return to the server's event loop, where
`engine.frontend.output_processor` (n samples, stop strings) and `engine.frontend.detokenizer`
turn them into text; `engine.server.generation` gathers the call's choices and `routers.chat`
writes them as Server-Sent Events (`engine.server.streaming`). The gateway relays the events
(`gateway.upstream.sse`, reading their usage), then settles rate limits and budgets and writes
the audit line (`gateway.audit`).

The base install is the gateway's (no torch); the `engine` extra adds the deep-learning stack.
"""

DISTRIBUTION = "portcullis-llm"  # the name on the package index; `portcullis` is someone else's
