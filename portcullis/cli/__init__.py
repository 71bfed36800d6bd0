"""The `portcullis` command line, one module per command.

`gateway`, `keys`, `policy` and `audit` are parsed here (`arguments` holds what they share);
`serve` is the supervisor's (`portcullis.supervisor.serve`), `bench` the benchmark's
(`portcullis.bench.cli`), and `engine ...` is handed to `python -m portcullis.engine` in a fresh
interpreter, so the command line never imports the engine (the gateway's install has no torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from portcullis.cli import audit, gateway, keys, policy

MAIN_EPILOG = """\
first steps:
  portcullis serve                                   engine + gateway; writes a starter policy and key
  portcullis policy check policy.yaml                validate an edit before (or after) saving it
  portcullis keys --policy policy.yaml create --principal alice --tenant default
  portcullis audit --policy policy.yaml --since 24h  who did what; `audit verify` checks the chain

`portcullis COMMAND --help` says more; policies/README.md documents the policy file.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="portcullis", description="Portcullis: LLM serving behind a secure gateway.",
                                     epilog=MAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (gateway, keys, policy, audit):
        command.add_parser(sub)
    sub.add_parser("engine", help="run the inference engine alone (arguments go to `python -m portcullis.engine`)")
    sub.add_parser("serve", help="engine + gateway in one command (`portcullis serve --help`)")
    sub.add_parser("bench", help="benchmark a running server, like `vllm bench serve` (`portcullis bench serve --help`)")
    return parser


ENGINE_EXTRA_MISSING = ("`portcullis {command}` runs the engine, which this install lacks (the base install is the "
                        "gateway alone): pip install 'portcullis-llm[engine]'")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("engine", "serve") and importlib.util.find_spec("torch") is None:
        print(ENGINE_EXTRA_MISSING.format(command=argv[0]), file=sys.stderr)
        return 2
    if argv and argv[0] == "engine":
        os.execv(sys.executable, [sys.executable, "-m", "portcullis.engine", *argv[1:]])
        return 0  # not reached: execv replaces this process
    if argv and argv[0] == "serve":
        from portcullis.supervisor.serve import main as serve

        return serve(argv[1:])
    if argv and argv[0] == "bench":
        from portcullis.bench.cli import main as bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `portcullis audit ... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1

