"""The policy's JSON Schema, generated from the pydantic models (`policies/schema.json`).

Regenerate with `portcullis policy schema > policies/schema.json`; a test keeps them equal.
"""

from __future__ import annotations

from typing import Any

from portcullis.gateway.policy.models import KeysFile, Policy


def policy_schema() -> dict[str, Any]:
    schema = Policy.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            **schema, "title": "Portcullis gateway policy"}


def keys_schema() -> dict[str, Any]:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "Portcullis API keys file", **KeysFile.model_json_schema()}
