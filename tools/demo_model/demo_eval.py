"""How the demo model is judged (issue 21): greedy outputs for the held-out prompts of
demo_eval_prompts.json, each checked with `ast`. The rules were fixed before the model they
judge was trained; the trainer reports the score and tests/engine/test_demo_model.py holds the
shipped model to it through the engine.

- completion: the prompt plus its continuation, cut where the definition ends (the first
  non-blank line back at column 0 after the body began) or, when the output ran out, after its
  last complete line (less a block header or decorator left without its body), must parse, and the prompt's def or class must hold at least one real
  statement (a docstring, `pass` or `...` alone does not count);
- chat: the reply's first code block (or the whole reply when it has no fence) must parse and
  define a function with a real statement in it;
- fim: prefix + middle + suffix must parse, and the middle must not be blank.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Sequence
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "demo_eval_prompts.json"
MAX_TOKENS = {"completion": 128, "chat": 160, "fim": 48}
# The bar for completions; chat and FIM each need 3 of their 5.
PASS_RATE = {"completion": 0.8, "chat": 0.6, "fim": 0.6}


def prompts() -> dict[str, list]:
    data = json.loads(PROMPTS_FILE.read_text())
    return {kind: data[kind] for kind in MAX_TOKENS}


def _real(body: Sequence[ast.stmt]) -> bool:
    """A body that does something: not only a docstring, `pass` or `...`."""
    for stmt in body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, (str, type(...))):
            continue
        return True
    return False


def _parses(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def cut_definition(prompt: str, continuation: str, finished: bool) -> str:
    """The prompt and the part of its continuation that belongs to the prompt's last definition."""
    lines = continuation.splitlines(keepends=True)
    if not finished:
        if lines and not lines[-1].endswith("\n"):
            lines.pop()  # the output ran out mid-line: judge the whole lines before it
        # ... and a block or decorator it opened but had no tokens left to fill
        while lines and (not lines[-1].strip() or lines[-1].rstrip().endswith(":") or lines[-1].lstrip().startswith("@")):
            lines.pop()
    kept, in_body = [], False
    text_so_far = prompt
    for line in lines:
        starts_line = text_so_far.endswith("\n")
        if starts_line and line.strip() and not line[0].isspace() and in_body:
            break  # back at column 0: the definition ended
        if starts_line and line.strip() and line[0].isspace():
            in_body = True
        kept.append(line)
        text_so_far += line
    return prompt + "".join(kept)


def completion_ok(prompt: str, continuation: str, finished: bool = False) -> bool:
    tree = _parses(cut_definition(prompt, continuation, finished))
    if tree is None:
        return False
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return bool(defs) and _real(defs[-1].body)


def code_of(reply: str) -> str:
    """The first fenced code block of a chat reply (to its end if unclosed), else the reply."""
    if "```" not in reply:
        return reply
    block = reply.split("```", 2)[1]
    first, _, rest = block.partition("\n")
    return rest if first.strip().isidentifier() or not first.strip() else block


def chat_ok(reply: str) -> bool:
    code = code_of(reply)
    tree = _parses(code) or _parses(code[: code.rfind("\n") + 1])  # an unfinished last line dropped
    if tree is None:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _real(n.body) for n in ast.walk(tree))


def fim_ok(prefix: str, middle: str, suffix: str) -> bool:
    return bool(middle.strip()) and _parses(prefix + middle + suffix) is not None


def score(generate: Callable[[str, list], tuple[str, bool]]) -> dict:
    """generate(kind, item) -> (text, finished): kind is completion (item a prompt), chat (a user
    message) or fim ([prefix, suffix]); finished says the model stopped on its own."""
    results: dict[str, list[bool]] = {}
    outputs: dict[str, list[str]] = {}
    for kind, items in prompts().items():
        outputs[kind], results[kind] = [], []
        for item in items:
            text, finished = generate(kind, item)
            outputs[kind].append(text)
            if kind == "completion":
                results[kind].append(completion_ok(item, text, finished))
            elif kind == "chat":
                results[kind].append(chat_ok(text))
            else:
                results[kind].append(fim_ok(item[0], text, item[1]))
    return {
        "passed": {kind: sum(r) for kind, r in results.items()},
        "total": {kind: len(r) for kind, r in results.items()},
        "ok": all(sum(r) >= PASS_RATE[kind] * len(r) for kind, r in results.items()),
        "results": results, "outputs": outputs,
    }


def prompt_ids(tokenizer, kind: str, item) -> list[int]:
    """The token ids a user's request becomes: plain text, the chat template, or Qwen's FIM form."""
    text = lambda s: tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)  # noqa: E731
    if kind == "completion":
        return text(item)
    if kind == "chat":
        ids = tokenizer.apply_chat_template([{"role": "user", "content": item}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    marker = tokenizer.convert_tokens_to_ids
    return [marker("<|fim_prefix|>"), *text(item[0]), marker("<|fim_suffix|>"), *text(item[1]),
            marker("<|fim_middle|>")]
