"""Engine processes bound OpenMP's spin-wait before torch loads libgomp, unless the user chose one:
with libgomp's default two engines on one two-core host starved each other's streams."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from portcullis.engine.openmp import SPINCOUNT, bound_spinning

REPO = Path(__file__).resolve().parents[2]
CHOSEN = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def test_the_spin_count_is_bounded_when_the_user_chose_none() -> None:
    environ = {"PATH": "/bin"}
    bound_spinning(environ)
    assert environ == {"PATH": "/bin", "GOMP_SPINCOUNT": SPINCOUNT}


@pytest.mark.parametrize("chosen", [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}])
def test_a_users_choice_is_kept(chosen: dict[str, str]) -> None:
    environ = dict(chosen)
    bound_spinning(environ)
    assert environ == chosen


def test_the_engines_libgomp_reads_the_bounded_count(tmp_path: Path) -> None:
    """The real entry point, as `portcullis engine` and `portcullis serve` start it: it loads torch
    (and so libgomp) before it finds the model missing, and libgomp shows what it read."""
    env = {k: v for k, v in os.environ.items() if k not in CHOSEN} | {"OMP_DISPLAY_ENV": "verbose"}
    done = subprocess.run([sys.executable, "-m", "portcullis.engine", str(tmp_path / "no-model"), "--no-token",
                           "--uds", str(tmp_path / "engine.sock")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "cannot load model" in done.stderr, done.stderr[-2000:]
    shown = [line.strip() for line in done.stderr.splitlines() if line.strip().startswith("GOMP_SPINCOUNT =")]
    if not shown:
        pytest.skip("torch's OpenMP here is not GNU libgomp")
    assert shown == [f"GOMP_SPINCOUNT = '{SPINCOUNT}'"]
