"""The `portcullis` command line: keys, routing of `engine`/`serve`, and start-up refusals."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import yaml
from pydantic import ValidationError

from portcullis import cli
from portcullis.gateway.auth.keys import secret_matches, split_key
from portcullis.gateway.settings import GatewaySettings

from .conftest import ROOT, base_policy, write_policy_file


@pytest.fixture
def policy_file(tmp_path):
    path = tmp_path / "policy.yaml"
    write_policy_file(path, base_policy())
    return path


def _keys(policy_file):
    return yaml.safe_load((policy_file.parent / "keys.yaml").read_text())["keys"]


def test_keys_create_prints_once_and_stores_only_a_hash(policy_file, capsys):
    assert cli.main(["keys", "--policy", str(policy_file), "create", "--principal", "alice",
                     "--tenant", "acme", "--expires-in", "30d", "--scope", "user", "--model", "demo"]) == 0
    token = capsys.readouterr().out.strip()
    key_id, secret = split_key(token)
    stored = (policy_file.parent / "keys.yaml").read_text()
    assert secret not in stored and key_id in stored
    (record,) = _keys(policy_file)
    assert secret_matches(secret, record["hash"]) and record["expires_at"] and record["models"] == ["demo"]
    assert (policy_file.parent / "keys.yaml").stat().st_mode & 0o077 == 0
    assert yaml.safe_load(policy_file.read_text()) == base_policy()  # the admin's file is untouched


def test_keys_create_refuses_unknown_tenant(policy_file, capsys):
    assert cli.main(["keys", "--policy", str(policy_file), "create", "--principal", "x", "--tenant", "nope"]) == 1
    assert "names tenant 'nope', which the policy does not define (defined: acme, globex)" in capsys.readouterr().err


def test_keys_create_refuses_a_key_the_gateway_would_refuse(policy_file, capsys):
    # bob is acme's under principals:; one such record would make every later reload (and so every
    # later revocation) fail until someone edits keys.yaml by hand.
    assert cli.main(["keys", "--policy", str(policy_file), "create", "--principal", "bob", "--tenant", "globex"]) == 1
    err = capsys.readouterr().err
    assert "principal 'bob' belongs to tenant 'acme'" in err and "no key was created" in err
    assert not (policy_file.parent / "keys.yaml").exists()
    assert cli.main(["keys", "--policy", str(policy_file), "list"]) == 0


@pytest.mark.parametrize("value,message", [("0d", "would expire at once"), ("99999999999d", "more than 100 years"),
                                           ("1y", "not a duration like 30m, 24h, 90d or 2w"),
                                           ("1.5h", "not a duration")])
def test_keys_create_refuses_bad_expiry(policy_file, capsys, value, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["keys", "--policy", str(policy_file), "create", "--principal", "alice", "--tenant", "acme",
                  "--expires-in", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (policy_file.parent / "keys.yaml").exists()


def test_keys_create_refuses_bad_names(policy_file, capsys):
    with pytest.raises(SystemExit):
        cli.main(["keys", "--policy", str(policy_file), "create", "--principal", "bad name", "--tenant", "acme"])
    assert "'bad name' is not a valid name" in capsys.readouterr().err


def test_keys_options_go_before_or_after_the_action(policy_file, capsys):
    assert cli.main(["keys", "create", "--policy", str(policy_file), "--principal", "alice", "--tenant", "acme"]) == 0
    assert split_key(capsys.readouterr().out.strip())
    assert cli.main(["keys", "list"]) == 2
    assert "--policy POLICY.yaml" in capsys.readouterr().err


def _create(policy_file, capsys, *extra):
    assert cli.main(["keys", "--policy", str(policy_file), "create", "--principal", "alice", "--tenant", "acme",
                     *extra]) == 0
    return split_key(capsys.readouterr().out.strip())[0]


def test_keys_revoke_and_rotate_refuse_what_makes_no_sense(policy_file, capsys):
    key_id = _create(policy_file, capsys)
    assert cli.main(["keys", "--policy", str(policy_file), "revoke", key_id]) == 0
    revoked_at = _keys(policy_file)[0]["revoked_at"]
    capsys.readouterr()
    # Again: a success that changes nothing, so incident scripts revoking a list run to the end.
    assert cli.main(["keys", "--policy", str(policy_file), "revoke", key_id]) == 0
    assert f"Key {key_id} (alice) was already revoked" in capsys.readouterr().out
    assert _keys(policy_file)[0]["revoked_at"] == revoked_at  # the first revocation time is kept
    assert cli.main(["keys", "--policy", str(policy_file), "rotate", key_id]) == 1
    assert "is revoked, so there is nothing to rotate" in capsys.readouterr().err
    other = _create(policy_file, capsys)
    assert cli.main(["keys", "--policy", str(policy_file), "rotate", other]) == 0
    new = split_key(capsys.readouterr().out.strip())[0]
    assert cli.main(["keys", "--policy", str(policy_file), "rotate", other]) == 1
    assert f"already rotated to '{new}'" in capsys.readouterr().err
    assert cli.main(["keys", "--policy", str(policy_file), "revoke", "ffffffffffff"]) == 1
    assert capsys.readouterr().err.startswith("portcullis: no key with id 'ffffffffffff' in ")


def test_keys_list_table_shows_expiry_revocation_and_rotation(policy_file, capsys):
    revoked, rotated = _create(policy_file, capsys), _create(policy_file, capsys, "--expires-in", "30d")
    cli.main(["keys", "--policy", str(policy_file), "revoke", revoked])
    cli.main(["keys", "--policy", str(policy_file), "rotate", rotated, "--overlap", "2h"])
    new = split_key(capsys.readouterr().out.strip().splitlines()[-1])[0]
    assert cli.main(["keys", "--policy", str(policy_file), "list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "revoked 20" in rows[revoked] and "never" in rows[revoked]
    assert f"rotating to {new}, works until 20" in rows[rotated]
    assert rows[new].rstrip().endswith("active")
    assert "hmac-sha256" not in "".join(rows.values())


def test_keys_list_revoke_rotate(policy_file, capsys):
    cli.main(["keys", "--policy", str(policy_file), "create", "--principal", "alice", "--tenant", "acme"])
    first = split_key(capsys.readouterr().out.strip())[0]
    assert cli.main(["keys", "--policy", str(policy_file), "rotate", first, "--overlap", "1h"]) == 0
    second = split_key(capsys.readouterr().out.strip())[0]
    assert cli.main(["keys", "--policy", str(policy_file), "revoke", second]) == 0
    capsys.readouterr()
    assert cli.main(["keys", "--policy", str(policy_file), "list", "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[first]["state"] == "active" and rows[first]["expires"] != "-"
    assert rows[second]["state"] == "revoked"
    assert "hash" not in json.dumps(rows)
    assert cli.main(["keys", "--policy", str(policy_file), "revoke", "ffffffffffff"]) == 1


def test_engine_subcommand_execs_the_engine_module(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: calls.append((exe, argv)))
    code = cli.main(["engine", "--model", "m", "--port", "9"])
    if importlib.util.find_spec("torch") is None:  # the gateway's base install (`make test-gateway`)
        assert code == 2 and not calls  # names the extra instead (test_torch_free.py)
    else:
        assert calls == [(sys.executable, [sys.executable, "-m", "portcullis.engine", "--model", "m", "--port", "9"])]


def test_gateway_refuses_unsafe_settings(policy_file, capsys, monkeypatch):
    monkeypatch.delenv("PORTCULLIS_ENGINE_TOKEN", raising=False)
    assert cli.main(["gateway", "--policy", str(policy_file)]) == 2
    assert "no engine token" in capsys.readouterr().err
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", "short")
    assert cli.main(["gateway", "--policy", str(policy_file)]) == 2
    assert "at least 16 characters" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://8.8.8.8:8000", "ftp://engine", "unix://relative.sock", "https://engine:8001",
                                 "http://user:pw@10.0.0.2:80", "http://10.0.0.2:80/v1?x=1"])
def test_settings_refuse_unsafe_engine_urls(policy_file, url):
    with pytest.raises(ValidationError):
        GatewaySettings(policy=policy_file, engine_url=url, engine_token="x" * 32)


@pytest.mark.parametrize("url", ["http://10.0.0.2:8000", "http://engine:8000", "unix:///run/p/engine.sock",
                                 "http://127.0.0.1:8100"])
def test_settings_accept_private_engine_urls(policy_file, url):
    assert GatewaySettings(policy=policy_file, engine_url=url, engine_token="x" * 32).engine_url == url


def test_gateway_package_never_imports_the_engine():
    for path in (ROOT / "portcullis" / "gateway").rglob("*.py"):
        text = path.read_text()
        for other in ("portcullis.engine", "portcullis.kernels", "portcullis import engine", "portcullis import kernels"):
            assert other not in text, path


def test_gateway_runs_uvicorn_without_a_server_banner(policy_file, monkeypatch, capsys):
    import uvicorn

    seen = {}
    monkeypatch.setenv("PORTCULLIS_GATEWAY_SETTINGS", "{}")  # restored afterwards
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw, app=app))
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", "x" * 32)
    assert cli.main(["gateway", "--policy", str(policy_file), "--engine-url", "http://127.0.0.1:9"]) == 0
    assert seen["server_header"] is False and seen["proxy_headers"] is False
    assert seen["port"] == 8000 and seen["host"] == "127.0.0.1"
    monkeypatch.setattr(cli.gateway, "_run_workers", lambda config: seen.update(config=config))
    assert cli.main(["gateway", "--policy", str(policy_file), "--engine-url", "http://127.0.0.1:9",
                     "--workers", "2"]) == 0
    assert "rate limits are kept per worker" in capsys.readouterr().err
    config = seen["config"]
    assert config.app == "portcullis.gateway.app:create_app_from_env" and config.workers == 2 and config.factory
    assert config.server_header is False
    settings = json.loads(__import__("os").environ["PORTCULLIS_GATEWAY_SETTINGS"])
    assert "engine_token" not in settings


def test_forwarded_headers_are_trusted_only_from_listed_proxies(policy_file, monkeypatch):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", "x" * 32)
    assert cli.main(["gateway", "--policy", str(policy_file), "--forwarded-allow-ips", "10.0.0.7"]) == 0
    assert seen["proxy_headers"] is True and seen["forwarded_allow_ips"] == "10.0.0.7"
    with pytest.raises(ValidationError, match="not '\\*'"):
        GatewaySettings(policy=policy_file, engine_token="x" * 32, forwarded_allow_ips="*")


def _revoke_in_a_child(keys_file, key_id, barrier, codes):
    barrier.wait()  # all at once: each would otherwise write back the file it read before the others
    codes.put(cli.main(["keys", "--keys-file", str(keys_file), "revoke", key_id]))


def test_parallel_revokes_are_all_kept(tmp_path):
    """Eight `keys revoke` processes at once: every one is on disk, none lost to another's write."""
    import multiprocessing

    from portcullis.gateway.auth.keys import KeyBook, new_key

    keys_file = tmp_path / "keys.yaml"
    book = KeyBook(keys_file)
    ids = []
    for n in range(8):
        book.add(new_key(f"user{n}", "acme", [])[1])
        ids.append(book.keys.keys[-1].id)
    context = multiprocessing.get_context("fork")
    barrier, codes = context.Barrier(len(ids)), context.Queue()
    children = [context.Process(target=_revoke_in_a_child, args=(keys_file, key_id, barrier, codes)) for key_id in ids]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=60)
    assert sorted(codes.get(timeout=5) for _ in children) == [0] * len(ids)
    records = yaml.safe_load(keys_file.read_text())["keys"]
    assert [r["id"] for r in records if not r["revoked_at"]] == []
    assert keys_file.stat().st_mode & 0o777 == 0o600
