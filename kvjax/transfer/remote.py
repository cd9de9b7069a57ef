"""Cross-process transfers over ``jax.experimental.transfer`` (disaggregated prefill/decode).

The prefill process *offers* a request's pages: per prefill rank, the gathered pages
as one uint8 ``[n, remote_page_bytes]`` array on that rank's device, under the id
``request_uuid(request_id, rank)`` (``server.await_pull``). The decode process, with
its own TP size, *pulls* (``connection.pull``) exactly the source ranks its read
plans name, each once, onto the first decode device that needs it, then applies the
plans and scatters the pages into its caches at its own block ids (as
:func:`kvjax.transfer.transfer_blocks` does within one process).

Facts checked on jax 0.10.2 (CPU): one offer (uuid) serves one pull (a second pull of
the same uuid blocks), so the decode side pulls each source rank once and copies it
between its own devices; a pull of a uuid never offered blocks, and ``pull``'s
``timeout`` did not end that wait on CPU, so callers bound the process instead;
servers bind only where told: pass loopback addresses in tests.
The address and request id travel out of band (a file, stdout, the serving router).
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import spec as S
from kvjax.transfer import execute as E
from kvjax.transfer import topology as T

#: Offer ids: ``request_id * MAX_RANKS + rank``.
MAX_RANKS = 1024


def _transfer_module():
  try:
    from jax.experimental import transfer  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - depends on the jaxlib build
    raise RuntimeError("jax.experimental.transfer is not available in this jax build") from e
  return transfer


def start_server(client=None, address: str = "127.0.0.1:0",
                 transport_addresses: Sequence[str] = ("127.0.0.1:0",)):
  """A transfer server on ``address`` (loopback, free port by default).

  client: the backend client (default: that of ``jax.devices()[0]``).
  ``server.address()`` is what the other process connects to.
  """
  client = client or jax.devices()[0].client
  return _transfer_module().start_transfer_server(client, address, list(transport_addresses))


def request_uuid(request_id: int, rank: int) -> int:
  """The offer id of one prefill rank's pages of a request."""
  if not 0 <= rank < MAX_RANKS:
    raise ValueError(f"rank={rank} must be in [0, {MAX_RANKS})")
  if request_id < 0:
    raise ValueError(f"request_id={request_id} must be non-negative")
  return int(request_id) * MAX_RANKS + int(rank)


def needed_remote_ranks(tp_size: int, remote_tp_size: int, total_num_kv_heads: int,
                        is_mla: bool = False) -> List[int]:
  """Remote ranks that a whole TP group of size ``tp_size`` reads (sorted, unique)."""
  ranks = set()
  for r in range(tp_size):
    ranks.update(T.source_ranks(r, tp_size, remote_tp_size, total_num_kv_heads, is_mla))
  return sorted(ranks)


@dataclasses.dataclass
class Offer:
  """Pages of a request offered by the prefill side; keep it alive until pulled.

  arrays: rank -> uint8 ``[num_pages, page_bytes]`` on that rank's device.
  """
  request_id: int
  num_pages: int
  page_bytes: int
  arrays: Dict[int, jax.Array]


def offer_request(server, request_id: int, prefill_caches: Sequence[jax.Array], block_ids, *,
                  ranks: Optional[Sequence[int]] = None) -> Offer:
  """Offer a request's pages of every prefill rank (or only ``ranks``) for one pull each.

  prefill_caches: the P per-rank caches (one layer), each on its device.
  block_ids: the request's prefill block ids. ``ranks``: offer only these ranks (e.g.
  :func:`needed_remote_ranks` of the decode TP size) so no offer stays unpulled.
  """
  if not prefill_caches:
    raise ValueError("prefill_caches must be non-empty")
  ids = np.asarray(block_ids, np.int32)
  if ids.ndim != 1 or ids.size == 0:
    raise ValueError(f"block_ids must be a non-empty 1-D sequence, got {block_ids!r}")
  ranks = range(len(prefill_caches)) if ranks is None else ranks
  arrays = {}
  for s in ranks:
    if not 0 <= s < len(prefill_caches):
      raise ValueError(f"rank {s} is not a prefill rank of {len(prefill_caches)}")
    arrays[s] = E.gather_page_bytes(prefill_caches[s], ids)
    arrays[s].block_until_ready()
    server.await_pull(request_uuid(request_id, s), [arrays[s]])
  first = next(iter(arrays.values()))
  return Offer(request_id, int(first.shape[0]), int(first.shape[1]), arrays)


def pull_request(server, address: str, request_id: int, decode_caches: Sequence[jax.Array], spec,
                 dst_block_ids, *, remote_tp_size: int, total_num_kv_heads: int,
                 is_mla: bool = False, timeout_s: Optional[float] = None):
  """Pull a request's pages from the prefill process and write them into the decode caches.

  Args:
    server: this process's transfer server (:func:`start_server`).
    address: the prefill server's ``address()``.
    decode_caches: the D per-rank caches of ``spec`` (this rank's spec), each on its device.
    dst_block_ids: the decode block ids of the request's pages, in prefill page order.
    remote_tp_size: P; total_num_kv_heads: H.
    timeout_s: passed to ``pull`` as its deadline (None = wait); not honoured by the
      CPU backend of jax 0.10.2, so bound the process too.
  Returns:
    (new decode caches, the remote ranks pulled).
  """
  mla = is_mla or isinstance(spec, S.MLACacheSpec)
  d = len(decode_caches)
  if d == 0:
    raise ValueError("decode_caches must be non-empty")
  rspec = spec if mla else T.remote_spec(spec, remote_tp_size, total_num_kv_heads)
  E.check_rank_caches("decode", decode_caches, spec)
  dst = E._check_block_ids_distinct(dst_block_ids, decode_caches[0].shape[0])
  plans = [E.rank_plan(spec, tp_rank=r, tp_size=d, remote_tp_size=remote_tp_size,
                       total_num_kv_heads=total_num_kv_heads, is_mla=mla) for r in range(d)]
  conn = server.connect(address)
  pulled: Dict[int, jax.Array] = {}
  for r, (reads, _) in enumerate(plans):
    dev = E._device_of(decode_caches[r])
    for s in sorted({x.remote_rank for x in reads}):
      if s in pulled:
        continue
      want = jax.ShapeDtypeStruct((dst.size, rspec.page_bytes), jnp.uint8,
                                  sharding=jax.sharding.SingleDeviceSharding(dev))
      args = {}
      if timeout_s is not None:
        args["timeout"] = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
      pulled[s] = conn.pull(request_uuid(request_id, s), [want], **args)[0]
  out = []
  for r, (reads, permute) in enumerate(plans):
    sources = {s: pulled[s] for s in {x.remote_rank for x in reads}}
    out.append(E.receive_into(decode_caches[r], spec, sources, reads, dst, permute=permute,
                              remote_spec=rspec))
  return out, sorted(pulled)


__all__ = ["start_server", "request_uuid", "needed_remote_ranks", "Offer", "offer_request",
           "pull_request", "MAX_RANKS"]
