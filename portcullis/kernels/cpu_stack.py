"""A Llama-style decoder's layers at a decode step in one native call (``cpu_ext/decode_stack.cpp``),
for GGUF-quantized weights on CPUs: the compiled stages the PyTorch path calls one by one
(``cpu_quant``'s fused projections, ``cpu_rotary``, ``cpu_decode``'s K/V write and attention), chained
in C++ without the Python between them. :func:`decode_stack` is None where a kernel does not build.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from portcullis.kernels import cpu_decode, cpu_quant, cpu_rotary
from portcullis.kernels.native_build import NativeKernel

p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [("norm_matmul", p), ("matmul_add", p), ("rotary", p), ("write_kv", p), ("attention", p)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", i64), ("q_heads", i64), ("kv_heads", i64), ("head_dim", i64), ("inter", i64),
                ("block_size", i64), ("num_slots", i64), ("eps", f32), ("scale", f32), ("cache_is_bf16", i32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", p), ("post_norm", p), ("qkv", p), ("o", p), ("gate_up", p), ("down", p),
                ("qkv_kind", i32), ("o_kind", i32), ("gate_up_kind", i32), ("down_kind", i32),
                ("key_cache", p), ("value_cache", p), ("window", i32)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", i64), ("positions", p), ("slots", p), ("block_tables", p), ("table_stride", i64),
                ("context_lens", p), ("sequence_index", p), ("cos", p), ("sin", p)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.portcullis_stack_scratch_floats.restype = i64
    lib.portcullis_stack_scratch_floats.argtypes = [ctypes.POINTER(_Shape), i64]
    lib.portcullis_decode_stack.restype = i32
    lib.portcullis_decode_stack.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Shape),
                                            ctypes.POINTER(_Layer), i32, ctypes.POINTER(_Step), p, p, i32]
    lib.portcullis_silu_mul.restype = i32
    lib.portcullis_silu_mul.argtypes = [p, i64, i64, p, i32]


# A switch so the tests can run the layer-by-layer path on the same model.
ENABLED = True

# SiLU and its product round apart, as PyTorch's two ops do.
_KERNEL = NativeKernel("decode_stack.cpp", "CPU decode stack", _declare, ("-ffp-contract=off",))
reset = _KERNEL.reset


@dataclass
class StackLayer:
    """One decoder layer's tensors: float32 norms, GGUF blocks with their kinds, float32 or bf16
    caches (every layer's the same dtype)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    projections: tuple[tuple[torch.Tensor, str], ...]  # (blocks, kind) of qkv, o, gate_up, down
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    window: int | None


class DecodeStack:
    """The layers of one model, bound once (their tensors must not move); `run` takes a step."""

    def __init__(self, lib: ctypes.CDLL, layers: list[StackLayer], *, q_heads: int, kv_heads: int,
                 head_dim: int, inter: int, eps: float, scale: float, cos: torch.Tensor, sin: torch.Tensor):
        quant, decode, rotary = _stages()
        self.lib = lib
        self.kernels = _Kernels(*(ctypes.cast(f, p) for f in (
            quant.portcullis_quant_norm_matmul, quant.portcullis_quant_matmul_add, rotary.portcullis_rotary,
            decode.portcullis_write_kv_cache, decode.portcullis_decode_attention)))
        cache = layers[0].key_cache
        self.shape = _Shape(layers[0].input_norm.numel(), q_heads, kv_heads, head_dim, inter, cache.shape[1],
                            cache.shape[0] * cache.shape[1], eps, scale, cpu_decode.CACHE_DTYPES[cache.dtype])
        self._bound = layers  # what the pointers below point into, held alive
        self.layers = (_Layer * len(layers))(*(_layer(layer) for layer in layers))
        self.cos, self.sin = cos, sin
        self._scratch = torch.empty(0)
        self._index = torch.arange(0)

    def bound_to(self, caches: list) -> bool:
        """Whether these are still the (K, V) caches the stack points into, layer by layer."""
        return len(caches) == len(self._bound) and all(
            cache is not None and cache[0] is layer.key_cache and cache[1] is layer.value_cache
            for cache, layer in zip(caches, self._bound))

    def run(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor) -> torch.Tensor:
        """``h`` (float32 [rows, hidden], one decode row per sequence, row i sequence i) through
        every layer, in place. Positions and slots int64, tables int32, all contiguous; the caller
        has checked each position against the rotary tables and each slot against the caches."""
        rows = len(h)
        need = self.lib.portcullis_stack_scratch_floats(ctypes.byref(self.shape), rows)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        if len(self._index) < rows:
            self._index = torch.arange(max(rows, 2 * len(self._index)), dtype=torch.int64)
        step = _Step(rows, positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                     context_lens.data_ptr(), self._index.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr())
        status = self.lib.portcullis_decode_stack(
            ctypes.byref(self.kernels), ctypes.byref(self.shape), self.layers, len(self.layers), ctypes.byref(step),
            h.data_ptr(), self._scratch.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"native decode stack refused its arguments (status {status})")
        return h


def _layer(layer: StackLayer) -> _Layer:
    (qkv, qkv_kind), (o, o_kind), (gate_up, gate_up_kind), (down, down_kind) = layer.projections
    kinds = cpu_quant.KINDS
    return _Layer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), qkv.data_ptr(), o.data_ptr(),
                  gate_up.data_ptr(), down.data_ptr(), kinds[qkv_kind], kinds[o_kind], kinds[gate_up_kind],
                  kinds[down_kind], layer.key_cache.data_ptr(), layer.value_cache.data_ptr(), layer.window or 0)


def _stages() -> tuple:
    """The compiled kernels the stack chains (None where one did not build)."""
    return cpu_quant.native_library(), cpu_decode.native_library(), cpu_rotary.native_library()


def decode_stack(layers: list[StackLayer], **shape) -> DecodeStack | None:
    """The stack for these layers, or None where a kernel is not built (the caller keeps the
    layer-by-layer path)."""
    lib = _KERNEL.library()
    if lib is None or None in _stages():
        return None
    return DecodeStack(lib, layers, **shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` for float32 rows of ``[gate | up]`` (contiguous, 2-D), as the stack
    computes it (SiLU within about 1 ulp of PyTorch's), in one pass over the rows; None where the
    kernel is not built."""
    if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError("SiLU * up takes contiguous float32 rows of [gate | up]")
    lib = _KERNEL.library()
    if lib is None:
        return None
    rows, width = gate_up.shape
    act = torch.empty(rows, width // 2, dtype=torch.float32)
    if lib.portcullis_silu_mul(gate_up.data_ptr(), rows, width // 2, act.data_ptr(), torch.get_num_threads()):
        raise ValueError("native SiLU refused its arguments")
    return act
