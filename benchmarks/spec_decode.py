"""Speculative decoding and priority scheduling, each against the engine without it, same run.

1. Code edit: the demo model is given a function from this repository (not in its training data)
   and asked, as a chat request, to rename one of its arguments (prompt = the function, output =
   the function again with the name changed, up to the model's end of turn), greedy, 16 different
   functions of 200-420 characters (the longest edit the demo model was trained on: its training
   windows are 256 tokens and hold the function twice). Output tokens/s
   and mean accepted proposals per verification step with n-gram speculation vs without, at
   batch 1 (one request at a time) and batch 16, also with `disable_by_batch_size: 8` (no
   proposals while more than 8 requests run), and with a draft model: the demo model's first
   `--draft-layers` layers under its own head (an early-exit draft: the same tokenizer, no
   training). Outputs must be identical.
2. No match: random prompts, batch 16: nothing in the prompt to look up, but the demo model's
   output on them repeats itself now and then, so proposals are made and about half of them
   fail: the cost of looking and failing, judged to 3%, over more (short) rounds.
3. Priority: a batch tenant keeps 24 long requests in the engine (max_num_seqs 8) while 8
   interactive requests arrive one by one; p50/p99 TTFT of the interactive ones (in engine steps'
   wall time), FCFS vs --scheduling-policy priority.

Each speed-up is the median of per-round ratios (plain seconds / speculative seconds).

    .venv/bin/python benchmarks/spec_decode.py [--rounds 3] [--no-match-rounds 31] [--draft-layers 1] [--no-priority]
        [--out benchmarks/results/spec_decode.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("PORTCULLIS_CPU_DTYPE", "float32")  # the same dtype on every machine, both sides

from offline_throughput import _cpu_model  # noqa: E402

from portcullis.engine import LLM, SamplingParams  # noqa: E402
from portcullis.engine.assets import DEMO_MODEL_DIR  # noqa: E402
from tools.demo_model import demo_data, demo_eval  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
NGRAM_UP_TO_8 = {**NGRAM, "disable_by_batch_size": 8}
FILES = sorted([*(ROOT / "portcullis" / "engine").glob("*.py"), *(ROOT / "portcullis" / "gateway").glob("*.py")])
OUTPUT = 128  # the no-match workload's output; edits end at the model's end of turn (at most EDIT_MAX)
EDIT_MAX = 256


def early_exit_draft(layers: int, out_dir: Path) -> Path:
    """The demo model cut after its first `layers` layers, its final norm and head kept."""
    from safetensors.torch import load_file, save_file

    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config["num_hidden_layers"] = layers
    kept = {name: t for name, t in load_file(DEMO_MODEL_DIR / "model.safetensors").items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    save_file(kept, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def edit_prompts(tokenizer, count: int = 16) -> list[list[int]]:
    """Rename requests as the demo model's training data phrases them, for the repository's own
    functions in path order (the first `count` that fit), through the chat template."""
    rng, prompts = random.Random(0), []
    for path in FILES:
        for node, source in demo_data.functions(path.read_text()):
            doc = demo_data.edit_example(node, source, rng) if len(source) >= 200 else None
            if doc is None:
                continue
            user = next(seg for seg in doc if isinstance(seg, str) and seg.startswith("user\n"))
            prompts.append(demo_eval.prompt_ids(tokenizer, "chat", user.removeprefix("user\n")))
            if len(prompts) == count:
                return prompts
    raise SystemExit(f"only {len(prompts)} functions of the repository fit the edit workload")


def timed(llm: LLM, prompts, params, batch: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
    return time.perf_counter() - start, outs


def speculation(rounds: int, no_match_rounds: int, draft: Path) -> list[dict]:
    drafted = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    engines = {name: LLM(str(DEMO_MODEL_DIR), max_model_len=2048, kv_cache_memory=1 << 30, speculative_config=spec)
               for name, spec in (("plain", None), ("ngram", NGRAM), ("ngram_up_to_8", NGRAM_UP_TO_8),
                                  ("draft", drafted))}
    rng = random.Random(0)
    workloads = {"code-edit": edit_prompts(engines["plain"].tokenizer),
                 "no-match": [[rng.randrange(3, 4000) for _ in range(600)] for _ in range(16)]}
    params = {"code-edit": SamplingParams(temperature=0, max_tokens=EDIT_MAX),
              "no-match": SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)}
    results = []
    for name, prompts in workloads.items():
        greedy = params[name]
        for batch in ((1, 16) if name == "code-edit" else (16,)):
            seconds: dict[str, list[float]] = {k: [] for k in engines}
            before = {key: _accepted_and_drafts(engines[key]) for key in ("ngram", "draft")}
            for i in range(no_match_rounds if name == "no-match" else rounds):
                # Alternated, in turned order every other round, so all see the same minutes of a
                # shared machine; each round's ratios compare runs seconds apart.
                outputs = {}
                for key in list(engines)[:: 1 if i % 2 == 0 else -1]:
                    took, outputs[key] = timed(engines[key], prompts, greedy, batch)
                    seconds[key].append(took)
                assert all(out == outputs["plain"] for out in outputs.values()), "speculation changed an output"
            tokens = sum(len(out) for out in outputs["plain"])
            ratios = {key: [p / s for p, s in zip(seconds["plain"], seconds[key])] for key in engines if key != "plain"}
            results.append({
                "workload": name, "batch": batch, "rounds": len(seconds["plain"]), "output_tokens": tokens,
                "tokens_per_s": tokens / statistics.median(seconds["plain"]),
                **{f"{key}_speedup": statistics.median(r) for key, r in ratios.items()},
                **{f"{key}_speedup_range": [min(r), max(r)] for key, r in ratios.items()},
                **{f"{key}_mean_accepted_per_verification": _mean_accepted(engines[key], before[key]) for key in before},
            })
            print(json.dumps(results[-1]))
    return results


def _accepted_and_drafts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats
    return stats.spec_num_accepted_tokens, stats.spec_num_drafts


def _mean_accepted(llm: LLM, before: tuple[int, int]) -> float:
    accepted, drafts = (now - then for now, then in zip(_accepted_and_drafts(llm), before))
    return accepted / drafts if drafts else 0.0


def priority(policy: str) -> dict:
    llm = LLM(str(DEMO_MODEL_DIR), max_model_len=1024, kv_cache_memory=1 << 30, max_num_seqs=8,
              scheduling_policy=policy)
    core, rng = llm.engine, random.Random(1)
    batch = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(24):
        core.add_request(f"batch-{i}", [rng.randrange(3, 4000) for _ in range(200)], batch, priority=10 if policy == "priority" else 0)
    arrivals, ttft, step = {}, {}, 0
    while core.has_unfinished_requests():
        if step % 40 == 5 and len(arrivals) < 8:  # an interactive request every 40 steps
            rid = f"ide-{len(arrivals)}"
            core.add_request(rid, [rng.randrange(3, 4000) for _ in range(64)], short)
            arrivals[rid] = time.perf_counter()
        for out in core.step():
            if out.request_id in arrivals and out.request_id not in ttft and out.new_token_ids:
                ttft[out.request_id] = time.perf_counter() - arrivals[out.request_id]
        step += 1
    values = sorted(ttft.values())
    return {"policy": policy, "interactive_ttft_p50_s": statistics.median(values), "interactive_ttft_p99_s": values[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the code-edit workloads")
    ap.add_argument("--no-match-rounds", type=int, default=31,
                    help="rounds of the no-match workload: short runs, judged to 3%%, so more of them")
    ap.add_argument("--draft-layers", type=int, default=1, help="layers of the early-exit draft model")
    ap.add_argument("--no-priority", action="store_true", help="only the speculation workloads")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/spec_decode.json"))
    args = ap.parse_args()
    if args.rounds < 1 or args.no_match_rounds < 1:
        ap.error("--rounds and --no-match-rounds need at least 1 round each")
    with tempfile.TemporaryDirectory() as tmp:
        result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": _cpu_model(),
                  "draft_layers": args.draft_layers, "load_avg_at_start": os.getloadavg(),
                  "speculation": speculation(args.rounds, args.no_match_rounds,
                                             early_exit_draft(args.draft_layers, Path(tmp)))}
    if not args.no_priority:
        result["priority"] = [priority("fcfs"), priority("priority")]
        print(json.dumps(result["priority"]))
    result["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
