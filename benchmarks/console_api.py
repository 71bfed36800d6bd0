"""The console's JSON API (gateway.console) over a keyed audit log of 10,000 request lines: a
filtered search (tenant and reason), a day's usage, and the chain's verification, each timed
as the gateway runs it in its console thread (the endpoint function, medians of --repeats).

    python benchmarks/console_api.py [--lines 10000] [--repeats 11] [--json out.json]

The console issue's bound: 10,000 lines filtered in under 200 ms on the development machine.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import median_ms  # noqa: E402 (benchmarks/, this script's folder)

from portcullis.gateway.audit import AuditLog  # noqa: E402
from portcullis.gateway.audit.keys import AuditKeyring  # noqa: E402
from portcullis.gateway.console import reads as console  # noqa: E402
from portcullis.gateway.policy.models import ConsoleSettings, MetricsSettings  # noqa: E402
from portcullis.host import cpu_model  # noqa: E402

REASONS = ["ok"] * 8 + ["model_not_allowed", "token_rate_limit"]


def write_log(folder: Path, lines: int) -> SimpleNamespace:
    keyring = AuditKeyring.load_or_create(folder / "keyring.json")
    audit = AuditLog(folder / "audit.log", 1 << 30, 10, keyring=keyring)
    rng = random.Random(0)
    for i in range(lines):
        reason = rng.choice(REASONS)
        audit.write(request_id=f"req-{i}", principal=f"user{i % 40}", tenant=rng.choice(["acme", "globex", "initech"]),
                    client="10.0.0.7", method="POST", route="/v1/chat/completions", model="chat",
                    status=200 if reason == "ok" else 403 if reason == "model_not_allowed" else 429,
                    decision="allowed" if reason == "ok" else "denied", reason=reason,
                    prompt_tokens=rng.randint(10, 3000), completion_tokens=rng.randint(0, 800),
                    latency_ms=rng.uniform(50, 4000))
    audit.flush()
    policy = SimpleNamespace(console=ConsoleSettings(), metrics=MetricsSettings())  # what the reads consult
    return SimpleNamespace(audit=audit, keyring=keyring, store=SimpleNamespace(current=SimpleNamespace(policy=policy)))




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gateway = write_log(Path(tmp), args.lines)
        found = console.audit_records(gateway, {"tenant": "acme", "reason": "model_not_allowed"})
        verdict = console.chain(gateway, {})
        assert verdict["status"] == "verified" and verdict["lines"] >= args.lines, verdict
        result = {
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "lines": args.lines, "matched": found["matched"],
            "audit_filtered_ms": median_ms(lambda: console.audit_records(
                gateway, {"tenant": "acme", "reason": "model_not_allowed"}), args.repeats),
            "usage_day_ms": median_ms(lambda: console.usage_rows(gateway, {"period": "day"}), args.repeats),
            "verify_ms": median_ms(lambda: console.chain(gateway, {}), args.repeats),
        }
        gateway.audit.close()
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
