"""`AuditKeyring`: the secrets that make the audit log verifiable, kept outside its directory.

One JSON file (mode 0600, in a 0700 folder) holds three kinds of key, each with an id:
    chain        HMAC-SHA256 keys: every line carries the id of the key that MACs it, so the
                 current key can be rotated while older lines stay verifiable (old keys stay in
                 the file, for verification only).
    signing      Ed25519 keys: periodic checkpoints sign the chain head; the public half is
                 enough to check them (`public_keys()`), rotated with the chain key.
    fingerprint  one HMAC key for `prompt_hmac` / `suffix_hmac`: the same prompt gives the same
                 value (reviewers can correlate) but nobody without the key can test a guess.
                 Never rotated by `rotate()`: a new key would break correlation across it.

Whoever can read this file can forge lines; keep it where the audit log's writers and readers
cannot (another user, a mounted secret). The file is created on first start and rewritten
whole (temp file + rename) on rotation, so a reader never sees half of it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from portcullis import envs

KEYRING_VERSION = 1
KEYRING_ENV = envs.AUDIT_KEYRING.name
DEFAULT_KEYRING = Path("secrets") / "audit-keyring.json"  # beside the policy, unless told otherwise
CHECKPOINT_CONTEXT = b"portcullis audit checkpoint v1"


class KeyringError(ValueError):
    """The keyring cannot be read or used; the message says what to fix."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


def _stamp() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(4)}"


def checkpoint_message(head_seq: int, head: str, time: str) -> bytes:
    """What a checkpoint signs: the head (the MAC of line `head_seq`) and when it was taken."""
    return b"%s\n%d\n%s\n%s" % (CHECKPOINT_CONTEXT, head_seq, head.encode(), time.encode())


@dataclass(frozen=True)
class ChainKey:
    id: str
    secret: bytes
    created: str

    def __post_init__(self) -> None:
        # The key's padded inner and outer states, computed once; each line copies them.
        object.__setattr__(self, "_base", hmac.new(self.secret, digestmod=hashlib.sha256))

    def mac(self, data: bytes) -> str:
        h = self._base.copy()  # type: ignore[attr-defined]
        h.update(data)
        return h.hexdigest()


@dataclass(frozen=True)
class SigningKey:
    id: str
    private: Ed25519PrivateKey | None  # None in a public-only keyring
    public: Ed25519PublicKey
    created: str

    def sign(self, message: bytes) -> str:
        if self.private is None:
            raise KeyringError(f"signing key {self.id} has only its public half here")
        return _b64(self.private.sign(message))

    def verifies(self, message: bytes, signature: str) -> bool:
        try:
            self.public.verify(_unb64(signature), message)
        except (InvalidSignature, ValueError):
            return False
        return True


class AuditKeyring:
    """The loaded keyring; the last chain and signing keys are the ones new lines use."""

    def __init__(self, path: Path | None, chain: list[ChainKey], signing: list[SigningKey],
                 fingerprint: bytes | None) -> None:
        self.path = path
        self.chain = {key.id: key for key in chain}
        self.signing = {key.id: key for key in signing}
        self.current_chain = chain[-1] if chain else None
        self.current_signing = signing[-1] if signing else None
        self._fingerprint = fingerprint
        # Keyed once (a copy per prompt: half the cost of a new HMAC, on the request's path).
        self._fingerprint_base = hmac.new(fingerprint, digestmod=hashlib.sha256) if fingerprint else None

    # ---- creating, loading, saving ------------------------------------------------------

    @classmethod
    def generate(cls, path: Path | None = None) -> AuditKeyring:
        return cls(path, [_new_chain_key()], [_new_signing_key()], secrets.token_bytes(32))

    @classmethod
    def load(cls, path: Path) -> AuditKeyring:
        try:
            data = json.loads(path.read_text())
            if data.get("version") != KEYRING_VERSION:
                raise KeyringError(f"{path}: unknown keyring version {data.get('version')!r}")
            chain = [ChainKey(k["id"], _unb64(k["secret"]), k["created"]) for k in data.get("chain", [])]
            signing = [_signing_key(k) for k in data.get("signing", [])]
            fingerprint = _unb64(data["fingerprint"]) if data.get("fingerprint") else None
        except FileNotFoundError:
            raise KeyringError(f"no audit keyring at {path}") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KeyringError(f"{path} is not a readable audit keyring ({exc})") from None
        return cls(path, chain, signing, fingerprint)

    @classmethod
    def load_or_create(cls, path: Path) -> AuditKeyring:
        """Load the keyring, or create it (0600 in a 0700 folder) if there is none yet. Several
        worker processes may start at once: the first to link its file in place wins."""
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with contextlib.suppress(FileExistsError):
                cls.generate(path).save(exclusive=True)
        _refuse_loose_mode(path)
        return cls.load(path)

    def save(self, exclusive: bool = False) -> None:
        """Write the whole keyring through a temp file: renamed over the old one, or (with
        `exclusive`) linked in place only if no file is there yet (FileExistsError)."""
        assert self.path is not None
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".keyring-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(self._to_json(), handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            if exclusive:
                os.link(temp, self.path)
            else:
                os.replace(temp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)

    def _to_json(self) -> dict[str, Any]:
        return {
            "version": KEYRING_VERSION,
            "chain": [{"id": k.id, "secret": _b64(k.secret), "created": k.created} for k in self.chain.values()],
            "signing": [_signing_json(k) for k in self.signing.values()],
            "fingerprint": _b64(self._fingerprint) if self._fingerprint else None,
        }

    def public_keys(self) -> dict[str, Any]:
        """The signing keys' public halves: enough to check checkpoints, useless for forging."""
        return {"version": KEYRING_VERSION, "signing": [
            {"id": k.id, "public": _b64(k.public.public_bytes_raw()), "created": k.created}
            for k in self.signing.values()]}

    def rotate(self) -> tuple[ChainKey, SigningKey]:
        """New chain and signing keys for new lines; the old ones stay for verification."""
        chain, signing = _new_chain_key(), _new_signing_key()
        self.chain[chain.id], self.signing[signing.id] = chain, signing
        self.current_chain, self.current_signing = chain, signing
        self.save()
        return chain, signing

    # ---- using ---------------------------------------------------------------------------

    def fingerprint(self, data: bytes) -> str:
        if self._fingerprint_base is None:
            raise KeyringError("this keyring has no fingerprint key")
        h = self._fingerprint_base.copy()
        h.update(data)
        return h.hexdigest()

    def created(self) -> str | None:
        """When the first chain key was made: lines without a MAC written after it are suspect."""
        return min((k.created for k in self.chain.values()), default=None)


def _new_chain_key() -> ChainKey:
    return ChainKey(_new_id("ak-"), secrets.token_bytes(32), _stamp())


def _new_signing_key() -> SigningKey:
    private = Ed25519PrivateKey.generate()
    return SigningKey(_new_id("sk-"), private, private.public_key(), _stamp())


def _signing_key(data: dict[str, Any]) -> SigningKey:
    private = Ed25519PrivateKey.from_private_bytes(_unb64(data["private"])) if data.get("private") else None
    public = private.public_key() if private else Ed25519PublicKey.from_public_bytes(_unb64(data["public"]))
    return SigningKey(data["id"], private, public, data["created"])


def _signing_json(key: SigningKey) -> dict[str, Any]:
    out = {"id": key.id, "public": _b64(key.public.public_bytes_raw()), "created": key.created}
    if key.private is not None:
        out["private"] = _b64(key.private.private_bytes_raw())
    return out


def _refuse_loose_mode(path: Path) -> None:
    mode = path.stat().st_mode & 0o077
    if mode:
        raise KeyringError(f"{path} is readable or writable by others (mode {oct(path.stat().st_mode & 0o777)}); "
                           f"run `chmod 600 {path}`")


def keyring_path(given: Path | None, policy: Path) -> Path:
    """The keyring a gateway (or `portcullis audit`) uses: the one given, else
    $PORTCULLIS_AUDIT_KEYRING, else secrets/audit-keyring.json beside the policy."""
    if given is not None:
        return given
    env = envs.AUDIT_KEYRING.get()
    return Path(env) if env else policy.parent / DEFAULT_KEYRING


def check_outside(keyring: Path, audit_log: Path) -> None:
    """Refuse a keyring in the audit log's own folder: whoever may rewrite the log must not
    find the key beside it."""
    if keyring.resolve().parent == audit_log.resolve().parent:
        raise KeyringError(f"the audit keyring {keyring} is in the audit log's folder; keep it elsewhere "
                           "(the default is secrets/audit-keyring.json beside the policy)")
