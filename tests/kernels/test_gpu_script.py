"""benchmarks/kernels_gpu.py must stay runnable: its smoke mode runs the whole script on the
CPU through the Triton interpreter at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_gpu_check_script_smoke(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "kernels_gpu.json"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "kernels_gpu.py"), "--smoke", "--sweep", "--json",
         str(out)],
        capture_output=True, text=True, timeout=300, cwd=repo,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    rows = result["attention"] + result["write"]
    assert rows and all(r["ok"] for r in rows)
    assert all(r["rel_err"] < 1e-2 and r["unwritten"] == 0 for r in result["attention"])
    assert len(result["sweep"]) == 2 and all(r["ok"] and r["rel_err"] < 1e-2 for r in result["sweep"])
    assert "write_kv_cache" in proc.stdout.strip().splitlines()[-1]  # the table comes last
