"""The private channel between the gateway and the engine: where it is, and how the engine knows
its caller. Both halves, `portcullis serve` and the deploy files name these; defined here once."""

from __future__ import annotations

from pathlib import Path

from portcullis import envs

ENGINE_TOKEN_ENV = envs.ENGINE_TOKEN.name  # the internal token, when no token file is given
MIN_ENGINE_TOKEN_CHARS = 16  # both halves refuse a shorter one at start-up
DEFAULT_ENGINE_SOCKET = Path("/run/portcullis/engine.sock")  # where the engine listens and the gateway looks
DEFAULT_ENGINE_URL = f"unix://{DEFAULT_ENGINE_SOCKET}"
REQUEST_ID_HEADER = "x-request-id"  # sent by the gateway, echoed by the engine, in every audit line
# Which tenant a request is for (the gateway sends its tenant's cache salt, an opaque HMAC): the
# engine's tokenizer and grammar threads serve tenants in turn by it.
TENANT_HEADER = "x-portcullis-tenant"
# The tenant's max_prompt_tokens, when its policy sets one: the engine refuses a longer prompt as
# it renders it, what the gateway cannot count (a Responses call's stored earlier turns).
PROMPT_CAP_HEADER = "x-portcullis-max-prompt-tokens"
