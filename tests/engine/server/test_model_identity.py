"""The served model's identity: GET /v1/models shows `weights_sha256`, the SHA-256 of the model
folder's weight files read in sorted name order, so the gateway can record which weights answered."""
from __future__ import annotations

import hashlib
from pathlib import Path

from portcullis.engine.server.identity import weights_sha256

from .conftest import MODEL_NAME


def _expected(folder: Path) -> str:
    """What `cat $(ls *.safetensors *.bin | LC_ALL=C sort) | sha256sum` prints in the folder."""
    files = sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin")], key=lambda p: p.name)
    assert files, "the fixture has weight files"
    return hashlib.sha256(b"".join(path.read_bytes() for path in files)).hexdigest()


def test_the_models_listing_names_the_weights_served(server, server_model):
    expected = _expected(server_model)
    listing = server.client().models.list()
    [card] = listing.data
    assert card.id == MODEL_NAME and card.model_extra["weights_sha256"] == expected
    with server.http() as http:
        one = http.get(f"/v1/models/{MODEL_NAME}").json()
    assert one["weights_sha256"] == expected and one["max_model_len"] == card.model_extra["max_model_len"]


def test_every_answer_names_the_weights_that_gave_it(server, server_model):
    """A response header on every answer, errors included: what the gateway's audit line records."""
    expected = _expected(server_model)
    with server.http() as http:
        ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
        bad = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1})
    assert ok.status_code == 200 and bad.status_code == 400
    assert ok.headers["x-model-weights-sha256"] == bad.headers["x-model-weights-sha256"] == expected


def test_the_digest_streams_the_weight_files_in_name_order_and_nothing_else(tmp_path):
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"second shard")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"first shard ")
    (tmp_path / "extra.bin").write_bytes(b"bin ")
    (tmp_path / "config.json").write_text("{}")  # not weights: a config edit is not a new model
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "other.safetensors").write_bytes(b"not at the top")
    assert weights_sha256(tmp_path) == hashlib.sha256(b"bin first shard second shard").hexdigest()
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"second shard, retrained")
    assert weights_sha256(tmp_path) == hashlib.sha256(b"bin first shard second shard, retrained").hexdigest()


def test_a_folder_without_weight_files_has_no_digest(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert weights_sha256(tmp_path) is None
