"""One contract between the gateway and the engine (`portcullis.protocol`): both read it, neither
keeps a copy, and it needs nothing beyond the standard library (the gateway's install has no torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from portcullis.engine.server.cli import build_parser as engine_parser
from portcullis.protocol.engine_flags import DEFAULT_MAX_NUM_SEQS, read_shared_flags
from portcullis.supervisor.fleet import parse_model_spec

ROOT = Path(__file__).resolve().parents[2]

FLAG_LISTS = [
    [],
    ["--served-model-name=x,y"],  # one name with a comma, to the engine: the fleet once split it in two
    ["--served-model-name", "x", "y", "--dtype", "float32"],
    ["--max-model-len", "256", "--max-num-seqs", "8", "--served-model-name", "code"],
    ["--max-num-seqs=12", "--enable-prefix-caching"],
    ["--no-enable-prefix-caching", "--seed", "3"],
]


@pytest.mark.parametrize("flags", FLAG_LISTS)
def test_serve_reads_engine_flags_as_the_engine_does(flags):
    engine = engine_parser().parse_args(["some-model", *flags])
    shared = read_shared_flags(flags)
    assert (shared.served_model_name, shared.max_num_seqs) == (engine.served_model_name, engine.max_num_seqs)


def test_the_fleet_names_an_engine_as_the_engine_names_itself():
    assert parse_model_spec("demo:--served-model-name=x,y").names == ("x,y",)
    assert parse_model_spec("demo:--served-model-name x y").names == ("x", "y")
    assert read_shared_flags(["--max-num-seqs", "0"]).max_num_seqs == DEFAULT_MAX_NUM_SEQS  # the engine refuses it


def test_the_engine_refuses_abbreviated_flags_that_serve_would_not_read():
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["m", "--max-num-seq", "8"])


def test_the_protocol_needs_only_the_standard_library():
    code = ("import sys, pkgutil, importlib, portcullis.protocol as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('portcullis.protocol.' + m.name)\n"
            "roots = {n.split('.')[0] for n in sys.modules}\n"
            "print(sorted(r for r in roots - set(sys.stdlib_module_names) if not r.startswith('_')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['portcullis']"


def test_the_gateway_refuses_lists_at_the_engines_caps():
    from portcullis.engine.server import limits
    from portcullis.gateway.body import LIST_CAPS
    from portcullis.protocol import caps

    assert {name: (most, chars) for name, (most, _, chars) in LIST_CAPS.items()} == caps.LIST_CAPS
    assert limits.LIST_CAPS is caps.LIST_CAPS and limits.MAX_CHOICES is caps.MAX_CHOICES


@pytest.mark.parametrize("status", [400, 401, 404, 429, 500, 503])
def test_both_halves_answer_one_status_with_one_error_type(status):
    import json

    from portcullis.engine.server.errors import error_body as engine_body
    from portcullis.gateway.errors import error_body as gateway_body

    assert json.loads(gateway_body(status, "m", "c", "p")) == engine_body(status, "m", "p", "c")
