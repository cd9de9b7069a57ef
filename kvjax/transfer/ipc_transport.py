"""Transfers between processes of one host over CUDA IPC: the pages are read in place.

The prefill side copies each offered page array once into shareable device memory (slabs it
allocates with the CUDA driver, :mod:`kvjax.transfer.cuda_driver`; JAX's own buffers cannot
be shared) and answers a pull over a loopback control socket with the slab's IPC handle and
the piece's offset. The decode side maps the slab (once per slab: later pulls reuse the
mapping), reads the piece as a uint8 JAX array in place, scatters it into its caches, and
acknowledges; only then may the prefill side reuse the piece. One pull moves the bytes once
across device memory (the copy an offer makes is the prefill side's, at offer time).

Guarantees (the same as the socket transport's, :mod:`kvjax.transfer.socket_transport`):
an offered id serves one pull; a pull of an id that is not offered (another token, expired,
released, already pulled) is answered with an error at once, and the round it came in fails
whole (its other ids, read but not used, are offered again); every wait is bounded by the
pull's deadline; nothing is written into the decode caches unless every page arrived.
Releasing an offer while its pull reads it frees the piece when the reader acknowledges (or
its connection ends), never earlier. Slabs live as long as the server (:meth:`close`).

The control socket carries handles, not data, and has no authentication: a process of the
host that can reach it and holds a token can read that offer. It binds only loopback.
"""
from __future__ import annotations

import collections
import json
import socket
import struct
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import jax

from kvjax.transfer.addresses import CUDA_IPC_SCHEME, is_loopback, split_cuda_ipc
from kvjax.transfer.cuda_driver import CudaIpcMemory
from kvjax.transfer.errors import PullError
from kvjax.transfer.slabs import DEFAULT_SLAB_BYTES, Piece, Slabs

_LEN = struct.Struct("!I")
_MAX_MESSAGE = 1 << 16   # control messages are a few hundred bytes; a longer one ends the link
_MAX_VIEWS = 256         # imported views kept for reuse (views only: they hold no memory)


# -- the control socket: one JSON object per message, after its 4-byte length ----------------
def _send(sock: socket.socket, obj) -> None:
  data = json.dumps(obj).encode()
  sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
  buf = b""
  while len(buf) < n:
    chunk = sock.recv(n - len(buf))
    if not chunk:
      return None
    buf += chunk
  return buf


def _recv(sock: socket.socket):
  """The next message, or None when the peer closed the connection."""
  head = _recv_exact(sock, _LEN.size)
  if head is None or _LEN.unpack(head)[0] > _MAX_MESSAGE:
    return None
  body = _recv_exact(sock, _LEN.unpack(head)[0])
  return None if body is None else json.loads(body)


def padded_rows(n: int) -> int:
  """The rows a piece of an ``n``-row array has room for, and that a pull views: ``n`` rounded
  up to a power of two up to 256, then to a multiple of 256. The receive then compiles one
  program per size, not one per request length; the extra rows hold no data (the receive
  skips them)."""
  n = int(n)
  return 1 << max(0, n - 1).bit_length() if n <= 256 else -(-n // 256) * 256


class _Entry:
  """One offered id: its piece (room for :func:`padded_rows` rows), the array's ``nbytes``,
  and its state, ``"offered"`` -> ``"reading"`` -> ``"pulled"`` (the piece is free once
  pulled); ``withdrawn`` when released while being read."""
  __slots__ = ("piece", "slabs", "nbytes", "state", "withdrawn")

  def __init__(self, piece: Piece, slabs: Slabs, nbytes: int):
    self.piece, self.slabs, self.nbytes = piece, slabs, int(nbytes)
    self.state, self.withdrawn = "offered", False


class _Client:
  """This process's reused connection to one prefill server."""

  def __init__(self, sock: socket.socket):
    self.sock, self.lock = sock, threading.Lock()


class IpcServer:
  """A CUDA IPC transfer server: offers pages (:meth:`serve`) and pulls them (:meth:`fetch`).

  Args:
    address: the control socket's ``"IP:port"``, loopback only (free port by default).
    slab_bytes: shareable device memory allocated at a time per device.
    memory: the device memory it shares (:class:`CudaIpcMemory`; tests pass a stand-in).
  ``address()`` (``"cuda-ipc://IP:port"``) is what the other process connects to.
  """

  def __init__(self, address: str = "127.0.0.1:0", *, slab_bytes: int = DEFAULT_SLAB_BYTES,
               memory=None):
    if not is_loopback(address):
      raise ValueError(f"address={address!r} is not a loopback 'IP:port'; CUDA IPC reaches only "
                       "processes of this host")
    host, _, port = address.rpartition(":")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    self._listener = socket.create_server((host.strip("[]"), int(port)), family=family)
    bound = self._listener.getsockname()
    self._address = f"{CUDA_IPC_SCHEME}{host}:{bound[1]}"
    self.memory = memory or CudaIpcMemory()
    self.slab_bytes = int(slab_bytes)
    self._lock = threading.Lock()
    self._entries: Dict[int, _Entry] = {}
    self._slabs: Dict[object, Slabs] = {}           # device -> its slabs
    self._clients: Dict[str, _Client] = {}          # address -> connection (pull side)
    self._mapped: Dict[Tuple[object, bytes], int] = {}   # (device, handle) -> mapped start
    # (device, address, shape) -> the JAX array viewing that memory in place (where the
    # memory's views alias it): importing a view costs more than the rest of a small pull,
    # and pieces of one size come back at the same offsets
    self._views: "collections.OrderedDict[tuple, jax.Array]" = collections.OrderedDict()
    self._closed = False
    threading.Thread(target=self._accept, name="kvjax-ipc-accept", daemon=True).start()

  def address(self) -> str:
    return self._address

  # -- the offering side -----------------------------------------------------------------
  def serve(self, arrays: Dict[int, jax.Array], ttl_s: float) -> Callable[[], None]:
    """Offer each ready single-device array ``[n, ...]`` once under its id (copied into
    shared memory with room for :func:`padded_rows` rows; the array is deleted); returns the
    function that withdraws them (idempotent). The offer's owner withdraws them at its TTL
    (``ttl_s`` is not needed here)."""
    del ttl_s
    ids = list(arrays)
    try:
      for tid, a in arrays.items():
        device = next(iter(a.devices()))
        with self._lock:
          slabs = self._slabs.setdefault(device, Slabs(self.memory, device, self.slab_bytes))
          piece = slabs.take(a.nbytes // max(1, a.shape[0]) * padded_rows(a.shape[0]))
        self.memory.fill(device, piece.ptr, a)
        with self._lock:
          self._entries[tid] = _Entry(piece, slabs, a.nbytes)
        a.delete()
    except BaseException:
      self._withdraw(ids)
      raise
    return lambda: self._withdraw(ids)

  def _withdraw(self, ids) -> None:
    with self._lock:
      for tid in ids:
        e = self._entries.get(tid)
        if e is None:
          continue
        if e.state == "reading":
          e.withdrawn = True      # freed when its reader acknowledges
          continue
        del self._entries[tid]
        if e.state == "offered":
          e.slabs.give(e.piece)

  def _accept(self) -> None:
    while True:
      try:
        conn, _ = self._listener.accept()
      except OSError:   # closed
        return
      if self._closed:
        conn.close()
        return
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # answers go out at once
      threading.Thread(target=self._answer, args=(conn,), name="kvjax-ipc-conn",
                       daemon=True).start()

  def _answer(self, conn: socket.socket) -> None:
    """Answer one connection's pulls until it closes; its unacknowledged reads end with it."""
    reading = set()
    try:
      while True:
        msg = _recv(conn)
        if msg is None:
          return
        tid = int(msg["id"])
        if msg["op"] in ("done", "undo"):
          self._finish(tid, used=msg["op"] == "done")
          reading.discard(tid)
          continue
        with self._lock:
          e = self._entries.get(tid)
          if e is None or e.state != "offered":
            answer = {"error": "no offer under this id (another token, expired, released or "
                               "already pulled)"}
          elif e.nbytes != int(msg["nbytes"]):
            answer = {"error": f"the offer holds {e.nbytes} bytes, the pull expects "
                               f"{int(msg['nbytes'])} (page sizes or layer counts disagree)"}
          else:
            e.state = "reading"
            reading.add(tid)
            answer = {"handle": e.piece.handle.hex(), "offset": e.piece.offset}
        _send(conn, answer)
    except (OSError, ValueError, KeyError):
      return
    finally:
      for tid in reading:
        self._finish(tid)
      conn.close()

  def _finish(self, tid: int, used: bool = True) -> None:
    """A pull of ``tid`` is over. Used: the piece is free (the offer stays pulled until
    released). Not used (the pull failed on another id of its round): offered again, unless
    it was released meanwhile."""
    with self._lock:
      e = self._entries.get(tid)
      if e is None or e.state != "reading":
        return
      if not used and not e.withdrawn:
        e.state = "offered"
        return
      e.slabs.give(e.piece)
      e.state = "pulled"           # never served again
      if e.withdrawn:
        del self._entries[tid]

  # -- the pulling side ------------------------------------------------------------------
  def fetch(self, address: str, wants: Dict[int, Tuple[Tuple[int, ...], object]],
            deadline: float, timeout_s: float):
    """Pull ids ``wants`` (id -> (uint8 shape, device)) from the server at ``address``.

    Returns (id -> uint8 array read in place, ``done``): call ``done()`` once every use of
    the arrays is complete; the prefill side may reuse their memory after that. An array has
    :func:`padded_rows` rows: the wanted ones first, then rows that hold no data.
    Raises TimeoutError at ``deadline`` (``time.monotonic()`` seconds) and PullError on an
    error answer or a lost connection.
    """
    host, port = split_cuda_ipc(address)
    client = self._client(address, host, port, deadline, timeout_s)
    got: Dict[int, Tuple[str, int]] = {}
    with client.lock:
      try:
        for tid, (shape, _) in wants.items():
          _send(client.sock, {"op": "pull", "id": int(tid), "nbytes": _nbytes(shape)})
        errors = []
        for tid in wants:
          client.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
          answer = _recv(client.sock)
          if answer is None:
            raise PullError(f"the server at {address} closed the connection")
          if "error" in answer:   # (ids are not named: they derive from the token)
            errors.append(answer["error"])
          else:
            got[tid] = (answer["handle"], int(answer["offset"]))
      except socket.timeout:
        self._drop_client(address)
        raise TimeoutError(f"no answer from {address} within {timeout_s:g} s") from None
      except PullError:
        self._drop_client(address)
        raise
      except OSError as e:
        self._drop_client(address)
        raise PullError(f"the connection to {address} failed ({e})") from e
    done = lambda: self._acknowledge(address, client, list(got))  # noqa: E731
    undo = lambda: self._acknowledge(address, client, list(got), op="undo")  # noqa: E731
    if errors:             # the round fails whole; the ids it did read stay offered
      undo()
      raise PullError("; ".join(sorted(set(errors))))
    try:
      arrays = {tid: self._view(address, _padded(wants[tid]), *got[tid]) for tid in got}
    except BaseException:
      undo()
      raise
    return arrays, done

  def _client(self, address, host, port, deadline, timeout_s) -> _Client:
    with self._lock:
      client = self._clients.get(address)
    if client is None:
      try:
        sock = socket.create_connection((host, port),
                                        timeout=max(deadline - time.monotonic(), 1e-3))
      except socket.timeout:
        raise TimeoutError(f"could not connect to {address} within {timeout_s:g} s") from None
      except OSError as e:
        raise PullError(f"could not connect to {address} ({e})") from e
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      client = _Client(sock)
      with self._lock:
        client = self._clients.setdefault(address, client)
    return client

  def _drop_client(self, address: str) -> None:
    with self._lock:
      client = self._clients.pop(address, None)
    if client is not None:
      client.sock.close()   # the server ends this connection's reads

  def _acknowledge(self, address: str, client: _Client, ids, op: str = "done") -> None:
    """Tell the server the reads of ``ids`` are over: ``"done"`` (used) or ``"undo"`` (not
    used: offered again)."""
    with client.lock:
      try:
        for tid in ids:
          _send(client.sock, {"op": op, "id": int(tid)})
      except OSError:
        self._drop_client(address)

  def _view(self, address: str, want, handle_hex: str, offset: int) -> jax.Array:
    shape, device = want
    key = (device, bytes.fromhex(handle_hex))
    with self._lock:
      mapped = self._mapped.get(key)
      if mapped is None and address == self._address:   # our own offer: read our slab
        mapped = next((ptr for s in self._slabs.values() for ptr, h in s.handles() if h == key[1]),
                      None)
    if mapped is None:
      mapped = self.memory.open(device, key[1])
      with self._lock:
        self._mapped[key] = mapped
    if not getattr(self.memory, "views_alias", False):   # a view that copies: never reused
      return self.memory.view(mapped + offset, shape, device)
    view_key = (device, mapped + offset, tuple(shape))
    with self._lock:
      view = self._views.get(view_key)
      if view is not None:
        self._views.move_to_end(view_key)
        return view
    view = self.memory.view(mapped + offset, shape, device)
    with self._lock:
      self._views[view_key] = view
      while len(self._views) > _MAX_VIEWS:
        self._views.popitem(last=False)
    return view

  def close(self) -> None:
    """Stop answering, unmap what this process mapped, free this server's slabs. Offers not
    yet pulled fail on the decode side; decode processes must not read after this."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      clients, self._clients = list(self._clients.values()), {}
      mapped, self._mapped = dict(self._mapped), {}
      self._views.clear()
      slabs, self._slabs = list(self._slabs.values()), {}
      self._entries.clear()
    try:
      self._listener.shutdown(socket.SHUT_RDWR)   # wakes the accepting thread
    except OSError:
      pass
    self._listener.close()
    for c in clients:
      c.sock.close()
    for (device, _), ptr in mapped.items():
      self.memory.close(device, ptr)
    for s in slabs:
      s.free_all()


def _padded(want):
  """A want ``(shape, device)`` with its rows padded to the piece's room."""
  shape, device = want
  return (padded_rows(shape[0]), *shape[1:]), device


def _nbytes(shape) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n


__all__ = ["IpcServer", "padded_rows"]
