"""Tool calling for chat, as OpenAI's API defines it: `tools` and `tool_choice`.

* `"none"`: plain text, tools not shown to the model.
* `"auto"`: the model decides; its calls, in the format of the server's `--tool-call-parser`,
  become `tool_calls` as they stream. As in vLLM this needs `--enable-auto-tool-choice`: an
  explicit `"auto"` without it is a 400. Tools sent with no `tool_choice` mean `"auto"` when it is
  enabled; without it (where vLLM answers 400) the tools are still shown to the model and the
  reply is plain text, so clients that always send their tools keep working.
* `"required"` or a named function: the reply is constrained with structured output to calls
  whose arguments follow their function's JSON Schema, so they always parse; they stream too.
  `"required"` makes a list of one or more calls (as vLLM), one only with `parallel_tool_calls`
  false; a named function, one call of it. The
  schema's local references (`#/$defs/...`, `#/definitions/...`, `#`) are rebased to where the
  arguments sit in the call's schema, so nested models (Pydantic's `$defs`, zod's paths) resolve.
"""
from __future__ import annotations

from dataclasses import dataclass

from portcullis.engine.server.errors import bad_request
from portcullis.engine.server.tool_parsers import TOOL_PARSERS, JsonCallParser, ToolParser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass
class ToolPlan:
    tools: dict[str, dict]  # function name -> its JSON Schema for the arguments
    mode: str  # "none", "auto", "required" or "named"
    forced: str | None = None  # the function a named tool_choice forces
    auto_parser: str | None = None  # the --tool-call-parser that reads "auto" replies (None: text)
    parallel: bool = True  # `parallel_tool_calls`: "required" may make several calls

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def call_schema(self) -> dict:
        """What a forced reply must be: one call of the named function, or a list of calls of
        the given ones (of one call, without parallel calls)."""
        if self.mode == "named":
            return _one_call_schema(self.forced, self.tools[self.forced], "#")
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            _one_call_schema(name, schema, f"#/items/anyOf/{i}") for i, (name, schema) in enumerate(self.tools.items())]}}
        return calls if self.parallel else {**calls, "maxItems": 1}

    @property
    def parser_class(self) -> type[ToolParser] | None:
        """The format replies are read in, or None when they are plain text."""
        if self.constrained:
            return JsonCallParser
        return TOOL_PARSERS[self.auto_parser] if self.mode == "auto" and self.auto_parser else None

    def parser(self) -> ToolParser | None:
        """A fresh parser for one reply, or None when the reply is plain text."""
        cls = self.parser_class
        return cls([self.forced] if self.mode == "named" else self.tools) if cls else None


def tool_plan(tools: list[dict] | None, tool_choice: str | dict | None, auto_parser: str | None = None,
              parallel: bool = True) -> ToolPlan | None:
    """Validate `tools` and `tool_choice` (400 naming the problem); None when there are none.
    `auto_parser`: the parser of "auto" replies when the server enables auto tool choice."""
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
    if tool_choice == "auto" and auto_parser is None:
        raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
    return ToolPlan(schemas, *_choice(tool_choice, schemas), auto_parser=auto_parser, parallel=parallel)


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


def _one_call_schema(name: str, parameters: dict, at: str) -> dict:
    """The schema of one call, to sit at the JSON pointer `at` of the whole reply's schema."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _rebased(parameters, f"{at}/properties/arguments")},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_VALUES = ("const", "enum", "default", "examples")  # keywords whose values are data, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _rebased(schema, base: str):
    """`schema` with its local references ("#" and "#/...") pointing into it at `base`, the JSON
    pointer where it now sits, rather than at the root it was written for."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _VALUES:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names, then schemas: a property may be called "enum"
            out[key] = {name: _rebased(s, base) for name, s in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def template_tools(tools: list[dict] | None, plan: ToolPlan | None) -> list[dict] | None:
    """The tools handed to the chat template (templates that know tools describe them)."""
    return tools if plan is not None and plan.mode != "none" else None

