"""Where the engine's processes meet, on one host or several: torch.distributed's TCPStore (as
`torchrun` uses) on rank 0's host, and the network interface every rank's Gloo or NCCL
connections use.

Neither is authenticated (torch.distributed trusts whoever connects), so both stay on a private
network: the store listens only on the address given (torch's own would listen on every
interface), the collectives only on the interface that reaches it, and an address that is not
private is refused unless the operator says otherwise (`--allow-public-master-addr`).
"""
from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct

import torch.distributed as dist

STORE_TIMEOUT = datetime.timedelta(seconds=300)  # how long ranks wait for each other to start
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def check_private(addr: str, allow_public: bool = False) -> None:
    """Refuse a rendezvous address that is (or resolves to) a public one, unless allowed."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_STREAM)}
    except socket.gaierror as exc:
        raise ValueError(f"master_addr {addr!r} does not resolve: {exc.strerror}") from exc
    public = sorted(a for a in found if not (ipaddress.ip_address(a).is_private or ipaddress.ip_address(a).is_loopback))
    if public and not allow_public:
        raise ValueError(
            f"master_addr {addr} is a public address ({', '.join(public)}): the engine's processes talk over an "
            "unauthenticated channel; use a private network (or --allow-public-master-addr if it is one behind "
            "a firewall)")


def master_store(addr: str, port: int, world: int) -> tuple[dist.TCPStore, socket.socket]:
    """Rank 0's store, listening on `addr` alone (port 0: any free one; `store.port` says which),
    and its listening socket, which must stay open while the store serves."""
    ip = socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((ip, port))
    except OSError as exc:
        listener.close()
        raise ValueError(f"cannot listen for the engine's processes on {addr}:{port} ({exc.strerror})") from exc
    listener.listen(128)
    store = dist.TCPStore(ip, listener.getsockname()[1], world, True, STORE_TIMEOUT, wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    return store, listener


def use_interface_toward(addr: str) -> str:
    """Make this process's (and its children's) Gloo and NCCL connections use the interface that
    reaches `addr` (unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME already say); its name."""
    name = interface_toward(addr)
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, name)
    return name


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
