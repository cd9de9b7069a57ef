"""Transfer server addresses: ``"IP:port"`` (socket transport) and ``"cuda-ipc://IP:port"``
(CUDA IPC transport), and which of them stay on this host."""
from __future__ import annotations

import ipaddress
from typing import Tuple

#: Addresses of CUDA IPC servers start with this; the rest is the control socket's "IP:port".
CUDA_IPC_SCHEME = "cuda-ipc://"


def is_loopback(address: str) -> bool:
  """True for ``"IP:port"`` / ``"[IPv6]:port"`` with a loopback IP literal (127.0.0.0/8, ::1)."""
  host, sep, _ = str(address).rpartition(":")
  if not sep:
    return False
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def is_cuda_ipc(address: str) -> bool:
  """Whether ``address`` is a CUDA IPC server's."""
  return isinstance(address, str) and address.startswith(CUDA_IPC_SCHEME)


def split_cuda_ipc(address: str) -> Tuple[str, int]:
  """(host, port) of ``"cuda-ipc://IP:port"``; ValueError naming what came otherwise."""
  if not is_cuda_ipc(address):
    raise ValueError(f"address must be a CUDA IPC server's address ({CUDA_IPC_SCHEME}IP:port), "
                     f"got {address!r}")
  host, sep, port = address[len(CUDA_IPC_SCHEME):].rpartition(":")
  if not sep or not port.isdigit():
    raise ValueError(f"address must be {CUDA_IPC_SCHEME}IP:port, got {address!r}")
  return host.strip("[]"), int(port)


__all__ = ["CUDA_IPC_SCHEME", "is_loopback", "is_cuda_ipc", "split_cuda_ipc"]
