"""Contract tests for what the engine relies on of libraries' internals (`engine.compat`): each
fails on a release of the library that changes it, before the trick breaks silently."""
from __future__ import annotations

import asyncio
import inspect
import signal
import socket

import pytest
import torch
import torch.nn.functional as F
import uvicorn

from portcullis.engine.compat.torch import pack_weight, packed_linear
from portcullis.engine.compat.uvicorn import GracefulServer
from portcullis.engine.model.layers import _onednn_agrees

# -- torch: oneDNN's packed linear ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 40), (6, 40), (2, 3, 40)])
def test_onednn_packed_linear_is_f_linear_or_the_probe_leaves_weights_unpacked(dtype, shape):
    """What the layers rely on: the two ops exist, take these arguments (a weight, an input of
    any leading shape, an optional bias) and agree with F.linear; where this CPU cannot run them
    in `dtype` (bf16 without AVX-512), the load-time probe says so and nothing is packed."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(*shape, generator=gen).to(dtype)
    if not _onednn_agrees(dtype):
        assert dtype is torch.bfloat16 or not torch.backends.mkldnn.is_available(), \
            "torch.ops.mkldnn's packed linear is gone or changed: float32 layers lost 1.4-3.4x"
        return
    packed = pack_weight(w)
    for bias in (None, b):
        got, want = packed_linear(x, packed, bias), F.linear(x, w, bias)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_the_probe_turns_down_what_onednn_cannot_pack():
    assert not _onednn_agrees(torch.float64)


# -- uvicorn: Server.capture_signals -------------------------------------------------------


async def _noop(scope, receive, send) -> None:
    return None


def _serve_until_sigterm(server_class: type[uvicorn.Server]) -> list[int]:
    """Serve on the main thread and send ourselves SIGTERM once started; the signals that reached
    the handler in place before (uvicorn raises a captured one again after its shutdown)."""
    reached: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: reached.append(sig))
    server = server_class(uvicorn.Config(_noop, lifespan="off", log_level="warning"))

    async def run() -> None:
        async def stop_once_started() -> None:
            while not server.started:
                await asyncio.sleep(0.01)
            signal.raise_signal(signal.SIGTERM)

        stopper = asyncio.ensure_future(stop_once_started())
        with socket.create_server(("127.0.0.1", 0)) as sock:
            await server.serve(sockets=[sock])
        await stopper

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return reached


def test_a_signal_ends_the_graceful_server_and_not_the_process():
    """uvicorn's `serve` runs inside `capture_signals`, a contextmanager method, and raises SIGTERM
    again after a graceful shutdown (the reason for the override); the engine's server shuts down
    on it and returns, so its socket file can be removed. A rename leaves both raising it."""
    assert inspect.isgeneratorfunction(inspect.unwrap(uvicorn.Server.capture_signals))
    assert _serve_until_sigterm(uvicorn.Server) == [signal.SIGTERM]
    assert _serve_until_sigterm(GracefulServer) == []
