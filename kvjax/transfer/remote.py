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

Two transports carry the bytes, chosen by :func:`start_server`'s ``transport``:

- ``"socket"`` (:mod:`kvjax.transfer.socket_transport`): ``jax.experimental.transfer`` over
  TCP, between any two hosts, any platform; the bytes go through host memory.
- ``"cuda_ipc"`` (:mod:`kvjax.transfer.ipc_transport`): processes of one host with CUDA GPUs;
  the decode side reads the offered pages in place in device memory.

Both serve an offer once, bound every pull by its ``timeout_s`` and leave the decode caches
untouched when a pull fails; docs/transfers.md has the trust model and the measurements.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Dict, List, Optional, Sequence

import jax
import numpy as np

from kvjax import spec as S
from kvjax.transfer import all_layers as AL
from kvjax.transfer import execute as E
from kvjax.transfer import plan as PL
from kvjax.transfer import socket_transport
from kvjax.transfer.addresses import is_loopback
from kvjax.transfer import topology as T
from kvjax.transfer.errors import PullError
from kvjax.transfer.ipc_transport import IpcServer
from kvjax.transfer.offers import (LiveOffers, Offer, check_token, live_offers, new_offer, track,
                                   transfer_id)

#: Default seconds an offer stays pullable (:func:`offer_request`'s ``ttl_s``).
DEFAULT_TTL_S = 60.0
#: Default seconds a pull may take (:func:`pull_request`'s ``timeout_s``).
DEFAULT_TIMEOUT_S = 30.0


TRANSPORTS = ("socket", "cuda_ipc")


def start_server(client=None, address: str = "127.0.0.1:0",
                 transport_addresses: Sequence[str] = ("127.0.0.1:0",), *,
                 allow_remote: bool = False, transport: str = "socket"):
  """A transfer server on ``address`` (loopback, free port by default).

  client: the backend client (default: that of ``jax.devices()[0]``; socket transport).
  address: ``"IP:port"`` of the control socket.
  transport_addresses: ``"IP:port"`` of the bulk-data sockets (socket transport).
    Addresses other than loopback need ``allow_remote=True``: the socket transport has no
    authentication or encryption, so only bind an address on an isolated transfer network
    (docs/transfers.md). The CUDA IPC transport binds loopback only.
  transport: ``"socket"`` (any hosts) or ``"cuda_ipc"`` (processes of one host with CUDA GPUs:
    pages are read in place in device memory). Both sides must use the same transport.
  ``server.address()`` is what the other process connects to.
  """
  if transport == "socket":
    return socket_transport.start(client, address, transport_addresses,
                                  allow_remote=allow_remote)
  if transport == "cuda_ipc":
    return IpcServer(address)
  raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def needed_remote_ranks(tp_size: int, remote_tp_size: int, total_num_kv_heads: int,
                        is_mla: bool = False) -> List[int]:
  """Remote ranks that a whole TP group of size ``tp_size`` reads (sorted, unique)."""
  ranks = set()
  for r in range(tp_size):
    ranks.update(T.source_ranks(r, tp_size, remote_tp_size, total_num_kv_heads, is_mla))
  return sorted(ranks)


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
  try:
    offer.withdraw = server.serve({transfer_id(offer.token, s): a for s, a in arrays.items()},
                                  ttl_s)
  except BaseException:
    offer.release()
    raise
  track(offer)
  return offer


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
  (pulled,), done = _pull_rows(server, address, [(token, (dst.size, rspec.page_bytes))], plans,
                               [E._device_of(c) for c in decode_caches], deadline, timeout_s)
  dst = _padded_ids(dst, pulled)
  out = []
  try:
    for r, (reads, permute) in enumerate(plans):
      sources = {s: pulled[s] for s in {x.remote_rank for x in reads}}
      out.append(E.receive_into(decode_caches[r], spec, sources, reads, dst, permute=permute,
                                remote_spec=rspec))
  finally:
    jax.block_until_ready(out)   # every read of the pulled bytes is complete
    done()
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
  return pull_requests_layers(server, address, decode_rank_layers, spec, [dst_block_ids],
                              tokens=[token], remote_tp_size=remote_tp_size,
                              total_num_kv_heads=total_num_kv_heads, is_mla=is_mla,
                              timeout_s=timeout_s)


def pull_requests_layers(server, address: str, decode_rank_layers: Sequence[AL.RankLayers],
                         spec, dst_block_ids: Sequence, *, tokens: Sequence[str],
                         remote_tp_size: int, total_num_kv_heads: int, is_mla: bool = False,
                         timeout_s: float = DEFAULT_TIMEOUT_S):
  """Pull several requests offered by one prefill server (all layers each) in one round.

  What a decode step that admits several requests does: one connection, every request's
  pulls in flight together under one deadline, then each request's pages written (one
  program a request and page-count size). All or nothing: nothing is written until every
  request's pages have arrived.

  Args:
    dst_block_ids: per request (in ``tokens`` order), its decode block ids; no block may
      appear twice, in one request or across requests.
    tokens: per request, its :func:`offer_request_layers` token (offers of the server at
      ``address``).
    decode_rank_layers, spec, remote_tp_size, total_num_kv_heads, is_mla, timeout_s: as
      :func:`pull_request_layers`.
  Returns:
    (per decode rank, its new caches in the form given; the remote ranks pulled).
  Raises:
    TimeoutError, PullError: as :func:`pull_request_layers`, for the batch as a whole; the
    decode caches are then unchanged. Over CUDA IPC the other requests' offers stay offered
    (pull them again, alone or in another batch); over sockets they may have been served.
  """
  timeout_s = _check_seconds("timeout_s", timeout_s)
  deadline = time.monotonic() + timeout_s
  tokens = list(tokens)
  dst_block_ids = list(dst_block_ids)
  if not tokens or len(tokens) != len(dst_block_ids):
    raise ValueError(f"tokens ({len(tokens)}) and dst_block_ids ({len(dst_block_ids)}) must "
                     "name the same requests, at least one")
  for token in tokens:
    check_token(token)
  if len(set(tokens)) != len(tokens):
    raise ValueError("tokens must be distinct: an offer serves one pull")
  num_layers, num_blocks = AL.check_rank_layers("decode", decode_rank_layers, spec)
  dsts = [_dst_ids(ids, num_blocks) for ids in dst_block_ids]
  _dst_ids(np.concatenate(dsts), num_blocks)           # no block written twice
  plans, rspec = _plans(spec, len(decode_rank_layers), remote_tp_size, total_num_kv_heads,
                        is_mla)
  devices = [AL.device_of(x) for x in decode_rank_layers]
  pb = rspec.page_bytes
  pulled, done = _pull_rows(server, address, [(t, (d.size, num_layers * pb))
                                              for t, d in zip(tokens, dsts)],
                            plans, devices, deadline, timeout_s)
  out = list(decode_rank_layers)
  try:
    for request, dst in zip(pulled, dsts):
      dst = _padded_ids(dst, request)
      for r, (reads, permute) in enumerate(plans):
        sources = {s: _on(request[s], devices[r]) for s in {x.remote_rank for x in reads}}
        out[r] = AL.land_layers(out[r], sources, dst, spec, reads, permute=permute,
                                remote_spec=rspec)
  finally:
    jax.block_until_ready(out)   # every read of the pulled bytes is complete
    done()
  return out, sorted(pulled[0])


def _padded_ids(dst: np.ndarray, pulled) -> np.ndarray:
  """``dst`` padded with -1 (rows the page store skips) to the pulled arrays' row count: a
  transport may hand over more rows than asked (CUDA IPC views a few sizes of rows, so that
  the receive compiles once per size, not once per request length)."""
  rows = next(iter(pulled.values())).shape[0]
  return np.concatenate([dst, np.full(rows - dst.size, -1, np.int32)]) if rows > dst.size else dst


def _on(x: jax.Array, device) -> jax.Array:
  """``x`` committed to ``device`` (as it is, when it already is: a put costs a small pull's
  time)."""
  return x if x.committed and x.devices() == {device} else jax.device_put(x, device)


def _dst_ids(dst_block_ids, num_blocks: int) -> np.ndarray:
  if np.size(dst_block_ids) == 0:
    raise ValueError("dst_block_ids must name at least one block")
  return E._check_block_ids_distinct(dst_block_ids, num_blocks)


@functools.lru_cache(maxsize=64)
def _plans(spec, d: int, remote_tp_size: int, total_num_kv_heads: int, is_mla: bool):
  """(per decode rank (reads, permute), the remote per-rank spec); cached: every request of
  a decode process has the same ones."""
  mla = is_mla or isinstance(spec, S.MLACacheSpec)
  rspec = spec if mla else T.remote_spec(spec, remote_tp_size, total_num_kv_heads)
  plans = tuple(E.rank_plan(spec, tp_rank=r, tp_size=d, remote_tp_size=remote_tp_size,
                        total_num_kv_heads=total_num_kv_heads, is_mla=mla) for r in range(d))
  return plans, rspec


def _pull_rows(server, address: str, requests, plans, devices, deadline: float,
               timeout_s: float):
  """Pull, for each request ``(token, uint8 shape)``, each source rank the plans read, once,
  onto the first decode device that reads it; all in one round bounded by ``deadline``.

  Returns (per request, rank -> its pages; ``done``: call once every read of the pages is
  complete).
  """
  wants: Dict[int, tuple] = {}
  for (reads, _), dev in zip(plans, devices):
    for s in sorted({x.remote_rank for x in reads}):
      wants.setdefault(s, dev)
  ranks = sorted(wants)
  ids = {transfer_id(token, s): (tuple(shape), wants[s])
         for token, shape in requests for s in ranks}
  what = (f"pull of prefill ranks {ranks}" if len(requests) == 1 else
          f"pull of {len(requests)} requests (prefill ranks {ranks})")
  try:
    arrays, done = server.fetch(address, ids, deadline, timeout_s)
  except TimeoutError as e:
    raise TimeoutError(
        f"{what} from {address} did not complete within {timeout_s:g} s (the prefill process "
        "is dead or stalled, or an offer is gone: expired, released, already pulled, or "
        "another token); decode caches are untouched") from e
  except PullError as e:
    raise PullError(f"{what} from {address} failed ({e}); decode caches are untouched") from e
  return [{s: arrays[transfer_id(token, s)] for s in ranks} for token, _ in requests], done


__all__ = ["start_server", "is_loopback", "TRANSPORTS", "needed_remote_ranks", "Offer",
           "LiveOffers", "offer_request", "pull_request", "offer_request_layers",
           "pull_request_layers", "pull_requests_layers", "live_offers", "PullError",
           "DEFAULT_TTL_S", "DEFAULT_TIMEOUT_S"]
