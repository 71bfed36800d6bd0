"""Find a checkpoint, build the model on the meta device, and load its weights shard by shard."""
from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from torch import nn

from portcullis.engine.distributed import tp_size
from portcullis.engine.model.families import model_class
from portcullis.engine.model.gguf_checkpoint import (
    DEQUANTIZE_ENV,
    STACKED_EXPERTS,
    gguf_tensors,
    gguf_weights,
    is_gguf,
    sidecar_folder,
)
from portcullis.engine.model.layers import (
    QUANTIZABLE,
    MissingLayer,
    held_here,
    keep_quantized,
    pack_linear_weights,
    repack_for_int8_activations,
)
from portcullis.engine.model.quantization import dequantized_weights
from portcullis.kernels import cpu_quant

log = structlog.get_logger("engine")


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


def _iter_weights(path: Path, skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the checkpoint, read one at a time; those `skip` names are never read."""
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if skip is None or not skip(name):
                    yield name, f.get_tensor(name)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def other_stages(model: nn.Module) -> Callable[[str], bool] | None:
    """For a pipeline stage, whether a checkpoint tensor belongs to a layer another stage holds (so
    it is not read at all); None when this stage holds every layer."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    elsewhere = {i for i, layer in enumerate(layers) if isinstance(layer, MissingLayer)}
    if not elsewhere:
        return None
    return lambda name: (m := _LAYER.search(name)) is not None and int(m.group(1)) in elsewhere


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path: Path, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int,
               lm_head: bool = True, gguf_dequantize: bool = False, gguf_activations: str = "float32") -> nn.Module:
    """Build on `meta` (nothing allocated twice), materialise on `device`, then copy in the weights.
    Without `lm_head` (embeddings) a checkpoint's head, if it has one, is not loaded. A GGUF's
    quantized tensors (cpu_quant.KINDS) stay as stored on CPUs unless `gguf_dequantize` (`keep_gguf_quantized`);
    with `gguf_activations` "int8" those the int8 kernel runs are repacked for it."""
    cls = model_class(hf_config)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(hf_config, max_positions, lm_head=lm_head)
    keep = keep_gguf_quantized(model, path, device, gguf_dequantize) if is_gguf(path) else frozenset()
    model = model.to_empty(device=device)
    if getattr(model, "shares_embedding", False):  # to_empty unties shared parameters
        model.lm_head.weight = model.model.embed_tokens.weight
    skip = other_stages(model)
    if is_gguf(path):
        load_weights(model, gguf_weights(path, hf_config, keep=keep, skip=skip))
    else:
        load_weights(model, dequantized_weights(_iter_weights(path, skip), hf_config, dtype))
    if device.type == "cpu":
        pack_linear_weights(model)
    if gguf_activations == "int8":
        if layers := repack_for_int8_activations(model):
            log.info("gguf int8 activations", layers=layers)
        else:  # a user who asked for it should not have to read empty counts to learn it did nothing
            log.warning("gguf int8 activations apply to nothing here: they run GGUF Q8_0, Q4_0 and Q4_1 "
                        "weights kept quantized on a CPU", gguf=is_gguf(path), device=device.type)
    return model.eval()


def _placement(model: nn.Module, params: dict, name: str) -> tuple[str, object] | None:
    """(parameter, shard id) a checkpoint tensor loads into; None: the model takes no such tensor."""
    if "rotary_emb.inv_freq" in name:
        return None
    if name == "lm_head.weight" and (getattr(model, "tie_word_embeddings", False) or "lm_head.weight" not in params):
        return None
    if name.split(".", 1)[0] in ("layers", "embed_tokens", "norm"):
        name = f"model.{name}"  # a base model's checkpoint (`Qwen3Model`) names its tensors without the prefix
    if (name == "model.embed_tokens.weight" and getattr(model, "tie_word_embeddings", False)
            and name not in params and "lm_head.weight" in params):
        return "lm_head.weight", None  # a last pipeline stage's tied head, without the embedding
    # A model may place a tensor itself (one expert's projection into its stacked experts).
    remap = getattr(model, "checkpoint_target", None)
    placed = remap(name) if remap is not None else None
    if placed is not None:
        return placed
    for fragment, (fused, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard_id
    return name, None


def load_weights(model: nn.Module, weights) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        placed = _placement(model, params, name)
        if placed is None:
            continue
        target, shard = placed
        if target not in params and not held_here(model, target):
            continue  # another pipeline stage's
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


def _why_dequantize(device: torch.device, dequantize: bool, tp: int | None = None) -> str | None:
    """Why a GGUF's quantized tensors are dequantized at load rather than run as stored."""
    if dequantize:
        return f"--gguf-dequantize or {DEQUANTIZE_ENV}=1"
    if device.type != "cpu":
        return f"the quantized kernel runs on CPUs, this engine runs on {device.type}"
    if (tp_size() if tp is None else tp) > 1:
        return "tensor parallelism: quantized layers are not sharded yet"
    if cpu_quant.native_library() is None:
        return "the native quantized kernel is not available here (see the kernels log)"
    return None


def gguf_runs_quantized(path: Path, device: torch.device, dequantize: bool, tp: int) -> bool:
    """Whether a GGUF file will have layers run as stored (at least one tensor of a kind the CPU
    kernel runs), before anything is loaded: `--dtype auto` then means float32, the kernel's."""
    if not is_gguf(path) or _why_dequantize(device, dequantize, tp) is not None:
        return False
    return any(w.kind in cpu_quant.KINDS for w in gguf_tensors(path, sidecar_folder(path)))


def keep_gguf_quantized(model: nn.Module, path: Path, device: torch.device, dequantize: bool) -> frozenset[str]:
    """On the meta-device model, give each linear layer and embedding whose GGUF tensors are all of
    one kind the kernel runs (cpu_quant.KINDS) a weight of those blocks; returns the checkpoint
    names to load as stored. Other tensors (F32 norms, K-quants, a fused layer of mixed kinds)
    are dequantized as before. Logs which path runs and why."""
    reason = _why_dequantize(device, dequantize)
    if reason:
        log.info("gguf weights dequantized at load", reason=reason)
        return frozenset()
    params = dict(model.named_parameters())
    parts: dict[str, list[tuple[str, str]]] = {}
    for weight in gguf_tensors(path, sidecar_folder(path)):
        placed = None if STACKED_EXPERTS.search(weight.name) else _placement(model, params, weight.name)
        if placed is not None and placed[0] in params:
            parts.setdefault(placed[0], []).append((weight.name, weight.kind))
    lib, keep, kinds = cpu_quant.native_library(), set(), {}
    for target, named in parts.items():
        owner = model.get_submodule(target.rsplit(".", 1)[0])
        kind = named[0][1]
        if (target.endswith(".weight") and isinstance(owner, QUANTIZABLE) and kind in cpu_quant.KINDS
                and all(k == kind for _, k in named)
                and owner.weight.shape[1] % cpu_quant.BLOCK_WEIGHTS[kind] == 0):
            keep_quantized(owner, kind, lib)
            keep.update(name for name, _ in named)
            kinds[kind] = kinds.get(kind, 0) + 1
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(model, "tie_word_embeddings", False) and getattr(embed, "quantized", None) and hasattr(model, "lm_head"):
        model.lm_head.quantized = embed.quantized  # loads share the table after to_empty
    log.info("gguf weights kept quantized", layers=kinds, isa=cpu_quant.isa_name(lib),
             dequantized=len(parts) - sum(kinds.values()))
    return frozenset(keep)
