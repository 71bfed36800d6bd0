"""The engine server's settings, checked once at start-up: unsafe combinations are refused here,
before a model is loaded, with a message that says what to do."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from portcullis.engine.server.reasoning import REASONING_PARSERS
from portcullis.engine.server.tool_parsers import TOOL_PARSERS
from portcullis.protocol.channel import ENGINE_TOKEN_ENV, MIN_ENGINE_TOKEN_CHARS


class GenerationDefaults(BaseModel):
    """Sampling defaults for fields a request leaves out (from generation_config.json with
    `--generation-config auto`), and the server-wide cap on generated tokens if the model sets one."""

    model_config = ConfigDict(frozen=True)

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    max_new_tokens: int | None = None


class ServerSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    served_model_names: list[str] = Field(min_length=1)
    token: SecretStr | None = None
    allow_no_token: bool = False
    uds: Path | None = None
    host: str | None = None
    port: int | None = Field(default=None, ge=0, le=65535)
    max_waiting: int = Field(default=1024, ge=1)
    status_interval_s: float = Field(default=10.0, gt=0)
    generation: GenerationDefaults = GenerationDefaults()
    # How replies are read, with vLLM's flags: tool calls in "auto" mode, reasoning, and whether
    # structured output constrains the reasoning too (vLLM's structured_outputs_config.enable_in_reasoning).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    structured_outputs_in_reasoning: bool = False

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, name: str | None, info) -> str | None:
        known = TOOL_PARSERS if info.field_name == "tool_call_parser" else REASONING_PARSERS
        if name is not None and name not in known:
            flag = "--" + info.field_name.replace("_", "-")
            raise ValueError(f"{flag} {name!r} is not one of {', '.join(sorted(known))}")
        return name

    @model_validator(mode="after")
    def _check_channel(self) -> ServerSettings:
        if self.token is not None and len(self.token.get_secret_value()) < MIN_ENGINE_TOKEN_CHARS:
            raise ValueError(f"the internal token must be at least {MIN_ENGINE_TOKEN_CHARS} characters")
        if self.uds is not None and self.port is not None:
            raise ValueError("give either a Unix socket (--uds) or --host/--port, not both")
        if self.token is None and self.port is not None:
            raise ValueError(
                "refusing to listen on TCP without an internal token: set "
                f"{ENGINE_TOKEN_ENV} or pass --token-file (or listen on a Unix socket with --uds)"
            )
        if self.token is None and not self.allow_no_token:
            raise ValueError(
                f"no internal token: set {ENGINE_TOKEN_ENV} or pass --token-file; for local development "
                "on a Unix socket only, --no-token serves without one"
            )
        return self

    @property
    def model_name(self) -> str:
        """The name reported back in responses and metric labels."""
        return self.served_model_names[0]
