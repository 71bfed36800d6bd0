"""The engine's private OpenAI-compatible HTTP server.

Owns: the routes (`/v1/completions` with fill-in-the-middle `suffix` (`fim`),
`/v1/chat/completions` with streamed tool calls (`tool_parsers`, `--tool-call-parser`) and
reasoning (`reasoning`, `--reasoning-parser`), `/v1/embeddings` for a pooling engine,
`/v1/models`, `/tokenize`, `/detokenize`, `/health`, `/metrics`, `/version`), the
internal-token check, request validation and OpenAI error bodies, streaming as Server-Sent
Events, and the command line (`python -m portcullis.engine`). It drives the engine through `engine.frontend.async_engine.AsyncEngine`
(the `EngineCore` loop on a thread of its own: the process's main thread under `portcullis engine`)
and does tokenization and incremental detokenization (`engine.frontend.detokenizer`) itself, off
the engine's thread. Only the gateway should reach it: it
listens on a Unix socket (mode 0600) by default, and every route but `/health` needs the
internal token. It is safe by default against hostile request fields whoever sends them:
`limits` caps what one request may ask for (list sizes, n x prompts <= --max-num-seqs,
logprobs, JSON depth) and allows only a listed set of `chat_template_kwargs`; a client's
own chat template is never run. Each refusal is a 400 naming the field and the limit.

    from portcullis.engine.server import create_app, ServerSettings
    app = create_app(EngineCore(config), ServerSettings(served_model_names=["demo"], token=...))
"""
from portcullis.engine.server.app import create_app
from portcullis.engine.server.settings import GenerationDefaults, ServerSettings

__all__ = ["create_app", "ServerSettings", "GenerationDefaults"]
