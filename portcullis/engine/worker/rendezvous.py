"""Where the engine's processes meet, on one host or several: torch.distributed's TCPStore (as
`torchrun` uses) on rank 0's host, and the network interface every rank's Gloo or NCCL
connections use.

Neither is authenticated (torch.distributed trusts whoever connects), so both stay on a private
network: the store listens only on the address given (torch's own would listen on every
interface), the collectives only on the interface that reaches it, and an address that is not
private is refused unless the operator says otherwise (`--allow-public-master-addr`).
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import ipaddress
import os
import socket
import struct
import time

import torch.distributed as dist

from portcullis import envs

STORE_TIMEOUT = datetime.timedelta(seconds=300)  # how long ranks wait for each other to start


def distributed_timeout() -> datetime.timedelta:
    """How long a rank waits on another before failing (PORTCULLIS_DISTRIBUTED_TIMEOUT_S, default
    600 s): a rank that hangs ends the engine instead of holding it forever."""
    text = envs.DISTRIBUTED_TIMEOUT.get()
    try:
        seconds = float(text) if text else 600.0
    except ValueError:
        raise ValueError(f"{envs.DISTRIBUTED_TIMEOUT.name} must be a number of seconds, got {text!r}") from None
    if seconds <= 0:
        raise ValueError(f"{envs.DISTRIBUTED_TIMEOUT.name} must be positive, got {text!r}")
    return datetime.timedelta(seconds=seconds)
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def check_private(addr: str, allow_public: bool = False) -> None:
    """Refuse a rendezvous address that is (or resolves to) a public one, unless allowed."""
    found = {info[4][0] for info in _resolve(addr)}
    if any(ipaddress.ip_address(a).is_unspecified for a in found):
        raise ValueError(f"master_addr {addr} means every interface; give the private address node 0 listens on")
    public = sorted(a for a in found if not (ipaddress.ip_address(a).is_private or ipaddress.ip_address(a).is_loopback))
    if public and not allow_public:
        raise ValueError(
            f"master_addr {addr} is a public address ({', '.join(public)}): the engine's processes talk over an "
            "unauthenticated channel; use a private network (or --allow-public-master-addr if it is one behind "
            "a firewall)")


def _resolve(addr: str, wait_s: float = 60.0) -> list:
    """`addr`'s IPv4 addresses, retried for a while: a group's pods may start before the leader's
    name is in the cluster's DNS (a LeaderWorkerSet's LWS_LEADER_ADDRESS)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                raise ValueError(f"master_addr {addr!r} does not resolve: {exc.strerror}") from exc
            time.sleep(1.0)


def master_store(addr: str, port: int, world: int) -> dist.TCPStore:
    """Rank 0's store, listening on `addr` alone (port 0: any free one; `store.port` says which).
    The store owns the listening socket from then on, and closes it when it is freed."""
    ip = socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((ip, port))
    except OSError as exc:
        listener.close()
        raise ValueError(f"cannot listen for the engine's processes on {addr}:{port} ({exc.strerror})") from exc
    listener.listen(128)
    try:
        store = dist.TCPStore(ip, listener.getsockname()[1], world, True, STORE_TIMEOUT, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the descriptor is the store's now: never closed twice
    return store


@contextlib.contextmanager
def connections_toward(addr: str, keep_nccl: bool = False):
    """While inside, Gloo and NCCL connections made by this process (and processes it starts) use
    the interface that reaches `addr` (unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME already
    say); afterwards this process's environment is as it was, except NCCL's with `keep_nccl`
    (NCCL reads it when it first communicates, after the group is formed)."""
    name = interface_toward(addr)
    unset = {"GLOO_SOCKET_IFNAME": "GLOO_SOCKET_IFNAME" not in os.environ,
             "NCCL_SOCKET_IFNAME": "NCCL_SOCKET_IFNAME" not in os.environ}
    added = [variable for variable, free in unset.items() if free]
    restored = [v for v in added if not (keep_nccl and v == "NCCL_SOCKET_IFNAME")]
    os.environ.update(dict.fromkeys(added, name))
    try:
        yield name
    finally:
        for variable in restored:
            os.environ.pop(variable, None)


def interface_toward(addr: str) -> str:
    ip = socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, 9))  # no packet is sent: the kernel picks the route and the local address
        local = probe.getsockname()[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(raw[20:24]) == local:
                return name
    raise ValueError(f"no network interface holds {local}, the address this host reaches {addr} from")


# What every rank must agree on to compute one model (paths may differ between hosts).
AGREED = ("torch_dtype", "torch_kv_cache_dtype", "max_model_len", "block_size", "tensor_parallel_size",
          "pipeline_parallel_size", "nnodes", "gguf_dequantize",
          "gguf_activations")
_CONFIG, _JOINED = "portcullis/config", "portcullis/joined/"


def config_fingerprint(config) -> str:
    """The model's config and the settings in `AGREED`, as a short hash and their values."""
    settings = {name: str(getattr(config, name)) for name in AGREED}
    model = hashlib.sha256(config.hf_config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    return f"model config {model}, " + ", ".join(f"{k}={v}" for k, v in settings.items())


def publish_config(store: dist.TCPStore, config) -> None:
    store.set(_CONFIG, config_fingerprint(config))


def join(store: dist.TCPStore, rank: int, config) -> None:
    """A worker's first act: compare its settings with rank 0's and say so; refuse to go on if they differ."""
    ours, theirs = config_fingerprint(config), store.get(_CONFIG).decode()
    store.set(f"{_JOINED}{rank}", "ok" if ours == theirs else f"rank {rank}: {ours}")
    if ours != theirs:
        raise ValueError(f"this node's engine settings differ from node 0's: ours {ours}; node 0's {theirs}")


def await_ranks(store: dist.TCPStore, ranks: range, config, timeout_s: float, local: list = ()) -> None:
    """On rank 0: wait until every other rank has joined with settings equal to ours (`local`:
    this node's worker processes, whose early death ends the wait)."""
    deadline, waiting = time.monotonic() + timeout_s, list(ranks)
    while waiting:
        if dead := [p.exitcode for p in local if p.exitcode is not None]:
            raise ValueError(f"a worker process ended while starting (exit code {dead[0]}); see its log above")
        ready = [r for r in waiting if store.check([f"{_JOINED}{r}"])]
        for rank in ready:
            answer = store.get(f"{_JOINED}{rank}").decode()
            if answer != "ok":
                raise ValueError(f"a node's engine settings differ from this one's ({config_fingerprint(config)}): {answer}")
        waiting = [r for r in waiting if r not in ready]
        if waiting and time.monotonic() > deadline:
            raise ValueError(f"ranks {waiting} did not join within {timeout_s:.0f} s: start the other nodes with "
                             f"--headless --master-addr {config.master_addr} --master-port {config.master_port}")
        time.sleep(0.05)
