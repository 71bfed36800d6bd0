"""Files shipped inside the engine package: the embedded demo model served when no model is named."""

from pathlib import Path

DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent / "demo-model"

__all__ = ["DEMO_MODEL_DIR"]
