"""Attention and KV-cache kernels for the paged KV cache.

This package owns the two operations the engine needs from its paged KV cache and the batch
layout that attention reads; and, for the CPU decode step, the matmul with GGUF-quantized
weights (``kernels.cpu_quant``, with a decoder layer's RMSNorm and residual adds fused into its
projections), the rotary embedding (``kernels.cpu_rotary``), and a Llama-style decoder's layers at
a decode step chained in one call (``kernels.cpu_stack``); nothing else. It imports nothing
else of Portcullis but the standard-library leaves ``portcullis.envs`` and ``portcullis.host``
(the engine imports it). ``kernels.native_build`` builds and loads the C++ kernels of ``cpu_ext/``.

``write_kv_cache(key, value, key_cache, value_cache, slot_mapping)``
    Scatter this step's new K/V rows ``[num_tokens, num_kv_heads, head_dim]`` into the caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]``. ``slot_mapping`` (int64) gives
    ``block_id * block_size + offset`` per token; -1 marks padding, which is skipped.

``PagedBatch(cu_seqlens_q, context_lens, block_tables, max_query_len=None,
max_context_len=None)``
    One step's layout over the paged cache, built once per step and shared by every layer.
    ``cu_seqlens_q`` (int32, ``num_seqs + 1``) are the sequences' start offsets in the query;
    ``context_lens`` (int32) count each sequence's cached tokens *including* this step's
    (write them first); ``block_tables`` (int32 ``[num_seqs, max_blocks]``) map logical to
    physical blocks. ``max_query_len`` and ``max_context_len`` spare the GPU path a device
    sync when the caller knows them. Its ``plan`` dict is the step's memo: the PyTorch path
    keeps its per-step indices and masks there (so a new step needs a new batch).

``paged_attention(query, key_cache, value_cache, batch, *, scale, sliding_window=None,
softcap=None, out=None)``
    Attention for a mixed batch of prefill chunks and decodes, read from the paged cache.
    ``query`` is ``[num_tokens, num_q_heads, head_dim]`` with all sequences concatenated as
    ``batch`` lays them out; ``scale`` and ``sliding_window`` are the layer's. Query token i
    of a sequence sits at position ``context_len - query_len + i`` and sees keys at positions
    <= its own (and > position - ``sliding_window``, as in Hugging Face). ``softcap`` c (Gemma
    2's attention logit soft-capping) turns each scaled score s into c * tanh(s / c) before the
    mask and softmax; None leaves scores as they are. ``num_q_heads`` must be a multiple of
    ``num_kv_heads``.

``allocate_kv_cache(shape, dtype, device)``
    A zeroed cache tensor; on CPUs on 2 MiB pages where the OS allows (the decode kernel reads
    blocks from anywhere in the cache, and 4 KiB pages add a TLB miss to most of them).

The caches may hold another floating dtype than the model's (a bfloat16 cache under a float32
model, or the reverse): ``write_kv_cache`` casts rows to the cache's dtype, and
``paged_attention`` attends in the cache's dtype and returns the query's.

Implementations:

* ``kernels.torch_attention`` - the PyTorch path (CPUs, or anywhere when forced). On CPUs its
  decodes go to ``kernels.cpu_decode``, a C++/OpenMP kernel that reads K/V in place through the
  block table, and K/V rows reach float32 caches by one native copy; it is compiled on first use, once per machine, into the user's cache folder, and
  without a compiler the PyTorch code runs instead (which one is logged once, on logger
  ``kernels``; ``PORTCULLIS_NATIVE_KERNELS=0`` switches the kernel off, and
  ``PORTCULLIS_CPU_ISA=x86-64-v3`` runs its AVX2 build where the CPU has more).
* ``kernels.triton_attention`` - Triton kernels for CUDA; imported only when used, so
  ``import portcullis.kernels`` needs neither Triton nor a GPU.
* ``kernels.reference`` - slow, obviously-correct versions: the test oracle.

Dispatch picks Triton for CUDA tensors and PyTorch otherwise; the environment variable
``PORTCULLIS_ATTENTION=triton|torch`` forces one (``triton`` on CPU tensors needs
``TRITON_INTERPRET=1``, as the tests set).
"""

from __future__ import annotations

import torch

from portcullis import envs
from portcullis.kernels.batch import PagedBatch
from portcullis.kernels.cpu_decode import zeros_on_huge_pages
from portcullis.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch

__all__ = ["PagedBatch", "allocate_kv_cache", "paged_attention", "write_kv_cache", "use_triton"]

_CHOICES = ("", "auto", "torch", "triton")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on ``tensor`` runs the Triton path (read per call so tests may switch)."""
    choice = envs.ATTENTION.get().lower()
    if choice not in _CHOICES:
        raise ValueError(f"{envs.ATTENTION.name}={choice!r}: expected 'triton', 'torch' or unset")
    if choice in ("", "auto"):
        return tensor.is_cuda
    return choice == "triton"


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed KV cache tensor (zeroed: a never-written slot must not hold a NaN that masking
    cannot undo); on CPUs on 2 MiB pages where the OS allows."""
    if torch.device(device).type == "cpu":
        return zeros_on_huge_pages(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V rows into the paged caches at ``slot_mapping``; slot -1 is skipped."""
    if use_triton(key):
        from portcullis.kernels.triton_attention import write_kv_cache_triton

        write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_cache_torch(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over the paged caches; returns [num_tokens, num_q_heads, D]."""
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(
            f"{query.shape[1]} query heads is not a multiple of {key_cache.shape[2]} KV heads"
        )
    if use_triton(query):
        from portcullis.kernels.triton_attention import paged_attention_triton as attend
    else:
        attend = paged_attention_torch
    return attend(query, key_cache, value_cache, batch, scale=scale,
                  sliding_window=sliding_window, softcap=softcap, out=out)
