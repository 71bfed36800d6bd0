"""Tool calling for chat, as OpenAI's API defines it: `tools` and `tool_choice`.

* `"none"`: plain text, tools only described to the model.
* `"auto"` (the default when tools are given): the model decides; a reply that is a JSON call
  (`{"name": ..., "arguments": {...}}`, a list of them, or one wrapped in `<tool_call>` tags as
  Hermes- and Qwen-style templates ask for) naming a given function becomes `tool_calls`.
* `"required"` or a named function: the reply is constrained with structured output to a call
  whose arguments follow that function's JSON Schema, so it always parses.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.server.errors import bad_request

_WRAPPED = re.compile(r"^\s*<tool_call>\s*(.*?)\s*</tool_call>\s*$", re.DOTALL)


@dataclass
class ToolPlan:
    tools: dict[str, dict]  # function name -> its JSON Schema for the arguments
    mode: str  # "none", "auto", "required" or "named"
    forced: str | None = None  # the function a named tool_choice forces

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def call_schema(self) -> dict:
        """What a forced reply must be: one call of the named function, or of any given one."""
        names = [self.forced] if self.mode == "named" else list(self.tools)
        options = [_one_call_schema(name, self.tools[name]) for name in names]
        return options[0] if len(options) == 1 else {"anyOf": options}


def tool_plan(tools: list[dict] | None, tool_choice: str | dict | None) -> ToolPlan | None:
    """Validate `tools` and `tool_choice` (400 naming the problem); None when there are none."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools: give the functions the model may call", "tool_choice")
        return None
    schemas = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                              "{...}}}", "tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        schemas[fn["name"]] = params
    return ToolPlan(schemas, *_choice(tool_choice, schemas))


def _choice(tool_choice: str | dict | None, schemas: dict[str, dict]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in schemas:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among tools "
                          f"({', '.join(schemas)})", "tool_choice")
    return "named", name


def _one_call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def template_tools(tools: list[dict] | None, plan: ToolPlan | None) -> list[dict] | None:
    """The tools handed to the chat template (templates that know tools describe them)."""
    return tools if plan is not None and plan.mode != "none" else None


def parse_tool_calls(text: str, plan: ToolPlan) -> list[dict] | None:
    """OpenAI `tool_calls` for a reply that is a call (or calls) of given functions, else None."""
    if plan.mode == "none":
        return None
    wrapped = _WRAPPED.match(text)
    try:
        # Not strict: a grammar-constrained reply may hold a raw tab or newline inside a string
        # (xgrammar's JSON grammar allows them); the arguments are re-encoded below anyway.
        value = json.loads(wrapped.group(1) if wrapped else text, strict=False)
    except ValueError:
        return None
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(_is_call(c, plan) for c in calls):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", c.get("parameters", {})))}}
            for c in calls]


def _is_call(value: Any, plan: ToolPlan) -> bool:
    return (isinstance(value, dict) and value.get("name") in plan.tools
            and isinstance(value.get("arguments", value.get("parameters", {})), dict))
