"""`portcullis serve` on the bundled demo model says, once, that it is a toy and how to serve a
real model (issue 21); with a model named, it says nothing of the kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from portcullis.supervisor import serve


def announced(capsys, model: str | None = None) -> str:
    args = serve.build_parser().parse_args([])
    args.model = model  # as serve.main sets it: MODEL is taken by hand, not by argparse
    serve._announce(args, model or "demo", "sk-test", Path("policy.yaml"))
    return capsys.readouterr().out


def test_the_demo_model_is_announced_as_a_toy_once(capsys) -> None:
    out = announced(capsys)
    assert out.count("The demo model is a toy") == 1
    assert "portcullis serve Qwen/Qwen2.5-Coder-1.5B-Instruct" in out and "local Hugging Face folder" in out


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-Coder-1.5B-Instruct", "./my-model"])
def test_a_real_model_gets_no_such_notice(capsys, model: str) -> None:
    out = announced(capsys, model)
    assert f"serving {model!r}" in out and "toy" not in out
