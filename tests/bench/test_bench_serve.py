"""`portcullis bench serve` end to end: the real CLI entry against the demo model served by a
real engine with the gateway in front, as a user would run it with the key `serve` printed."""
from __future__ import annotations

import json
import socket
import sys

import pytest

from portcullis.cli import main
from portcullis.engine.assets import DEMO_MODEL_DIR
from tests.engine.server.conftest import start_server
from tests.gateway.conftest import ENGINE_TOKEN, _reset_stub, gateways, jwt_keys, stub  # noqa: F401 - fixtures, by name

pytestmark = pytest.mark.skipif(not (DEMO_MODEL_DIR / "model.safetensors").is_file(),
                                reason="the demo model's weights are not committed yet")

SMALL = ["--num-prompts", "6", "--random-input-len", "32", "--random-output-len", "8", "--disable-tqdm"]
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    running = start_server(DEMO_MODEL_DIR, tmp_path_factory.mktemp("bench-engine"), name="demo", token=ENGINE_TOKEN)
    yield running
    running.stop()


@pytest.fixture
def gw(gateways, demo_engine):  # noqa: F811 - the fixture imported above
    return gateways.start(engine_url=f"unix://{demo_engine.uds}")


def bench(*args: str) -> int:
    return main(["bench", "serve", *args])


def test_sweep_through_the_gateway_saves_vllm_fields_and_plots(gw, tmp_path, capsys):
    code = bench("--base-url", gw.url, "--api-key", gw.keys["alice"], *SMALL, "--request-rate", "inf,20",
                 "--goodput", "ttft:60000,tpot:60000", "--save-result", "--save-detailed", "--plot",
                 "--result-dir", str(tmp_path), "--metadata", "machine=ci")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out and "P99 E2EL (ms):" in out
    saved = {json.loads(p.read_text())["request_rate"]: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(saved) == {"inf", 20.0}
    for result in saved.values():
        assert (result["model_id"], result["backend"], result["num_prompts"]) == ("demo", "openai", 6)
        assert result["machine"] == "ci"  # --metadata
        assert (result["completed"], result["failed"]) == (6, 0)
        assert result["total_input_tokens"] == 6 * 32  # the prompts are exactly 32 tokens, as the server counted them
        assert result["total_output_tokens"] == 6 * 8  # ignore_eos: every requested token
        assert result["output_lens"] == [8] * 6 and result["input_lens"] == [32] * 6
        assert result["request_throughput"] == pytest.approx(6 / result["duration"])
        assert result["output_throughput"] == pytest.approx(48 / result["duration"])
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
        for key in LATENCIES:
            for stat in ("mean", "median", "std", "p90", "p99"):
                assert result[f"{stat}_{key}_ms"] >= 0
        assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
        assert result["p99_ttft_ms"] <= result["p99_e2el_ms"]
        assert all(0 < ttft <= e2el for ttft, e2el in zip(result["ttfts"], result["latencies"], strict=True))
        assert all(len(gaps) <= 7 for gaps in result["itls"]) and not any(result["errors"])
    pngs = sorted(p.name.rsplit("-", 1)[-1] for p in tmp_path.glob("*.png"))
    assert pngs == ["latency.png", "load.png", "throughput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in tmp_path.glob("*.png"))
    # It went through the gateway like any client: audited under the key's principal.
    records = [r for r in gw.audit_records() if r["route"] == "/v1/completions"]
    assert len(records) == 12 and {(r["principal"], r["status"]) for r in records} == {("alice", 200)}


def test_chat_endpoint(gw, tmp_path):
    assert bench("--base-url", gw.url + "/v1", "--api-key", gw.keys["alice"], "--model", "demo", *SMALL,
                 "--endpoint", "/v1/chat/completions", "--save-result", "--result-dir", str(tmp_path)) == 0
    [result] = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert (result["completed"], result["total_output_tokens"], result["backend"]) == (6, 48, "openai-chat")
    assert result["total_input_tokens"] > 6 * 32  # the chat template's tokens, as the server counted them
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]


def test_prefix_repetition_workload(gw, tmp_path):
    assert bench("--base-url", gw.url, "--api-key", gw.keys["alice"], "--dataset-name", "prefix-repetition",
                 "--num-prompts", "4", "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "8",
                 "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4", "--ignore-eos",
                 "--max-concurrency", "2", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path)) == 0
    [result] = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert (result["completed"], result["total_input_tokens"], result["total_output_tokens"]) == (4, 4 * 40, 4 * 4)
    assert result["max_concurrent_requests"] <= 2 and result["max_concurrency"] == 2


def test_refused_requests_are_counted_not_fatal(gw, tmp_path, capsys):
    # The policy caps max_tokens at 256: each request is a 400, and the run still reports.
    code = bench("--base-url", gw.url, "--api-key", gw.keys["alice"], "--num-prompts", "4", "--random-input-len", "8",
                 "--random-output-len", "300", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path))
    captured = capsys.readouterr()
    assert code == 1 and "every request failed" in captured.err
    assert "4 x HTTP 400" in captured.out
    [result] = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (0, 4, 0)


def test_a_wrong_key_is_one_clear_line(gw, capsys):
    assert bench("--base-url", gw.url, "--api-key", "ptc_nope.nope", *SMALL) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "refused the API key (HTTP 401)" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_one_line_and_exit_1(capsys):
    assert bench("--port", str(_free_port()), *SMALL) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("portcullis bench: cannot reach http://127.0.0.1:")


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert bench("--port", str(_free_port()), "--plot", *SMALL) == 1
    assert "pip install 'portcullis-llm[bench]'" in capsys.readouterr().err  # before any request is sent


def test_help_lists_the_vllm_flags(capsys):
    with pytest.raises(SystemExit):
        bench("--help")
    out = capsys.readouterr().out
    for flag in ("--base-url", "--endpoint", "--model", "--api-key", "--dataset-name", "--dataset-path",
                 "--random-input-len", "--random-output-len", "--num-prompts", "--request-rate", "--max-concurrency",
                 "--seed", "--goodput", "--save-result", "--plot", "--tokenizer"):
        assert flag in out
