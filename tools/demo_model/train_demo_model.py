"""Train the embedded demo model: a byte-level BPE tokenizer and a small Llama on the Python
standard library and the pure-Python sources of this project's dependencies (see demo_data.py),
with chat and fill-in-the-middle documents mixed in. Weights are saved in bfloat16.

    python tools/demo_model/train_demo_model.py                   # about an hour on 2 CPU cores
    python tools/demo_model/train_demo_model.py --resume          # continue an interrupted run
    python tools/demo_model/train_demo_model.py --tokenizer-only  # under a minute
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: demo_data is beside it
import demo_data  # noqa: E402
from demo_data import EOS, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, IM_END, SPECIAL_TOKENS, Doc, Mark  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parents[1] / "portcullis" / "engine" / "assets" / "demo-model"  # shipped in the package
DEFAULT_CHECKPOINT = HERE / ".train-checkpoint"  # ignored by git (.gitignore here)
PROMPTS_FILE = HERE / "demo_eval_prompts.json"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_POSITIONS = 2048
EXAMPLE_PROMPT = "def fibonacci(n):"
EXAMPLE_CHAT = "Write a Python function that reverses a list"
EXAMPLE_FIM = ("def total(prices):\n    result = 0\n    for price in prices:\n", "    return result\n")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 7000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 500
    eval_windows: int = 96
    checkpoint_every: int = 250
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    intermediate_size: int = 704
    val_every_nth_file: int = 20
    instruct_share: float = 0.6  # of documented functions made into docstring -> function chats
    fim_per_file: int = 2


# --- tokenizer -----------------------------------------------------------------------------------

# GPT-2's pre-tokenizer, except that every newline is a token of its own, never glued to the
# indentation after it (GPT-2) or the punctuation before it (Qwen2): a prompt that ends with
# "):\n" or with "):" then ends on a boundary that training text has too. With GPT-2's split, a
# prompt ending in a newline made the model start a new top-level line (or stop) instead of a body.
PRE_TOKENS = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\r?\n|\r|[^\S\r\n]+(?!\S)|[^\S\r\n]+"""

def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: any text change would break decode(encode(s)) == s.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
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


def encode_stream(tokenizer: Tokenizer, docs: Sequence[Doc]) -> np.ndarray:
    """One token stream, documents separated by EOS. Text segments are encoded with special
    tokens split (a source file that mentions `<|im_end|>` stays text); Marks are the tokens."""
    texts = [seg for doc in docs for seg in doc if not isinstance(seg, Mark)]
    tokenizer.encode_special_tokens = True
    try:
        encoded = iter(tokenizer.encode_batch(texts))
    finally:
        tokenizer.encode_special_tokens = False
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for doc in docs:
        for seg in doc:
            if isinstance(seg, Mark):
                ids.append(tokenizer.token_to_id(seg))
            else:
                ids.extend(next(encoded).ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


# --- data ----------------------------------------------------------------------------------------

def held_out_prompts() -> list[str]:
    return json.loads(PROMPTS_FILE.read_text())["completion"]


def build_data(cfg: TrainConfig, log: Callable[[str], None]) -> tuple[Tokenizer, np.ndarray, np.ndarray, dict]:
    files = demo_data.source_files()
    train_files, val_files = demo_data.split_files(files, cfg.val_every_nth_file, held_out_prompts())
    origins = sorted({f.origin for f in files if f.origin != "stdlib"}, key=str.lower)
    log(f"{len(train_files)} train files, {len(val_files)} validation files, "
        f"{sum(len(f.text) for f in files) / 1e6:.1f} MB, dependencies: {', '.join(origins)}")
    started = time.perf_counter()
    tokenizer = train_tokenizer([f.text for f in train_files], cfg.vocab_size)
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - started:.0f}s")
    shaped = demo_data.shaped_documents(train_files, cfg.seed, cfg.instruct_share, cfg.fim_per_file)
    docs: list[Doc] = [(f.text,) for f in train_files] + [d for kind in shaped.values() for d in kind]
    random.Random(cfg.seed).shuffle(docs)  # chat and FIM documents spread through the stream
    train_stream = encode_stream(tokenizer, docs)
    val_stream = encode_stream(tokenizer, [(f.text,) for f in val_files])
    info = {
        "train_files": len(train_files), "val_files": len(val_files), "dependencies": origins,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "train_tokens": len(train_stream), "val_tokens": len(val_stream),
        "shaped": {kind: len(d) for kind, d in shaped.items()},
        "shaped_tokens": {kind: int(sum(len(s) for d in ds for s in d if not isinstance(s, Mark)) / 3.5)
                          for kind, ds in shaped.items()},  # rough: 3.5 characters per token
    }
    log(f"{len(train_stream):,} train tokens, {len(val_stream):,} validation tokens, shaped {info['shaped']}")
    return tokenizer, train_stream, val_stream, info


# --- model and training --------------------------------------------------------------------------

def model_config(cfg: TrainConfig, vocab_size: int, eos_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.hidden_size // 64,
        num_key_value_heads=max(1, cfg.hidden_size // 128),
        head_dim=64,
        intermediate_size=cfg.intermediate_size,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="bfloat16",
    )


def autocast_dtype(choice: str, cfg: TrainConfig, log: Callable[[str], None]) -> torch.dtype:
    """bf16 autocast where this CPU runs bf16 matmuls clearly faster (the engine's own probe),
    else float32: on some of these CPUs bf16 is 3-4x faster, on others 250x slower."""
    if choice != "auto":
        return getattr(torch, choice)
    from portcullis.engine.cpu_dtype import choose_cpu_dtype

    decided = choose_cpu_dtype(cfg.hidden_size, cfg.intermediate_size)
    log(f"compute dtype {decided.dtype} ({decided.reason}, bf16 speed-up {decided.bf16_speedup})")
    return decided.dtype


def sample_batch(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> tuple:
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    tokens = torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts])).long()
    return tokens[:, :-1], tokens[:, 1:]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def lm_loss(model: LlamaForCausalLM, inputs: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: np.ndarray, cfg: TrainConfig, dtype: torch.dtype) -> float:
    """Mean loss over fixed, evenly spaced windows, so evaluations are comparable."""
    model.eval()
    n = min(cfg.eval_windows, (len(stream) - 1) // cfg.seq_len)
    starts = np.linspace(0, len(stream) - cfg.seq_len - 1, n).astype(np.int64)
    total = 0.0
    for chunk in np.array_split(starts, max(1, n // cfg.batch_size)):
        tokens = torch.from_numpy(np.stack([stream[s : s + cfg.seq_len + 1] for s in chunk])).long()
        total += lm_loss(model, tokens[:, :-1], tokens[:, 1:], dtype).item() * len(chunk)
    model.train()
    return total / n


def make_optimizer(model: LlamaForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    # Norm gains are scales, not features: decaying them towards zero only hurts.
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass
class RunState:
    """What a checkpoint holds besides weights and optimizer: enough to continue exactly."""

    step: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    recent: list[float] | None = None
    curve: list[dict] | None = None  # one entry per evaluation: the loss curve in the card
    rng_state: dict | None = None


# A resumed run may change these: its length (the cosine schedule follows the new length, so a
# run that must end sooner can be shortened midway) and how often it reports and saves.
RESUMABLE = frozenset({"steps", "eval_every", "checkpoint_every"})


class Checkpoints:
    """The run's data and latest state in one ignored folder, written atomically."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def save_data(self, tokenizer: Tokenizer, train: np.ndarray, val: np.ndarray, info: dict, cfg: TrainConfig) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(self.folder / "tokenizer.json"))
        np.save(self.folder / "train.npy", train)
        np.save(self.folder / "val.npy", val)
        (self.folder / "data.json").write_text(json.dumps({"info": info, "config": asdict(cfg)}, indent=1))
        (self.folder / "state.pt").unlink(missing_ok=True)

    def load_data(self, cfg: TrainConfig) -> tuple[Tokenizer, np.ndarray, np.ndarray, dict]:
        saved = json.loads((self.folder / "data.json").read_text())
        changed = sorted(k for k, v in asdict(cfg).items() if saved["config"].get(k) != v and k not in RESUMABLE)
        if changed:
            raise SystemExit(f"--resume: the checkpoint in {self.folder} was made with other "
                             f"settings ({', '.join(changed)}); rerun with those or start afresh")
        tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        return tokenizer, np.load(self.folder / "train.npy"), np.load(self.folder / "val.npy"), saved["info"]

    def save_state(self, model, optimizer, state: RunState) -> None:
        tmp = self.folder / "state.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "run": asdict(state)}, tmp)
        tmp.replace(self.folder / "state.pt")

    def load_state(self, model, optimizer) -> RunState:
        path = self.folder / "state.pt"
        if not path.exists():
            return RunState()
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        return RunState(**saved["run"])


def train(model, train_stream, val_stream, cfg: TrainConfig, dtype, ckpt: Checkpoints, resume: bool, log) -> dict:
    optimizer = make_optimizer(model, cfg)
    run = ckpt.load_state(model, optimizer) if resume else RunState()
    rng = np.random.default_rng(cfg.seed)
    if run.rng_state:
        rng.bit_generator.state = run.rng_state
        log(f"resumed at step {run.step}")
    recent, curve = run.recent or [], run.curve or []
    start, cpu_start, done_before = time.perf_counter(), time.process_time(), run.step
    model.train()
    for step in range(run.step, cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = lm_loss(model, *sample_batch(train_stream, cfg.batch_size, cfg.seq_len, rng), dtype)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        recent = (recent + [loss.item()])[-50:]
        elapsed = run.seconds + time.perf_counter() - start
        if (step + 1) % 10 == 0:
            rate = (step + 1 - done_before) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - start)
            eta = (cfg.steps - step - 1) * cfg.batch_size * cfg.seq_len / rate / 60
            log(f"step {step + 1}/{cfg.steps} loss {sum(recent[-10:]) / len(recent[-10:]):.3f} "
                f"lr {lr_at(step, cfg):.2e} {rate:,.0f} tokens/s, {elapsed / 60:.1f} min, ~{eta:.0f} min left")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            curve.append({"step": step + 1, "tokens": (step + 1) * cfg.batch_size * cfg.seq_len,
                          "train_loss": sum(recent) / len(recent),
                          "val_loss": evaluate(model, val_stream, cfg, dtype), "minutes": elapsed / 60})
            log(f"step {step + 1} val_loss {curve[-1]['val_loss']:.3f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            run = RunState(step + 1, elapsed, run.cpu_seconds + time.process_time() - cpu_start,
                           recent, curve, rng.bit_generator.state)
            start, cpu_start, done_before = time.perf_counter(), time.process_time(), step + 1
            ckpt.save_state(model, optimizer, run)
    return {"train_loss": curve[-1]["train_loss"], "val_loss": curve[-1]["val_loss"], "curve": curve,
            "train_seconds": run.seconds, "cpu_seconds": run.cpu_seconds,
            "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len}


def save_model(model: LlamaForCausalLM, out: Path, eos_ids: list[int]) -> None:
    """bfloat16 on disk: half the bytes of float32, so twice the parameters fit in 20 MB."""
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    generation_config(eos_ids).save_pretrained(out)


# Qwen2.5-Coder-Instruct's value, against the loops ("path.path.path...") that a model this
# small falls into under greedy decoding. The engine's server applies it as a default (a
# request's own repetition_penalty wins), and so does transformers' generate.
REPETITION_PENALTY = 1.1


def generation_config(eos_ids: list[int]) -> GenerationConfig:
    # No temperature or top-k: a client that asks for greedy decoding gets greedy decoding.
    return GenerationConfig(bos_token_id=eos_ids[0], eos_token_id=eos_ids, pad_token_id=eos_ids[0],
                            repetition_penalty=REPETITION_PENALTY)


# --- model card ----------------------------------------------------------------------------------

def greedy(model, tokenizer, ids: list[int], new_tokens: int = 96) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def card_examples(out: Path) -> dict:
    """Greedy outputs of the saved folder as transformers loads it (so as a user sees them)."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": EXAMPLE_CHAT}], add_generation_prompt=True)
    prefix, suffix = EXAMPLE_FIM
    marker = tokenizer.convert_tokens_to_ids
    text = lambda s: tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)  # noqa: E731
    fim = [marker(FIM_PREFIX), *text(prefix), marker(FIM_SUFFIX), *text(suffix), marker(FIM_MIDDLE)]
    return {
        "completion": EXAMPLE_PROMPT + greedy(model, tokenizer, text(EXAMPLE_PROMPT), 64),
        "chat": greedy(model, tokenizer, list(chat["input_ids"] if hasattr(chat, "keys") else chat), 128),
        "fim_middle": greedy(model, tokenizer, fim, 32),
        "chat_prompt": EXAMPLE_CHAT, "fim_prefix": prefix.rstrip("\n"), "fim_suffix": suffix.rstrip("\n"),
    }


def judged(out: Path) -> dict:
    """demo_eval's score of the saved folder, greedy as served (the folder's generation config,
    which HF's generate and the engine's server both apply) and with the repetition penalty off."""
    import demo_eval  # beside this file

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    eos = set(model.generation_config.eos_token_id)

    def generate(kind: str, item, **options) -> tuple[str, bool]:
        ids = demo_eval.prompt_ids(tokenizer, kind, item)
        with torch.no_grad():
            new = model.generate(torch.tensor([ids]), max_new_tokens=demo_eval.MAX_TOKENS[kind], do_sample=False,
                                 **options)[0, len(ids):]
        return tokenizer.decode(new, skip_special_tokens=True), bool(len(new)) and int(new[-1]) in eos

    served = demo_eval.score(generate)
    plain = demo_eval.score(lambda kind, item: generate(kind, item, repetition_penalty=1.0))
    return {"judged_passed": served["passed"], "judged_total": served["total"], "judged_ok": served["ok"],
            "judged_plain_passed": plain["passed"]}


def write_model_card(out: Path, cfg: TrainConfig, stats: dict) -> None:
    from card import render  # beside this file: the card's text is long enough for its own module

    (out / "README.md").write_text(render(cfg, stats))


# --- command line --------------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--checkpoint-dir", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint folder")
    parser.add_argument("--tokenizer-only", action="store_true", help="build data and tokenizer, then stop")
    parser.add_argument("--card-only", action="store_true",
                        help="rewrite the model card from the finished run's stats in the checkpoint folder")
    parser.add_argument("--judge", action="store_true", help="with --card-only: score the saved model again first")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="compute dtype (autocast); auto: bfloat16 where this CPU runs it faster")
    for field, value in asdict(TrainConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})

    def log(msg: str) -> None:
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    torch.set_num_threads(2)  # the target is a 2-core machine; more threads only contend there
    torch.manual_seed(cfg.seed)
    ckpt = Checkpoints(args.checkpoint_dir)
    if args.card_only:
        if args.judge:  # the folder's generation config rewritten too, then scored again
            stats_file = args.checkpoint_dir / "stats.json"
            stats = json.loads(stats_file.read_text())
            eos_ids = AutoTokenizer.from_pretrained(args.output_dir).convert_tokens_to_ids([EOS, IM_END])
            generation_config(eos_ids).save_pretrained(args.output_dir)
            stats |= {"repetition_penalty": REPETITION_PENALTY, **judged(args.output_dir)}
            stats_file.write_text(json.dumps(stats, indent=1))
        write_model_card(args.output_dir, cfg, json.loads((args.checkpoint_dir / "stats.json").read_text()))
        return 0
    if args.resume:
        tokenizer, train_stream, val_stream, info = ckpt.load_data(cfg)
    else:
        tokenizer, train_stream, val_stream, info = build_data(cfg, log)
        ckpt.save_data(tokenizer, train_stream, val_stream, info, cfg)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, args.output_dir)
    if args.tokenizer_only:
        return 0
    eos_ids = [tokenizer.token_to_id(t) for t in (EOS, IM_END)]
    # float32 master weights whatever the config says: bf16 is for the matmuls and the file.
    model = LlamaForCausalLM(model_config(cfg, tokenizer.get_vocab_size(), eos_ids[0])).float()
    dtype = autocast_dtype(args.dtype, cfg, log)
    stats = train(model, train_stream, val_stream, cfg, dtype, ckpt, args.resume, log)
    save_model(model, args.output_dir, eos_ids)
    stats |= info | {"parameters": sum(p.numel() for p in model.parameters()),
                     "compute_dtype": str(dtype).removeprefix("torch."), **card_examples(args.output_dir),
                     "repetition_penalty": REPETITION_PENALTY, **judged(args.output_dir)}
    log(json.dumps({k: v for k, v in stats.items() if k != "curve"}, indent=1))
    (args.checkpoint_dir / "stats.json").write_text(json.dumps(stats, indent=1))
    write_model_card(args.output_dir, cfg, stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
