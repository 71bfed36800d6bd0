"""The offline-engine snippets (docs/engine.md, the README's "The offline engine" section until
issue 33 moved it) run as a user pastes them, from a directory outside the checkout: after the
one-package move they still said `from engine import LLM` (issue 28's review found no test reading
them)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_offline_engine_snippets_run_as_written(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "engine.md").read_text(), re.DOTALL)
    offline = [b for b in blocks if "portcullis.engine" in b]  # the others need a running server and key
    assert len(offline) >= 2, "docs/engine.md's snippets moved: update this test"
    run = subprocess.run([sys.executable, "-c", "\n".join(offline)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "length" in run.stdout or "stop" in run.stdout  # the first snippet prints its finish reason
