"""Checking an engine server's refusal: its status and OpenAI's error body."""

from __future__ import annotations


def assert_error(r, status: int, *, param: str | None = None, says: tuple[str, ...] = ()) -> dict:
    """The response is `status` with `{"error": {message, type, param, code}}`, naming `param`
    and saying each of `says`; returns the error object."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    for word in says:
        assert word in err["message"], err["message"]
    return err
