"""Capability tokens and lifetimes of offered pages (the prefill side of a remote transfer).

An :class:`Offer` holds one request's gathered pages (per prefill rank, uint8
``[num_pages, page_bytes]`` on that rank's device) while a decode process may pull them.
Its ``token`` is 64 random bits from :mod:`secrets`, written as 16 hex digits; the
transfer id of rank ``s`` is ``(int(token, 16) + s) mod 2**64`` (:func:`transfer_id`).
Nothing about the request (its id, its position in a queue) enters the id, so only a
holder of the token can name the pages.

Every offer is registered here until it is released: explicitly (:meth:`Offer.release`,
or leaving a ``with offer:`` block), or by the reaper thread once its TTL has passed.
Releasing withdraws the pages from the transport (their memory is freed at once, or, on the
CUDA IPC transport, as soon as a pull reading them ends; a later pull fails on the decode side
with an error instead of data) and drops them from :func:`live_offers`.
"""
from __future__ import annotations

import heapq
import itertools
import math
import secrets
import string
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import jax

TOKEN_HEX_DIGITS = 16   # 64 bits
_ID_MOD = 1 << 64       # transfer ids are uint64


def new_token() -> str:
  """A fresh capability token: 64 random bits from :mod:`secrets`, as 16 hex digits."""
  return secrets.token_hex(TOKEN_HEX_DIGITS // 2)


def check_token(token) -> int:
  """The integer value of a token; ``ValueError`` (that does not echo it) when malformed."""
  want = f"token must be a string of {TOKEN_HEX_DIGITS} hex digits (Offer.token)"
  if not isinstance(token, str):
    raise ValueError(f"{want}, got a {type(token).__name__}")
  if len(token) != TOKEN_HEX_DIGITS:
    raise ValueError(f"{want}, got a string of length {len(token)}")
  if not all(c in string.hexdigits for c in token):
    raise ValueError(f"{want}; it has other characters")
  return int(token, 16)


def transfer_id(token: str, rank: int) -> int:
  """The uint64 id under which prefill rank ``rank``'s pages of an offer are served."""
  return (check_token(token) + int(rank)) % _ID_MOD


class LiveOffers(NamedTuple):
  """Offers of this process not yet released: how many, and the bytes their pages hold."""
  count: int
  nbytes: int


class Offer:
  """A request's offered pages; pass ``token`` (with the server address) to the decode side.

  Attributes:
    token: the capability (16 hex digits). Whoever holds it and can reach the server can
      take the pages once; it is left out of ``repr``.
    ranks: the prefill ranks offered, ascending.
    num_pages, page_bytes: each rank's array is uint8 ``[num_pages, num_layers * page_bytes]``.
    num_layers: layers per page row (1 for :func:`~kvjax.transfer.remote.offer_request`; L for
      ``offer_request_layers``: row i holds block i's pages of layers 0..L-1 in order).
    ttl_s: seconds after the offer at which the pages are released if still offered.
    arrays: rank -> its gathered page array as offered (the socket transport serves these;
      the CUDA IPC transport copies and deletes them); empty once released.
    withdraw: set by the transport: frees what it holds of the offer (called once, on release).
  """

  def __init__(self, token: str, arrays: Dict[int, jax.Array], ttl_s: float, num_layers: int = 1):
    first = next(iter(arrays.values()))
    self.token = token
    self.ranks: Tuple[int, ...] = tuple(sorted(arrays))
    self.num_layers = int(num_layers)
    self.num_pages, self.page_bytes = int(first.shape[0]), int(first.shape[1]) // self.num_layers
    self.ttl_s = float(ttl_s)
    self.expires_at = math.inf   # set when tracked
    self.arrays: Dict[int, jax.Array] = dict(arrays)
    self.nbytes = sum(int(a.size) * a.dtype.itemsize for a in arrays.values())
    self._key: Optional[int] = None   # set by the registry
    self.withdraw: Optional[Callable[[], None]] = None

  @property
  def released(self) -> bool:
    return not self.arrays

  def release(self) -> None:
    """Free the pages now (idempotent). A pull that starts later fails on the decode side."""
    _REGISTRY.forget(self)
    arrays, self.arrays = self.arrays, {}
    withdraw, self.withdraw = self.withdraw, None
    if withdraw is not None:
      withdraw()
    for a in arrays.values():
      if not a.is_deleted():
        a.delete()

  def __enter__(self) -> "Offer":
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def __repr__(self) -> str:
    left = self.expires_at - time.monotonic()
    state = "released" if self.released else f"live, expires in {left:.1f} s"
    return (f"Offer(ranks={self.ranks}, num_layers={self.num_layers}, num_pages={self.num_pages}, "
            f"page_bytes={self.page_bytes}, {state})")


class _Registry:
  """Live offers of this process and a reaper thread that releases them at their TTL."""

  def __init__(self):
    self._cv = threading.Condition()
    self._keys = itertools.count()
    self._live: Dict[int, Offer] = {}          # key -> offer (keys are never reused)
    self._heap: List[Tuple[float, int]] = []   # (expires_at, key)
    self._reaper: Optional[threading.Thread] = None

  def ids_in_use(self) -> set:
    with self._cv:
      return {transfer_id(o.token, r) for o in self._live.values() for r in o.ranks}

  def add(self, offer: Offer) -> None:
    with self._cv:
      offer._key = next(self._keys)
      self._live[offer._key] = offer
      heapq.heappush(self._heap, (offer.expires_at, offer._key))
      if self._reaper is None:
        self._reaper = threading.Thread(target=self._reap, name="kvjax-offer-reaper", daemon=True)
        self._reaper.start()
      self._cv.notify()

  def forget(self, offer: Offer) -> None:
    with self._cv:
      self._live.pop(offer._key, None)

  def snapshot(self) -> LiveOffers:
    with self._cv:
      return LiveOffers(len(self._live), sum(o.nbytes for o in self._live.values()))

  def _reap(self) -> None:
    while True:   # daemon thread: lives as long as the process, sleeps while nothing expires
      with self._cv:
        while self._heap and self._heap[0][1] not in self._live:
          heapq.heappop(self._heap)                         # released early
        wait = self._heap[0][0] - time.monotonic() if self._heap else None
        if wait is None or wait > 0:
          self._cv.wait(timeout=wait)
          continue
        _, key = heapq.heappop(self._heap)
        offer = self._live.get(key)
      if offer is not None:
        offer.release()


_REGISTRY = _Registry()


def new_offer(arrays: Dict[int, jax.Array], ttl_s: float, num_layers: int = 1) -> Offer:
  """An :class:`Offer` of ``arrays`` under a fresh token whose transfer ids collide with no
  live offer's; not live until :func:`track`."""
  busy = _REGISTRY.ids_in_use()
  for _ in range(4):   # a collision has probability ~ (#live ids) / 2**64
    token = new_token()
    if not any(transfer_id(token, r) in busy for r in arrays):
      return Offer(token, arrays, ttl_s, num_layers)
  raise RuntimeError("could not draw a token whose transfer ids are free")


def track(offer: Offer) -> None:
  """Make ``offer`` live: counted by :func:`live_offers`, released ``ttl_s`` from now."""
  offer.expires_at = time.monotonic() + offer.ttl_s
  _REGISTRY.add(offer)


def live_offers() -> LiveOffers:
  """Offers of this process not yet released (pulled but unreleased ones included)."""
  return _REGISTRY.snapshot()


__all__ = ["Offer", "LiveOffers", "new_token", "check_token", "transfer_id", "live_offers",
           "new_offer", "track", "TOKEN_HEX_DIGITS"]
