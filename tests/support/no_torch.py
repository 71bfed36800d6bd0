"""Imported first, makes the engine's stack unimportable in this process: the gateway's base
install has none of it, so a gateway that reached for any of it would fail here as it would there.
(A `None` in `sys.modules` is Python's own way to refuse an import; `find_spec` then says None.)"""

from __future__ import annotations

import sys

ENGINE_STACK = ("torch", "transformers", "triton", "xgrammar", "tokenizers", "safetensors", "numpy")

loaded = sorted(m for m in sys.modules if m.split(".")[0] in ENGINE_STACK)
assert not loaded, f"already imported: {loaded}"
sys.modules.update(dict.fromkeys(ENGINE_STACK))
