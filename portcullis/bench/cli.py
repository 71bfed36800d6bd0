"""`portcullis bench ...`: the benchmark commands' parser; `portcullis` hands `bench` here."""
from __future__ import annotations

import argparse
import sys

from portcullis.bench.errors import BenchError


def build_parser() -> argparse.ArgumentParser:
    from portcullis.bench import serve

    parser = argparse.ArgumentParser(prog="portcullis bench", description="Benchmark a running server.")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("serve", help="load a server over HTTP and report throughput and latency, as "
                       "`vllm bench serve` does", description=serve.__doc__, epilog=serve.EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_arguments(p)
    p.set_defaults(func=serve.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except BenchError as exc:
        print(f"portcullis bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("portcullis bench: interrupted", file=sys.stderr)
        return 130
