"""The engine's reach into libraries' internals, one module per library, each pinned by a
contract test (`tests/engine/test_compat.py`) that fails on a release that changes what is
relied on, and each saying why it is worth it. Nothing else of ours touches these internals.

    torch.py     oneDNN's packed linear (`torch.ops.mkldnn`), 1.4-3.4x MKL's GEMM on a CPU
    uvicorn.py   `Server.capture_signals` overridden: a signal ends the server, not the process
"""
