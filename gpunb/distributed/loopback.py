"""A launch on one machine listens on the loopback interface only.

The rendezvous TCPStore's server listens on every interface unless it is handed a
socket that is already bound (master_listen_fd); gloo and NCCL pick the interface of
their bootstrap sockets from GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. Multi-node runs
go through torchrun, which makes its own choices.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

HOST = "127.0.0.1"


def loopback_store(timeout_s: float = 60.0):
    """The parent's rendezvous store, listening on a free port of 127.0.0.1."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((HOST, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    # The store takes the socket over (detach: Python must not close it too).
    return dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())


def keep_sockets_on_loopback() -> None:
    """In a rank: gloo's and NCCL's sockets on the loopback interface too, unless the user
    chose an interface in the environment."""
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def loopback_interface() -> str | None:
    """The name of the interface that carries 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == HOST for address in addresses):
            return name
    return None
