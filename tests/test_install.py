"""The install: one import package, `portcullis`, that shadows no one's, and works from any directory.

Hugging Face's `kernels` (which transformers 5.25 requires) once lost to a top-level `kernels` of
ours; these tests hold the promise that no such name is ours again.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = ("import kernels, transformers; from transformers import LlamaForCausalLM; "
           "import portcullis.engine, portcullis.gateway.app, portcullis.cli; from portcullis.kernels import PagedBatch; "
           "assert 'portcullis' not in kernels.__name__ and hasattr(kernels, 'get_kernel'), kernels.__file__; "
           "print(kernels.__file__)")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(ROOT)], check=True, timeout=300, cwd=out)
    (built,) = out.glob("portcullis_llm-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_portcullis_alone(wheel):
    names = wheel.namelist()
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["portcullis"]
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"portcullis"}


def test_the_wheel_carries_what_runs_and_nothing_of_the_checkout(wheel):
    names = set(wheel.namelist())
    assert "portcullis/kernels/cpu_ext/decode_attention.cpp" in names  # built on first use
    assert "portcullis/engine/assets/demo-model/config.json" in names  # `portcullis serve` with no model
    assert "portcullis/cli/__main__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "portcullis/tests/"))]
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = wheel.read(metadata).decode()
    assert "Name: portcullis-llm" in text and "Provides-Extra: engine" in text
    base = [line for line in text.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert base and not [line for line in base if any(n in line for n in ("torch", "transformers", "triton"))]


@pytest.mark.parametrize("where", ["/", "checkout"])
def test_hugging_face_kernels_and_ours_both_import_from_anywhere(where, tmp_path):
    cwd = ROOT if where == "checkout" else Path("/")
    done = subprocess.run([sys.executable, "-c", IMPORTS], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "site-packages" in Path(done.stdout.strip()).parts, done.stdout  # the installed one, not a folder here
