"""Find a checkpoint, build the model on the meta device, and load its weights shard by shard."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from portcullis.engine.gguf_checkpoint import gguf_weights, is_gguf
from portcullis.engine.layers import pack_linear_weights
from portcullis.engine.models import model_class
from portcullis.engine.quantization import dequantized_weights


def resolve_model_path(model: str) -> Path:
    """A local Hugging Face directory or GGUF file, or a Hub id downloaded where the machine has network."""
    path = Path(model).expanduser()
    if is_gguf(path):
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{model}: no config.json in this directory; is it a Hugging Face model folder?")
        return path
    if path.exists() or model.startswith((".", "/")) or model.count("/") > 1:
        raise ValueError(f"model {model!r} is neither a directory holding a Hugging Face checkpoint nor a .gguf file")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as exc:  # no network, unknown repo, gated repo...
        raise ValueError(f"model {model!r} is neither a local directory nor a downloadable Hub id: {exc}") from exc


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights found (only safetensors checkpoints are supported)")
    return files


def _iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path: Path, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int,
               lm_head: bool = True) -> nn.Module:
    """Build on `meta` (nothing allocated twice), materialise on `device`, then copy in the weights.
    Without `lm_head` (embeddings) a checkpoint's head, if it has one, is not loaded."""
    cls = model_class(hf_config)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(hf_config, max_positions, lm_head=lm_head)
    model = model.to_empty(device=device)
    if getattr(model, "tie_word_embeddings", False):  # to_empty unties shared parameters
        model.lm_head.weight = model.model.embed_tokens.weight
    if is_gguf(path):
        load_weights(model, gguf_weights(path, hf_config))
    else:
        load_weights(model, dequantized_weights(_iter_weights(path), hf_config, dtype))
    if device.type == "cpu":
        pack_linear_weights(model)
    return model.eval()


def load_weights(model: nn.Module, weights) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    mapping = getattr(model, "packed_modules_mapping", {})
    remap = getattr(model, "checkpoint_target", None)
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and (getattr(model, "tie_word_embeddings", False) or "lm_head.weight" not in params):
            continue
        if name.split(".", 1)[0] in ("layers", "embed_tokens", "norm"):
            name = f"model.{name}"  # a base model's checkpoint (`Qwen3Model`) names its tensors without the prefix
        # A model may place a tensor itself (one expert's projection into its stacked experts).
        placed = remap(name) if remap is not None else None
        target, shard = placed if placed is not None else (name, None)
        for fragment, (fused, shard_id) in mapping.items():
            if placed is None and f".{fragment}." in name:
                target, shard = name.replace(f".{fragment}.", f".{fused}."), shard_id
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[target]
        owner = model.get_submodule(target.rsplit(".", 1)[0])
        loader = getattr(owner, "weight_loader", None)
        tensor = tensor.to(param.dtype)
        if loader is None:
            param.data.copy_(tensor)
        elif shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(target)
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
