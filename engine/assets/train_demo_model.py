"""Train the embedded demo model: a byte-level BPE tokenizer and a small Llama, both on the
Python standard library's own source. The default run (2400 steps of 8 x 256 tokens) takes
15-20 minutes on 2 idle CPU cores, longer on a busy machine (38 minutes on a shared one).

    python engine/assets/train_demo_model.py                   # tokenizer + model
    python engine/assets/train_demo_model.py --tokenizer-only  # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "demo-model"
# Test suites and generated tables (codec maps) teach little about how Python reads.
SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "turtledemo", "lib2to3", "encodings", "site-packages",
     "dist-packages", "__pycache__", "ensurepip"}
)
EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_POSITIONS = 2048
FIBONACCI_PROMPT = "def fibonacci(n):"
# Measured with little else running (4,200-5,400 for 8 x 256-token batches, 2 threads); the shared
# machine is slower by a factor that varies, so the card states this rate and the wall time.
IDLE_TOKENS_PER_SECOND = 4800


MODEL_CARD = """\
# Portcullis demo model

A tiny causal language model that ships inside the `engine` package, so that `portcullis serve`
with no model argument serves something real on any machine, offline. It writes Python-looking
code and is not useful for anything else: its greedy continuations are indented, use the right
keywords and mostly parse (`tests/engine/test_demo_model.py` requires more than half of 15
prompts to), but they repeat themselves and mean nothing. Written by
`engine/assets/train_demo_model.py`.

## Architecture

`LlamaForCausalLM` (Hugging Face format, float32 safetensors), {parameters:,} parameters
({parameters_m:.2f} M): hidden size 256, 4 layers, 4 attention heads of head_dim 64 with 2
key-value heads (grouped-query attention), SiLU MLP of intermediate size 640 (not 768, so the
folder stays under 20 MB), RMSNorm eps 1e-5, RoPE theta 10000, max_position_embeddings 2048,
untied input and output embeddings. Trained on windows of {seq_len} tokens only: expect
quality to fall off beyond that.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training files: {vocab_size} tokens, no
normalisation (decoding any encoded text gives back the exact text, UTF-8 included). Special
tokens: `<|endoftext|>` (id 0: end of text, also used as BOS and padding; it separates files in
training), and `<|im_start|>`, `<|im_end|>` for the ChatML chat template in
`tokenizer_config.json`. `generation_config.json` stops on `<|endoftext|>` and `<|im_end|>` and
sets no sampling defaults. The model never saw chat data: chat requests render correctly but
the answers are Python-flavoured noise.

## Data

The `.py` files of the Python {python_version} standard library, sorted by path, without test
suites, `idlelib`, `turtledemo`, `lib2to3`, `encodings` (generated codec tables) and
`ensurepip`. Every {val_every_nth_file}th file is held out for validation: {train_files} training
files ({train_tokens:,} tokens) and {val_files} validation files ({val_tokens:,} tokens). Another
Python version has a slightly different standard library, so a rerun there gives a slightly
different model.

## Training

AdamW (betas 0.9/0.95, weight decay {weight_decay} on matrices only), peak learning rate
{lr:g} with {warmup_steps} warm-up steps and cosine decay to {min_lr_ratio:g}x, gradient
clipping at {grad_clip}, batches of {batch_size} windows of {seq_len} tokens sampled uniformly
from the token stream, seed {seed}. {steps} steps, {tokens_seen:,} tokens seen
({tokens_seen_m:.1f} M), float32, `torch.set_num_threads(2)`. On 2 idle CPU cores training
runs at about {idle_rate:,} tokens/s, so this takes about {idle_minutes:.0f} minutes; on the
shared development machine it took {train_minutes:.0f} minutes of wall time
({cpu_minutes:.0f} CPU-minutes).

| loss (nats/token) | value |
|---|---|
| train (mean of the last 20 steps) | {train_loss:.3f} |
| validation (held-out files) | {val_loss:.3f} |

## Rerun

```
python engine/assets/train_demo_model.py            # 15-20 minutes on 2 idle CPU cores
python engine/assets/train_demo_model.py --help     # steps, seed, batch size, learning rate ...
```

## Example

Greedy decoding, 64 new tokens, prompt `def fibonacci(n):`:

```python
{example}
```
"""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2400
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 400
    eval_windows: int = 64
    vocab_size: int = 4096
    val_every_nth_file: int = 20


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted so every run sees the same order."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_sources(paths: Sequence[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files use legacy encodings; skipping them keeps the data UTF-8
    return texts


def split_train_val(docs: list[str], every: int) -> tuple[list[str], list[str]]:
    """Hold out whole files, so validation measures code the model has never read."""
    val = [d for i, d in enumerate(docs) if i % every == every - 1]
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    return train, val


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: any text change would break decode(encode(s)) == s.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> PreTrainedTokenizerFast:
    """Write the files by hand: save_pretrained in transformers 5 names a class and moves the
    chat template to a side file that transformers 4 and other tools do not read."""
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS,
               "additional_special_tokens": list(SPECIAL_TOKENS[1:])}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": MAX_POSITIONS,
        # Cleaning up spaces before punctuation would corrupt decoded source code.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return AutoTokenizer.from_pretrained(out)


def encode_stream(tokenizer: Tokenizer, docs: Sequence[str]) -> np.ndarray:
    """One token stream, files separated by EOS so the model learns where a file starts."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(docs)):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def model_config(vocab_size: int, eos_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        # 640 rather than 768 keeps the float32 weights, and so the folder, under 20 MB.
        intermediate_size=640,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )


def sample_batch(
    stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    windows = np.stack([stream[s : s + seq_len + 1] for s in starts])
    tokens = torch.from_numpy(windows).long()
    return tokens[:, :-1], tokens[:, 1:]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def lm_loss(model: LlamaForCausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: np.ndarray, cfg: TrainConfig) -> float:
    """Mean loss over fixed, evenly spaced windows, so evaluations are comparable."""
    model.eval()
    n = min(cfg.eval_windows, (len(stream) - 1) // cfg.seq_len)
    starts = np.linspace(0, len(stream) - cfg.seq_len - 1, n).astype(np.int64)
    losses = []
    for chunk in np.array_split(starts, max(1, n // cfg.batch_size)):
        windows = np.stack([stream[s : s + cfg.seq_len + 1] for s in chunk])
        tokens = torch.from_numpy(windows).long()
        losses.append(lm_loss(model, tokens[:, :-1], tokens[:, 1:]).item() * len(chunk))
    model.train()
    return sum(losses) / n


def make_optimizer(model: LlamaForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    # Norm gains are scales, not features: decaying them towards zero only hurts.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(
    model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: tuple, lr: float, clip: float
) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = lm_loss(model, *batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.item()


def train(
    model: LlamaForCausalLM,
    train_stream: np.ndarray,
    val_stream: np.ndarray,
    cfg: TrainConfig,
    log: Callable[[str], None],
) -> dict:
    rng = np.random.default_rng(cfg.seed)
    optimizer = make_optimizer(model, cfg)
    model.train()
    start, cpu_start, recent = time.perf_counter(), time.process_time(), []
    for step in range(cfg.steps):
        batch = sample_batch(train_stream, cfg.batch_size, cfg.seq_len, rng)
        loss = train_step(model, optimizer, batch, lr_at(step, cfg), cfg.grad_clip)
        recent = (recent + [loss])[-20:]
        if (step + 1) % 10 == 0 or step == 0:
            rate = (step + 1) / (time.perf_counter() - start)
            log(f"step {step + 1}/{cfg.steps} loss {recent[-1]:.3f} "
                f"lr {lr_at(step, cfg):.2e} {rate:.2f} steps/s")
        if (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            log(f"step {step + 1} val_loss {evaluate(model, val_stream, cfg):.3f}")
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "train_loss": sum(recent) / len(recent),
        "val_loss": evaluate(model, val_stream, cfg),
        "train_seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
    }


def save_model(model: LlamaForCausalLM, out: Path, eos_ids: list[int]) -> None:
    model.save_pretrained(out, safe_serialization=True)
    # No sampling defaults: clients that ask for greedy decoding must get greedy decoding.
    generation = GenerationConfig(
        bos_token_id=eos_ids[0], eos_token_id=eos_ids, pad_token_id=eos_ids[0]
    )
    generation.save_pretrained(out)


def greedy_completion(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, new_tokens: int = 64
) -> str:
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def write_model_card(out: Path, cfg: TrainConfig, stats: dict) -> None:
    card = MODEL_CARD.format(
        **stats,
        **asdict(cfg),
        parameters_m=stats["parameters"] / 1e6,
        tokens_seen_m=stats["tokens_seen"] / 1e6,
        train_minutes=stats["train_seconds"] / 60,
        cpu_minutes=stats["cpu_seconds"] / 60,
        idle_rate=IDLE_TOKENS_PER_SECOND,
        idle_minutes=stats["tokens_seen"] / IDLE_TOKENS_PER_SECOND / 60,
    )
    (out / "README.md").write_text(card)


def parse_args(argv: Sequence[str]) -> tuple[Path, TrainConfig, bool]:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="train and save the tokenizer, then stop")
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out, tokenizer_only = args.pop("output_dir"), args.pop("tokenizer_only")
    return out, TrainConfig(**args), tokenizer_only


def main(argv: Sequence[str] | None = None) -> int:
    out, cfg, tokenizer_only = parse_args(sys.argv[1:] if argv is None else argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    torch.set_num_threads(2)  # the target is a 2-core machine; more threads only contend there
    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, val_docs = split_train_val(read_sources(stdlib_sources()), cfg.val_every_nth_file)
    log(f"{len(train_docs)} train files, {len(val_docs)} validation files")
    started = time.perf_counter()
    tokenizer = train_tokenizer(train_docs, cfg.vocab_size)
    wrapped = save_tokenizer(tokenizer, out)
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - started:.0f}s")
    if tokenizer_only:
        return 0
    train_stream = encode_stream(tokenizer, train_docs)
    val_stream = encode_stream(tokenizer, val_docs)
    log(f"{len(train_stream):,} train tokens, {len(val_stream):,} validation tokens")
    eos_ids = [tokenizer.token_to_id(t) for t in (EOS, "<|im_end|>")]
    model = LlamaForCausalLM(model_config(tokenizer.get_vocab_size(), eos_ids[0]))
    stats = train(model, train_stream, val_stream, cfg, log)
    save_model(model, out, eos_ids)
    stats |= {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_files": len(train_docs), "val_files": len(val_docs),
        "train_tokens": len(train_stream), "val_tokens": len(val_stream),
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "example": greedy_completion(model, wrapped, FIBONACCI_PROMPT),
    }
    log(json.dumps(stats, indent=2))
    write_model_card(out, cfg, stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
