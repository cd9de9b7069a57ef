"""Cross-process transfers over ``jax.experimental.transfer`` (disaggregated prefill/decode).

The prefill process *offers* a request's pages (:func:`offer_request`): per prefill
rank, the gathered pages as one uint8 ``[n, remote_page_bytes]`` array on that rank's
device, served once under an id derived from the offer's secret ``token``
(:mod:`kvjax.transfer.offers`). The decode process, given the server address and the
token by the serving router, *pulls* (:func:`pull_request`) exactly the source ranks its
read plans name, each once, onto the first decode device that needs it, then applies
the plans and scatters the pages into its caches at its own block ids (as
:func:`kvjax.transfer.transfer_blocks` does within one process).
:func:`offer_request_layers` / :func:`pull_request_layers` do the same for a request's pages
of every layer under one token, in one pull round (:mod:`kvjax.transfer.all_layers`).

Facts of the transfer engine (checked on jax 0.10.2, CPU), which shape this module:

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
  :func:`start_server` refuses non-loopback addresses unless ``allow_remote=True``.
  See docs/transfers.md for the trust model.
"""
from __future__ import annotations

import datetime
import ipaddress
import math
import time
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import spec as S
from kvjax.transfer import all_layers as AL
from kvjax.transfer import execute as E
from kvjax.transfer import plan as PL
from kvjax.transfer import topology as T
from kvjax.transfer.offers import (LiveOffers, Offer, check_token, live_offers, new_offer, track,
                                   transfer_id)

#: Default seconds an offer stays pullable (:func:`offer_request`'s ``ttl_s``).
DEFAULT_TTL_S = 60.0
#: Default seconds a pull may take (:func:`pull_request`'s ``timeout_s``).
DEFAULT_TIMEOUT_S = 30.0


class PullError(ConnectionError):
  """The prefill side answered a pull with an error (its offer was released, it closed the
  connection, or the page sizes disagree). Like :class:`TimeoutError` it is an
  :class:`OSError`: ``except OSError`` catches every failed pull."""


def _transfer_module():
  try:
    from jax.experimental import transfer  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - depends on the jaxlib build
    raise RuntimeError("jax.experimental.transfer is not available in this jax build") from e
  return transfer


def is_loopback(address: str) -> bool:
  """True for ``"IP:port"`` / ``"[IPv6]:port"`` with a loopback IP literal (127.0.0.0/8, ::1)."""
  host, sep, _ = str(address).rpartition(":")
  if not sep:
    return False
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def start_server(client=None, address: str = "127.0.0.1:0",
                 transport_addresses: Sequence[str] = ("127.0.0.1:0",), *,
                 allow_remote: bool = False):
  """A transfer server on ``address`` (loopback, free port by default).

  client: the backend client (default: that of ``jax.devices()[0]``).
  address, transport_addresses: ``"IP:port"``; the control socket and the bulk-data
    sockets. Both default to loopback. Any other address needs ``allow_remote=True``:
    the transport has no authentication or encryption, so only bind an address on an
    isolated transfer network (docs/transfers.md).
  ``server.address()`` is what the other process connects to.
  """
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
  return _transfer_module().start_transfer_server(client, address, transport_addresses)


def needed_remote_ranks(tp_size: int, remote_tp_size: int, total_num_kv_heads: int,
                        is_mla: bool = False) -> List[int]:
  """Remote ranks that a whole TP group of size ``tp_size`` reads (sorted, unique)."""
  ranks = set()
  for r in range(tp_size):
    ranks.update(T.source_ranks(r, tp_size, remote_tp_size, total_num_kv_heads, is_mla))
  return sorted(ranks)


def _deadline_datetime(seconds: float) -> datetime.datetime:
  return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)


def _check_seconds(name: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")
  return float(value)


def offer_request(server, prefill_caches: Sequence[jax.Array], block_ids, *,
                  ranks: Optional[Sequence[int]] = None, ttl_s: float = DEFAULT_TTL_S) -> Offer:
  """Offer a request's pages of every prefill rank (or only ``ranks``), one pull each.

  Args:
    server: this process's transfer server (:func:`start_server`).
    prefill_caches: the P per-rank caches (one layer), each on its device.
    block_ids: the request's prefill block ids (non-empty, within the caches).
    ranks: offer only these ranks (e.g. :func:`needed_remote_ranks` of the decode TP size),
      so no rank stays unpulled.
    ttl_s: the pages are released this many seconds after the offer if nobody released
      them before (:meth:`Offer.release`, ``with offer:``).
  Returns:
    The live :class:`Offer`; send ``offer.token`` with ``server.address()`` to the decode side.
  """
  ttl_s = _check_seconds("ttl_s", ttl_s)
  if not prefill_caches:
    raise ValueError("prefill_caches must be non-empty")
  ids = _offered_block_ids(block_ids, min(int(c.shape[0]) for c in prefill_caches))
  arrays = {s: E.gather_page_bytes(prefill_caches[s], ids)
            for s in _offered_ranks(ranks, len(prefill_caches))}
  return _serve(server, arrays, ttl_s, num_layers=1)


def offer_request_layers(server, prefill_rank_layers: Sequence[AL.RankLayers], block_ids, *,
                         spec=None, ranks: Optional[Sequence[int]] = None,
                         ttl_s: float = DEFAULT_TTL_S) -> Offer:
  """Offer a request's pages of **all layers** under one token: one pull per prefill rank.

  Args:
    server: this process's transfer server (:func:`start_server`).
    prefill_rank_layers: per prefill rank (P of them, each on its device), that rank's caches
      of every layer: a list of L one-layer caches, or one layered array
      (``spec.physical_shape(B, L)``, :mod:`kvjax.layers`).
    block_ids: the request's prefill block ids (the same in every layer).
    spec: the prefill per-rank spec (checks the caches; needed for layered arrays).
    ranks, ttl_s: as :func:`offer_request`.
  Returns:
    The live :class:`Offer` (``num_layers`` = L); each rank's pages are one uint8 array
    ``[n, L * page_bytes]`` (:mod:`kvjax.transfer.all_layers`), served once.
  """
  ttl_s = _check_seconds("ttl_s", ttl_s)
  if not prefill_rank_layers:
    raise ValueError("prefill_rank_layers must be non-empty")
  if spec is not None:
    num_layers, num_blocks = AL.check_rank_layers("prefill", prefill_rank_layers, spec)
  else:
    if any(AL.is_layered(x) for x in prefill_rank_layers):
      raise ValueError("layered prefill caches need spec= (their layer axis depends on the "
                       "layout)")
    num_layers = len(prefill_rank_layers[0])
    num_blocks = min(int(c.shape[0]) for x in prefill_rank_layers for c in x)
    if any(len(x) != num_layers for x in prefill_rank_layers):
      raise ValueError("prefill ranks disagree on the number of layers")
  ids = _offered_block_ids(block_ids, num_blocks)
  arrays = {s: AL.gather_layers(prefill_rank_layers[s], ids, spec)
            for s in _offered_ranks(ranks, len(prefill_rank_layers))}
  return _serve(server, arrays, ttl_s, num_layers=num_layers)


def _offered_block_ids(block_ids, num_blocks: int) -> np.ndarray:
  if np.size(block_ids) == 0:
    raise ValueError("block_ids must name at least one block")
  return PL._check_block_ids("block_ids", block_ids, num_blocks).astype(np.int32)


def _offered_ranks(ranks, p: int) -> List[int]:
  ranks = list(range(p) if ranks is None else ranks)
  for s in ranks:
    if not 0 <= s < p:
      raise ValueError(f"rank {s} is not a prefill rank of {p}")
  if not ranks:
    raise ValueError("ranks must name at least one prefill rank")
  return sorted({int(s) for s in ranks})


def _serve(server, arrays: Dict[int, jax.Array], ttl_s: float, num_layers: int) -> Offer:
  """Offer each rank's gathered pages once under a fresh token; live until released or TTL."""
  jax.block_until_ready(list(arrays.values()))
  offer = new_offer(arrays, ttl_s, num_layers)
  expiry = _deadline_datetime(ttl_s)   # the server drops its entries then, too
  try:
    for s, a in arrays.items():
      server.await_pull(transfer_id(offer.token, s), [a], timeout=expiry)
  except BaseException:
    offer.release()
    raise
  track(offer)
  return offer


def _cancel(conn) -> None:
  """Complete a connection's pending pulls with an error (no-op where jax lacks the hook)."""
  poison = getattr(conn, "_poison_connection", None)
  if poison is not None:
    poison()


def _await_pulls(conn, arrays: Dict[int, jax.Array], deadline: float, address: str,
                 timeout_s: float) -> None:
  """Wait (GIL free, bounded by ``deadline``) until every pulled array is complete.

  Raises TimeoutError at the deadline and PullError as soon as one rank's pull ends in an
  error; either way the connection is poisoned first, so nothing keeps writing.
  """
  pending = dict(arrays)
  delay = 1e-4
  while pending:
    for s in [s for s, a in pending.items() if a.is_ready()]:
      try:
        pending.pop(s).block_until_ready()   # ready: raises only if the pull ended in an error
      except Exception as e:  # jax's runtime error type differs between versions
        _cancel(conn)
        raise PullError(f"pull of prefill rank {s} from {address} failed ({e}); decode caches "
                        "are untouched") from e
    left = deadline - time.monotonic()
    if pending and left <= 0:
      _cancel(conn)
      raise TimeoutError(
          f"pull of prefill ranks {sorted(pending)} from {address} did not complete within "
          f"{timeout_s:g} s (the prefill process is dead or stalled, or the offer is gone: "
          "expired, released, already pulled, or another token); decode caches are untouched")
    if pending:
      time.sleep(min(delay, left))
      delay = min(2 * delay, 1e-3)


def pull_request(server, address: str, decode_caches: Sequence[jax.Array], spec, dst_block_ids,
                 *, token: str, remote_tp_size: int, total_num_kv_heads: int,
                 is_mla: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S):
  """Pull a request's pages from the prefill process and write them into the decode caches.

  Args:
    server: this process's transfer server (:func:`start_server`).
    address: the prefill server's ``address()``.
    decode_caches: the D per-rank caches of ``spec`` (this rank's spec), each on its device.
    spec: the decode per-rank spec.
    dst_block_ids: the decode block ids of the request's pages, in prefill page order.
    token: the offer's ``token`` (from the prefill side, through the router).
    remote_tp_size: P; total_num_kv_heads: H.
    timeout_s: the pull gives up after this many seconds.
  Returns:
    (new decode caches, the remote ranks pulled). The caches are donated only once every
    page has arrived.
  Raises:
    TimeoutError: nothing (or not everything) arrived within ``timeout_s``: the prefill
      process is dead or stalled, or no offer answers this token.
    PullError: the prefill side answered with an error (e.g. the offer was released).
    On either, ``decode_caches`` are unchanged and the process can serve the next request.
  """
  timeout_s = _check_seconds("timeout_s", timeout_s)
  deadline = time.monotonic() + timeout_s
  check_token(token)
  if not decode_caches:
    raise ValueError("decode_caches must be non-empty")
  E.check_rank_caches("decode", decode_caches, spec)
  dst = _dst_ids(dst_block_ids, decode_caches[0].shape[0])
  plans, rspec = _plans(spec, len(decode_caches), remote_tp_size, total_num_kv_heads, is_mla)
  pulled = _pull_rows(server, address, token, plans, [E._device_of(c) for c in decode_caches],
                      (dst.size, rspec.page_bytes), deadline, timeout_s)
  out = []
  for r, (reads, permute) in enumerate(plans):
    sources = {s: pulled[s] for s in {x.remote_rank for x in reads}}
    out.append(E.receive_into(decode_caches[r], spec, sources, reads, dst, permute=permute,
                              remote_spec=rspec))
  return out, sorted(pulled)


def pull_request_layers(server, address: str, decode_rank_layers: Sequence[AL.RankLayers], spec,
                        dst_block_ids, *, token: str, remote_tp_size: int,
                        total_num_kv_heads: int, is_mla: bool = False,
                        timeout_s: float = DEFAULT_TIMEOUT_S):
  """Pull a request's pages of all layers (an :func:`offer_request_layers` token) in one round.

  One connection; one pull per source rank the read plans name, all in flight together and
  bounded by one deadline; nothing is written until every layer's pages have arrived.

  Args:
    decode_rank_layers: per decode rank (D, each on its device), that rank's caches of every
      layer: a list of L one-layer caches of ``spec``, or one layered array
      (``spec.physical_shape(B, L)``). L must equal the offer's.
    spec, dst_block_ids, token, remote_tp_size, total_num_kv_heads, is_mla, timeout_s: as
      :func:`pull_request` (one set of block ids for every layer).
  Returns:
    (per decode rank, its new caches in the form given; the remote ranks pulled). The caches
    are donated only once every page has arrived.
  Raises:
    TimeoutError, PullError: as :func:`pull_request` (also when the offer holds another
    number of layers: the sizes disagree); ``decode_rank_layers`` are then unchanged.
  """
  timeout_s = _check_seconds("timeout_s", timeout_s)
  deadline = time.monotonic() + timeout_s
  check_token(token)
  num_layers, num_blocks = AL.check_rank_layers("decode", decode_rank_layers, spec)
  dst = _dst_ids(dst_block_ids, num_blocks)
  plans, rspec = _plans(spec, len(decode_rank_layers), remote_tp_size, total_num_kv_heads,
                        is_mla)
  devices = [AL.device_of(x) for x in decode_rank_layers]
  pb = rspec.page_bytes
  pulled = _pull_rows(server, address, token, plans, devices, (dst.size, num_layers * pb),
                      deadline, timeout_s)
  out = []
  for r, (reads, permute) in enumerate(plans):
    ranks = {x.remote_rank for x in reads}
    pages = [E.receive_pages(devices[r], spec, {s: AL.layer_pages(pulled[s], l, pb)
                                                for s in ranks},
                             reads, permute=permute, remote_spec=rspec)
             for l in range(num_layers)]
    out.append(AL.scatter_layers(decode_rank_layers[r], pages, dst, spec))
  return out, sorted(pulled)


def _dst_ids(dst_block_ids, num_blocks: int) -> np.ndarray:
  if np.size(dst_block_ids) == 0:
    raise ValueError("dst_block_ids must name at least one block")
  return E._check_block_ids_distinct(dst_block_ids, num_blocks)


def _plans(spec, d: int, remote_tp_size: int, total_num_kv_heads: int, is_mla: bool):
  """(per decode rank (reads, permute), the remote per-rank spec)."""
  mla = is_mla or isinstance(spec, S.MLACacheSpec)
  rspec = spec if mla else T.remote_spec(spec, remote_tp_size, total_num_kv_heads)
  plans = [E.rank_plan(spec, tp_rank=r, tp_size=d, remote_tp_size=remote_tp_size,
                       total_num_kv_heads=total_num_kv_heads, is_mla=mla) for r in range(d)]
  return plans, rspec


def _pull_rows(server, address: str, token: str, plans, devices, shape, deadline: float,
               timeout_s: float) -> Dict[int, jax.Array]:
  """Pull each source rank the plans read, once, as uint8 ``shape`` onto the first decode
  device that reads it; all over one connection, awaited together (:func:`_await_pulls`)."""
  conn = server.connect(address)
  server_deadline = _deadline_datetime(timeout_s + 1.0)   # lets the peer drop a stale request
  pulled: Dict[int, jax.Array] = {}
  for (reads, _), dev in zip(plans, devices):
    for s in sorted({x.remote_rank for x in reads}):
      if s not in pulled:
        want = jax.ShapeDtypeStruct(shape, jnp.uint8,
                                    sharding=jax.sharding.SingleDeviceSharding(dev))
        pulled[s] = conn.pull(transfer_id(token, s), [want], timeout=server_deadline)[0]
  _await_pulls(conn, pulled, deadline, address, timeout_s)
  return pulled


__all__ = ["start_server", "is_loopback", "needed_remote_ranks", "Offer", "LiveOffers",
           "offer_request", "pull_request", "offer_request_layers", "pull_request_layers",
           "live_offers", "PullError", "DEFAULT_TTL_S",
           "DEFAULT_TIMEOUT_S"]
