"""benchmarks/engine_gpu.py must stay runnable for the first session that has a GPU: its smoke
mode runs the same checks on the CPU at tiny sizes (attention through the Triton interpreter)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_engine_gpu_script_smoke(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "engine_gpu.json"
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "engine_gpu.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {row["check"]: row for row in json.loads(out.read_text())["checks"]}
    assert all(row["ok"] for row in checks.values())
    assert any(name.startswith("parity") and "prefix cached" in name for name in checks)
    assert any(name.startswith("sampler: top-5 logprobs") for name in checks)
    assert proc.stdout.strip().splitlines()[-1].startswith("ok ")  # the table comes last
