"""Transfers over ``jax.experimental.transfer`` sockets: any two hosts, bytes through host memory.

:class:`SocketServer` gives the engine the interface :mod:`kvjax.transfer.remote` uses
(:meth:`~SocketServer.serve`, :meth:`~SocketServer.fetch`), like
:class:`kvjax.transfer.ipc_transport.IpcServer`.

Facts of the transfer engine (checked on jax 0.10.2, CPU; pulls between two processes on one
GPU also ran on jax 0.11.2, CUDA), which shape this module:

- An offer (``await_pull`` of an id) serves one pull; a pull of an id that is not
  offered (wrong token, already pulled, expired) waits without end, and ``pull``'s own
  ``timeout`` does not end that wait. ``pull`` itself returns at once: its arrays fill
  in the background and the Python thread keeps the GIL free while they do.
- So a pull is bounded here by polling ``is_ready()`` until a deadline, then poisoning
  the connection, which completes the pending arrays with an error; no JAX operation
  ever sees a pending array, so the decode caches stay untouched on failure and the
  process serves the next request.
- ``await_pull``'s ``timeout`` drops the server's entry at the TTL; deleting an offered
  array frees it at once, and a later pull of it ends with an error on the decode side.
- The transport is unauthenticated and unencrypted; servers bind only where told.
  :func:`start` refuses non-loopback addresses unless ``allow_remote=True``.
  See docs/transfers.md for the trust model.
"""
from __future__ import annotations

import datetime
import time
from typing import Callable, Dict, Sequence, Tuple

import jax
import jax.numpy as jnp

from kvjax.transfer.addresses import is_cuda_ipc, is_loopback
from kvjax.transfer.errors import PullError


def _transfer_module():
  try:
    from jax.experimental import transfer  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - depends on the jaxlib build
    raise RuntimeError("jax.experimental.transfer is not available in this jax build") from e
  return transfer


def deadline_datetime(seconds: float) -> datetime.datetime:
  return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)


class SocketServer:
  """A ``jax.experimental.transfer`` server; ``raw`` is jax's server object."""

  def __init__(self, raw):
    self.raw = raw

  def address(self) -> str:
    return self.raw.address()

  def connect(self, address: str):
    """jax's connection to another server (for tools; pulls go through :meth:`fetch`)."""
    return self.raw.connect(address)

  def serve(self, arrays: Dict[int, jax.Array], ttl_s: float) -> Callable[[], None]:
    """Offer each ready array once under its id until ``ttl_s`` from now; returns the function
    that withdraws them (deletes the arrays: a later pull ends with an error)."""
    expiry = deadline_datetime(ttl_s)   # the server drops its entries then, too
    for tid, a in arrays.items():
      self.raw.await_pull(tid, [a], timeout=expiry)
    kept = list(arrays.values())

    def withdraw():
      for a in kept:
        if not a.is_deleted():
          a.delete()
    return withdraw

  def fetch(self, address: str, wants: Dict[int, Tuple[Tuple[int, ...], object]],
            deadline: float, timeout_s: float):
    """Pull ids ``wants`` (id -> (uint8 shape, device)) over one connection, awaited together.

    Returns (id -> uint8 array, ``done``); ``done`` is a no-op (the bytes are this process's).
    Raises TimeoutError at ``deadline`` (``time.monotonic()`` seconds) and PullError as soon
    as one pull ends in an error; either way the connection is poisoned first.
    """
    if is_cuda_ipc(address):
      raise ValueError(f"address {address!r} is a CUDA IPC server's: pull with a server of "
                       "transport='cuda_ipc'")
    conn = self.raw.connect(address)
    server_deadline = deadline_datetime(timeout_s + 1.0)   # lets the peer drop a stale request
    pulled = {}
    for tid, (shape, device) in wants.items():
      want = jax.ShapeDtypeStruct(shape, jnp.uint8,
                                  sharding=jax.sharding.SingleDeviceSharding(device))
      pulled[tid] = conn.pull(tid, [want], timeout=server_deadline)[0]
    _await(conn, pulled, deadline, address, timeout_s)
    return pulled, lambda: None


def _cancel(conn) -> None:
  """Complete a connection's pending pulls with an error (no-op where jax lacks the hook)."""
  poison = getattr(conn, "_poison_connection", None)
  if poison is not None:
    poison()


def _await(conn, arrays: Dict[int, jax.Array], deadline: float, address: str,
           timeout_s: float) -> None:
  """Wait (GIL free, bounded by ``deadline``) until every pulled array is complete."""
  pending = dict(arrays)
  delay = 1e-4
  while pending:
    for tid in [t for t, a in pending.items() if a.is_ready()]:
      try:
        pending.pop(tid).block_until_ready()   # ready: raises only if the pull ended in an error
      except Exception as e:  # jax's runtime error type differs between versions
        _cancel(conn)
        raise PullError(f"pull from {address} failed ({e})") from e
    left = deadline - time.monotonic()
    if pending and left <= 0:
      _cancel(conn)
      raise TimeoutError(f"no bytes from {address} within {timeout_s:g} s")
    if pending:
      time.sleep(min(delay, left))
      delay = min(2 * delay, 1e-3)


def start(client=None, address: str = "127.0.0.1:0",
          transport_addresses: Sequence[str] = ("127.0.0.1:0",), *,
          allow_remote: bool = False) -> SocketServer:
  """A socket transfer server (see :func:`kvjax.transfer.remote.start_server`)."""
  transport_addresses = list(transport_addresses)
  if not transport_addresses:
    raise ValueError("transport_addresses must name at least one 'IP:port' (e.g. '127.0.0.1:0')")
  if not allow_remote:
    for name, addr in [("address", address)] + [("transport_addresses", a)
                                                  for a in transport_addresses]:
      if not is_loopback(addr):
        raise ValueError(
            f"{name}={addr!r} is not a loopback 'IP:port'; the transfer transport is "
            "unauthenticated and unencrypted, so binding beyond this host needs "
            "allow_remote=True and an isolated transfer network (see docs/transfers.md)")
  client = client or jax.devices()[0].client
  return SocketServer(_transfer_module().start_transfer_server(client, address,
                                                               transport_addresses))


__all__ = ["SocketServer", "start", "deadline_datetime"]
