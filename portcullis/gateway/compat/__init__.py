"""The gateway's reach into libraries' internals, one module per library, each pinned by a
contract test (`tests/gateway/test_compat.py`) that fails on a release that changes what is
relied on. Each trick says what it saves, measured; nothing else of ours touches an internal.

    limits.py    the in-memory storage's expiry pass, paced (a private, name-mangled hook)
    uvicorn.py   uvicorn's h11 protocol, which the connection guards subclass
"""
