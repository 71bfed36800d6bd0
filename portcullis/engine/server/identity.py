"""The served model's identity: a SHA-256 over its weight files, computed once at start.

The digest covers the *.safetensors and *.bin files at the top of the model folder, read in
sorted name order as one stream, so an auditor can check it with
`cat $(ls *.safetensors *.bin | LC_ALL=C sort) | sha256sum` in that folder (a GGUF checkpoint: the
file's own SHA-256). `GET /v1/models`
shows it as `weights_sha256`, so the gateway (and its audit lines) can name exactly which
weights answered.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import structlog

log = structlog.get_logger("portcullis.engine.server")

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
CHUNK = 1 << 20  # streamed: a 15 GB checkpoint never sits in memory


def weight_files(folder: Path) -> list[Path]:
    if folder.is_file():  # a GGUF checkpoint is its one file
        return [folder]
    files = {path for pattern in WEIGHT_PATTERNS for path in folder.glob(pattern) if path.is_file()}
    return sorted(files, key=lambda path: path.name)


def weights_sha256(folder: Path) -> str | None:
    """The digest of the folder's weight files (None when it has none), and a log line of its cost."""
    files = weight_files(folder)
    if not files:
        log.warning("model identity: no *.safetensors or *.bin files to hash", folder=str(folder))
        return None
    started, digest, size = time.perf_counter(), hashlib.sha256(), 0
    for path in files:
        with path.open("rb") as stream:
            while chunk := stream.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
    log.info("model identity", weights_sha256=digest.hexdigest(), files=len(files), bytes=size,
             seconds=round(time.perf_counter() - started, 3))
    return digest.hexdigest()
