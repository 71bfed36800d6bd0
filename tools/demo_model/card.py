"""The demo model's card (demo-model/README.md), rendered from a finished training run."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

CARD = """\
# Portcullis demo model

A toy causal language model that ships inside the `engine` package, so that `portcullis serve`
with no model argument serves something real on any machine, offline. It continues Python code,
answers "Write a Python function that ..." with a function, and fills in the middle of code,
in that order of (modest) skill. It is {parameters_m:.1f} M parameters trained for about an hour on
two CPU cores: its code often parses but seldom does what was asked. For real work serve a real
model, e.g. `portcullis serve Qwen/Qwen2.5-Coder-1.5B-Instruct` or a local Hugging Face folder.
Written by `tools/demo_model/train_demo_model.py` (data: `tools/demo_model/demo_data.py`).
`tests/engine/test_demo_model.py` holds it to prompts fixed before training
(`tools/demo_model/demo_eval_prompts.json`): greedy continuations of 30 function signatures, class
headers and imports followed by a def must parse with a body of at least one statement in 80% of
cases, 3 of 5 chat requests must get a function back, and each of 5 fill-in-the-middle holes
must get a middle (that the filled file parses is only an aim: see "Held-out prompts").

## Architecture

`LlamaForCausalLM` (Hugging Face format, bfloat16 safetensors), {parameters:,} parameters:
hidden size {hidden_size}, {num_layers} layers, {heads} attention heads of head_dim 64 with
{kv_heads} key-value heads (grouped-query attention), SiLU MLP of intermediate size
{intermediate_size}, RMSNorm eps 1e-5, RoPE theta 10000, max_position_embeddings 2048, untied
input and output embeddings. Trained on windows of {seq_len} tokens only: expect quality to fall
off beyond that.

## Tokenizer and prompt formats

Byte-level BPE trained with `tokenizers` on the training files: {vocab_size} tokens, no
normalisation (decoding any encoded text gives back the exact text, UTF-8 included). Special
tokens: `<|endoftext|>` (id 0: end of text, also BOS and padding), `<|im_start|>` and
`<|im_end|>` (ChatML, the chat template in `tokenizer_config.json`), `<|fim_prefix|>`,
`<|fim_suffix|>`, `<|fim_middle|>` (fill-in-the-middle as Qwen2.5-Coder writes it, PSM order:
`<|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>` and the model writes the middle, then
`<|endoftext|>`). `generation_config.json` stops on `<|endoftext|>` and `<|im_end|>` and sets a
repetition penalty of {repetition_penalty}, no temperature or top-k: greedy requests stay greedy.

## Data

Rebuilt from what is installed, without a network: the `.py` files of the Python
{python_version} standard library and of this project's runtime dependencies, transitively
({n_dependencies} distributions: {dependencies}), without test suites, vendored copies, files
over 80 KB (mostly generated) or more than 1.5 MB per distribution (picked in a fixed
pseudo-random order of paths, so torch, transformers and sympy do not crowd out the rest),
de-duplicated by content and sorted. Every {val_every_nth_file}th file is held out for
validation, and so is every file that contains one of the test's held-out prompts
(`tools/demo_model/demo_eval_prompts.json`, written before training): {train_files:,} training
files and {val_files} validation files ({val_tokens:,} tokens).

Mixed into the training stream ({train_tokens:,} tokens in all), made from training files only:

| documents | count | about |
|---|---|---|
| chat, docstring -> function ("Write a Python function that returns ...", answer in a `python` code block) | {instruct:,} | {instruct_tokens:,} tokens |
| chat, "Rename `x` to `y` in this function:" -> the whole function edited | {edit:,} | {edit_tokens:,} tokens |
| fill-in-the-middle (a hole of part of a line to five lines, up to 12 lines each side) | {fim:,} | {fim_tokens:,} tokens |

Other Python versions and dependency versions give slightly different data, so a rerun
elsewhere gives a slightly different model.

## Training

AdamW (betas 0.9/0.95, weight decay {weight_decay} on matrices only), peak learning rate
{lr:g} with {warmup_steps} warm-up steps and cosine decay to {min_lr_ratio:g}x, gradient
clipping at {grad_clip}, batches of {batch_size} windows of {seq_len} tokens sampled uniformly
from the token stream, seed {seed}. {steps:,} steps, {tokens_seen:,} tokens seen
({tokens_seen_m:.1f} M), float32 weights with {compute_dtype} autocast (bf16 only where the
CPU runs it faster: the engine's own probe), `torch.set_num_threads(2)`. It took
{train_minutes:.0f} minutes of wall time ({cpu_minutes:.0f} CPU-minutes, {tokens_per_second:,.0f}
tokens/s) on a shared 2-core AMD EPYC machine with bf16 instructions, other jobs running beside
it and the trainer at raised priority, plus about 3 minutes to build the data and tokenizer; an
idle machine of the kind is faster. A CPU without fast bf16 trains in float32, about 1.7 times
slower (measured on that machine).

Loss (nats per token) as the run went; validation is {eval_windows} fixed windows of the held-out
files (plain code only):

| step | tokens seen | minutes | train (mean of last 50 steps) | validation |
|---|---|---|---|---|
{curve_rows}

## Rerun

```
python tools/demo_model/train_demo_model.py            # about an hour on 2 CPU cores
python tools/demo_model/train_demo_model.py --resume   # continue an interrupted run
python tools/demo_model/train_demo_model.py --help     # steps, seed, sizes, learning rate ...
```

Progress lines say the step, loss, tokens/s and minutes left; a checkpoint every
{checkpoint_every} steps goes to `portcullis/engine/assets/.train-checkpoint/` (ignored by git).

## Held-out prompts

Greedy outputs for the prompts of `tools/demo_model/demo_eval_prompts.json`, fixed before training
and kept out of its data, judged by `tools/demo_model/demo_eval.py` with `ast`: {judged_completion}
completions of a function or class header parse with a real statement in the body (target
80%), {judged_chat} chat requests "Write a Python function that ..." get a function back,
{judged_fim} fill-in-the-middle holes are filled so that the file parses (the aim is 3 of 5 for
each; fill-in-the-middle misses it).
That is greedy decoding as served: `generation_config.json` sets a repetition penalty of
{repetition_penalty} (Qwen2.5-Coder-Instruct's), which `portcullis serve` and transformers' `generate`
apply unless a request sets its own. With the penalty off (`repetition_penalty: 1`) the same
prompts give {plain_completion}, {plain_chat} and {plain_fim}.

## Examples

Greedy decoding of the saved folder with `transformers`.

Completion, prompt `def fibonacci(n):`, 64 new tokens:

```python
{completion}
```

Chat, "{chat_prompt}", 128 new tokens at most:

{chat}

Fill in the middle, 32 new tokens at most, prefix and suffix:

```python
{fim_prefix}
```
```python
{fim_suffix}
```

middle written:

```python
{fim_middle}
```
"""


def curve_rows(curve: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"| {c['step']:,} | {c['tokens'] / 1e6:.1f} M | {c['minutes']:.0f} | {c['train_loss']:.3f} | "
        f"{c['val_loss']:.3f} |" for c in curve
    )


def render(cfg: Any, stats: dict[str, Any]) -> str:
    shaped, shaped_tokens = stats["shaped"], stats["shaped_tokens"]
    return CARD.format(
        **asdict(cfg),
        **{k: v for k, v in stats.items() if k not in ("shaped", "shaped_tokens", "chat", "dependencies", "judged_passed", "judged_total", "judged_plain_passed", "repetition_penalty")},
        **shaped,
        **{f"{k}_tokens": v for k, v in shaped_tokens.items()},
        parameters_m=stats["parameters"] / 1e6,
        heads=cfg.hidden_size // 64,
        kv_heads=max(1, cfg.hidden_size // 128),
        n_dependencies=len(stats["dependencies"]),
        dependencies=", ".join(stats["dependencies"]),
        tokens_seen_m=stats["tokens_seen"] / 1e6,
        train_minutes=stats["train_seconds"] / 60,
        tokens_per_second=stats["tokens_seen"] / stats["train_seconds"],
        cpu_minutes=stats["cpu_seconds"] / 60,
        curve_rows=curve_rows(stats["curve"]),
        **{f"judged_{kind}": f"{stats['judged_passed'][kind]} of {stats['judged_total'][kind]}"
           for kind in ("completion", "chat", "fim")},
        **{f"plain_{kind}": f"{stats['judged_plain_passed'][kind]} of {stats['judged_total'][kind]}"
           for kind in ("completion", "chat", "fim")},
        repetition_penalty=stats.get("repetition_penalty", 1.1),
        chat="\n".join("> " + line for line in stats["chat"].splitlines()) or "> (nothing)",
    )
