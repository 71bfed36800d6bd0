"""The compiled CPU decode kernel (kernels.cpu_decode) against the oracle, and its fallback.

The kernel is built on first use into the user's cache folder (once per machine), and its
tests run once per instruction set this CPU can run: the native build (AVX-512 where the CPU
has it) and the x86-64-v3 build (AVX2, the code an AMD Zen 3 runs), so that an AVX-512 machine
tests the AVX2 code too. They need a C++ compiler; without one they skip locally, and fail
under CI=true, where one is expected. The fallback tests need none: they take the compiler away.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from portcullis.kernels import allocate_kv_cache, cpu_decode, native_build
from portcullis.kernels.reference import paged_attention_reference
from portcullis.kernels.torch_attention import paged_attention_torch

DECODES = [(1, c) for c in (1, 2, 15, 16, 17, 31, 32, 33, 100, 255, 300, 64, 513)]
MIXED = [(1, 1), (1, 300), (7, 7), (70, 133), (1, 17), (16, 16), (33, 250), (1, 64), (2, 2)]


@pytest.fixture
def fresh_loader():
    """Forget the loaded kernel before and after, so a test's environment decides the path."""
    cpu_decode.reset()
    yield
    cpu_decode.reset()


@pytest.fixture(params=list(cpu_decode.ISA_FLAGS))
def isa(request, monkeypatch) -> str:
    """Each instruction set the kernel builds for, as the attention path's choice; one this
    CPU cannot run (x86-64-v3 on an ARM machine) skips."""
    if not cpu_decode.cpu_supports(request.param):
        pytest.skip(f"this CPU cannot run {request.param} code")
    monkeypatch.setenv(cpu_decode.ISA_ENV, request.param)
    return request.param


def built(isa: str):
    """The kernel built for ``isa``; a machine without a compiler skips, except in CI."""
    lib = cpu_decode.native_library(isa)
    if lib is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI has a C++ compiler: the {isa} decode kernel should have built")
        pytest.skip("no C++ compiler here: the native decode kernel cannot be built")
    return lib


@pytest.fixture
def native(isa):
    """The compiled kernel, once per instruction set (see ``isa``)."""
    return built(isa)


def run(case, window=None, batch=None):
    batch = case.batch() if batch is None else batch
    out = torch.full_like(case.query, float("nan"))
    paged_attention_torch(case.query, case.key_cache, case.value_cache, batch,
                          scale=case.scale, sliding_window=window, out=out)
    return out, batch


def reference(case, window=None):
    return paged_attention_reference(case.query, case.key_cache, case.value_cache,
                                     sliding_window=window, **case.kwargs())


def took_native(batch) -> bool:
    (step,) = batch.plan.values()
    return step.native is not None and not step.decodes


# Speculative verification: short queries (a token and its proposals) on long contexts, beside
# decodes, a two-token prompt and a prefill too long for the kernel.
VERIFY = [(1, 40), (6, 300), (3, 17), (2, 2), (17, 100), (5, 33), (1, 5), (30, 120)]


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", ["decode", "mixed", "verify"])
def test_native_decode_matches_reference(paged, native, seqs, dtype, group, block_size,
                                         window) -> None:
    shapes = {"decode": DECODES, "mixed": MIXED, "verify": VERIFY}[seqs]
    seed = zlib.crc32(repr((seqs, dtype, group, block_size, window)).encode())
    case = paged.case(shapes, seed=seed, group=group, block_size=block_size, dtype=dtype)
    out, batch = run(case, window)
    assert took_native(batch)
    if seqs == "verify":  # every query of up to NATIVE_SHORT_QUERY tokens went to the kernel
        (step,) = batch.plan.values()
        assert [p.end - p.begin for p in step.prefills] == [30]
    assert not out.isnan().any(), "some output rows were never written"
    bound = 1e-5 if dtype == torch.float32 else paged.tolerance(dtype)
    assert paged.relative_error(out, reference(case, window)) < bound


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_rows_equal_the_decodes_they_stand_for(paged, native, dtype, group,
                                                            window) -> None:
    # A short query's rows read their sequence's context once, all together; each row must
    # still come out bit for bit as a decode of that token alone would (its own context
    # length, its own pass), or greedy speculation could pick another token in a near-tie.
    case = paged.case(VERIFY, seed=group, group=group, dtype=dtype)
    out, batch = run(case, window)
    assert took_native(batch)
    starts, lens = case.cu_seqlens_q.long(), case.context_lens.long()
    seqs, rows, ctx = [], [], []
    for s, n in enumerate(case.query_lens):
        if n <= 17:
            for j in range(n):  # token j of the query sees context_len - (n - 1 - j) keys
                seqs.append(s)
                rows.append(int(starts[s]) + j)
                ctx.append(int(lens[s]) - (n - 1 - j))
    alone = torch.full_like(case.query, float("nan"))
    tables = (case.block_tables[seqs].int().contiguous(), torch.tensor(ctx, dtype=torch.int32))
    cpu_decode.decode_attention(native, case.query, case.key_cache, case.value_cache, tables,
                                (torch.arange(len(seqs)), torch.tensor(rows)), case.scale, window, alone)
    assert torch.equal(out[rows], alone[rows])


@pytest.mark.parametrize("head_dim", [16, 32, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_other_head_sizes(paged, native, head_dim, dtype) -> None:
    # bf16 heads of 32, 64, 128 take vdpbf16ps where the CPU has it, 16 and 80 widen K.
    case = paged.case(DECODES, seed=head_dim, head_dim=head_dim, group=2, dtype=dtype)
    out, batch = run(case)
    assert took_native(batch)
    bound = 1e-5 if dtype == torch.float32 else paged.tolerance(dtype)
    assert paged.relative_error(out, reference(case)) < bound


@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (4, 64), (5, 64), (8, 64), (3, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_other_group_sizes(paged, native, group, head_dim, dtype) -> None:
    # A KV group's query heads are scored in passes of 4, 2 and 1 heads (2 and 1 for float32
    # heads of 128): each split must land every head's scores in its own row.
    case = paged.case(DECODES, seed=group, group=group, head_dim=head_dim, dtype=dtype)
    out, batch = run(case)
    assert took_native(batch)
    bound = 1e-5 if dtype == torch.float32 else paged.tolerance(dtype)
    assert paged.relative_error(out, reference(case)) < bound


def test_unsupported_head_size_takes_the_torch_path(paged, native) -> None:
    case = paged.case(MIXED, seed=72, head_dim=72)
    out, batch = run(case)
    assert not took_native(batch)
    assert paged.relative_error(out, reference(case)) < 1e-5


def test_native_decode_with_several_threads(paged, native) -> None:
    # Sequences are shared out among OpenMP threads; each must land in its own output row.
    case = paged.case(DECODES * 4, seed=3, group=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, batch = run(case)
    finally:
        torch.set_num_threads(threads)
    assert took_native(batch)
    assert paged.relative_error(out, reference(case)) < 1e-5


@pytest.mark.parametrize("shapes", [MIXED, VERIFY])
def test_native_decode_reads_a_query_of_another_dtype(paged, native, shapes) -> None:
    # A bf16 model over a float32 cache: the query is widened, the output narrowed back (every
    # row of a verification too).
    case = paged.case(shapes, seed=8, group=2)
    case.query = case.query.to(torch.bfloat16)
    out, batch = run(case)
    assert took_native(batch) and out.dtype == torch.bfloat16
    assert paged.relative_error(out, reference(case)) < paged.tolerance(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_rows_land_where_the_pytorch_scatter_puts_them(native, dtype, monkeypatch) -> None:
    """The native write and the PyTorch scatter leave identical caches (bf16 rounded alike, a NaN
    kept a NaN); padding slots (-1) are skipped, and K/V may be views into a fused QKV row."""
    from portcullis.kernels import torch_attention

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 4 * 32 + 2 * 2 * 32, generator=g)
    qkv[0, 4 * 32] = float("nan")
    qkv[1, 4 * 32 + 1] = 1 + 2**-8  # halfway between two bf16 values: rounds to even
    key, value = (part.reshape(6, 2, 32) for part in qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)[1:])
    slots = torch.tensor([5, 40, -1, 0, 63, 17])
    caches = {}
    for path in ("native", "pytorch"):
        kc, vc = (torch.zeros(4, 16, 2, 32, dtype=dtype) for _ in range(2))
        if path == "native":
            assert cpu_decode.write_kv_cache(native, key, value, kc, vc, slots)
        else:
            monkeypatch.setattr(torch_attention, "NATIVE_DECODE", False)
            torch_attention.write_kv_cache_torch(key, value, kc, vc, slots)
        caches[path] = (kc, vc)
    for native_cache, torch_cache in zip(caches["native"], caches["pytorch"], strict=True):
        torch.testing.assert_close(native_cache, torch_cache, rtol=0, atol=0, equal_nan=True)
    kc = caches["native"][0].view(-1, 2, 32)
    assert torch.equal(kc[40], key[1].to(dtype)) and kc[[1, 2, 3]].eq(0).all()
    kc, vc = (torch.zeros(4, 16, 2, 32, dtype=dtype) for _ in range(2))  # a slot past the caches
    with pytest.raises(IndexError, match="past the cache"):  # is refused before anything is written
        cpu_decode.write_kv_cache(native, key, value, kc, vc, torch.tensor([0, 1, 2, 3, 4, 64]))
    assert kc.eq(0).all() and vc.eq(0).all()


def test_the_build_is_cached(fresh_loader, monkeypatch, tmp_path) -> None:
    # Caching works alike for every instruction set: this builds the x86-64-v3 kernel where the
    # CPU runs it, some times quicker to compile than the AVX-512 one.
    isa = "x86-64-v3" if cpu_decode.cpu_supports("x86-64-v3") else "native"
    built(isa)  # skips without a compiler
    cpu_decode.reset()
    monkeypatch.setenv(cpu_decode.ISA_ENV, isa)
    monkeypatch.setenv("PORTCULLIS_CACHE_DIR", str(tmp_path))
    assert cpu_decode.native_library() is not None
    (build,) = (tmp_path / "kernels").glob("*.so")
    assert build.name.startswith(f"decode_attention-{isa}-")  # the build says what it is for
    cpu_decode.reset()

    def no_second_build(*_):
        raise AssertionError("compiled again although a build was cached")

    monkeypatch.setattr(native_build, "_build", no_second_build)
    assert cpu_decode.native_library() is not None
    assert list((tmp_path / "kernels").glob("*.so")) == [build]


def test_each_instruction_set_has_its_own_build() -> None:
    # An x86-64-v3 build must never be taken for the native one, or the reverse (the AVX2
    # tests would then test AVX-512 code).
    runnable = [isa for isa in cpu_decode.ISA_FLAGS if cpu_decode.cpu_supports(isa)]
    if len(runnable) < 2:
        pytest.skip("this CPU runs only one of the instruction sets")
    files = [Path(built(isa)._name) for isa in runnable]
    assert len(set(files)) == len(files)
    for isa, file in zip(runnable, files, strict=True):
        assert file.parent == cpu_decode.cache_dir()
        assert file.name.startswith(f"decode_attention-{isa}-")


def test_an_unknown_instruction_set_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(cpu_decode.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="x86-64-v3"):
        cpu_decode.native_library()


def fallback_case_passes(paged) -> None:
    case = paged.case(MIXED, seed=77, group=2)
    out, batch = run(case)
    assert not took_native(batch)
    assert paged.relative_error(out, reference(case)) < 1e-5


def test_without_a_compiler_the_torch_path_runs(paged, fresh_loader, monkeypatch, tmp_path,
                                                caplog) -> None:
    monkeypatch.setenv("PORTCULLIS_CACHE_DIR", str(tmp_path))  # nothing cached either
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with caplog.at_level(logging.INFO, logger="kernels"):
        fallback_case_passes(paged)
        fallback_case_passes(paged)
    said = [r.getMessage() for r in caplog.records if "CPU decode attention" in r.getMessage()]
    assert len(said) == 1 and "no C++ compiler" in said[0]  # once per process


def test_a_failed_build_falls_back_with_a_warning(paged, fresh_loader, monkeypatch, tmp_path,
                                                  caplog) -> None:
    monkeypatch.setenv("PORTCULLIS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "false")
    with caplog.at_level(logging.INFO, logger="kernels"):
        fallback_case_passes(paged)
    assert any(r.levelno == logging.WARNING and "building the native kernel failed"
               in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "kernels").glob("*.so*"))  # no half-written build left


def test_the_native_kernel_can_be_switched_off(paged, fresh_loader, monkeypatch,
                                               caplog) -> None:
    monkeypatch.setenv("PORTCULLIS_NATIVE_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="kernels"):
        fallback_case_passes(paged)
    assert any("PORTCULLIS_NATIVE_KERNELS=0" in r.getMessage() for r in caplog.records)


def huge_pages_of(tensor: torch.Tensor) -> int:
    """kB of transparent huge pages in the mapping that holds ``tensor`` (Linux)."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_caches_are_zeroed_tensors_of_their_shape(dtype) -> None:
    for shape in [(3, 16, 2, 8), (300, 16, 4, 64)]:  # under and over one 2 MiB page
        cache = allocate_kv_cache(shape, dtype)
        assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
        assert not cache.any()
        cache[-1, -1, -1, -1] = 1.5
        assert cache.sum().item() == 1.5


def test_kv_caches_outlive_their_mapping_object() -> None:
    cache = allocate_kv_cache((64, 16, 8, 128), torch.float32)
    gc.collect()
    view = cache[1:]
    del cache
    gc.collect()
    view.fill_(2.0)
    assert view.sum().item() == 2.0 * view.numel()


@pytest.mark.skipif(not thp_available(), reason="no transparent huge pages on this machine")
def test_kv_caches_sit_on_huge_pages() -> None:
    cache = allocate_kv_cache((256, 16, 8, 64), torch.float32)  # 8 MiB
    assert cache.data_ptr() % cpu_decode.HUGE_PAGE == 0
    assert huge_pages_of(cache) >= 2048  # at least one 2 MiB page (the kernel may refuse some)
