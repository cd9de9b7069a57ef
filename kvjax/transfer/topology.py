"""Who holds which KV heads across tensor-parallel ranks (docs/layout.md §7).

Notation: ``H`` = total_num_kv_heads (the model's KV heads), ``tp`` = this side's
tensor-parallel size, ``remote`` = the other side's. A rank holds ``H / tp``
consecutive heads when ``tp <= H`` and one replicated head (``rank * H // tp``)
when ``tp > H``. MLA caches have no head axis: every rank holds the whole latent
cache (always replicated).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

import numpy as np

from kvjax import spec as S


def _positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class LayoutProbe:
  """Result of probing a backend's cache-shape function (docs/layout.md §7).

  shape: the probed shape (num_blocks=1, block_size=16, num_kv_heads=1, head_size=1).
  blocks_first: its leading dim is the block axis (so a page is contiguous).
  ndim: 4 for a packed KV cache, 3 for MLA.
  """
  shape: Tuple[int, ...]
  blocks_first: bool
  ndim: int


def probe_layout(shape_fn: Optional[Callable] = None, *, is_mla: bool = False) -> LayoutProbe:
  """Check that a cache-shape function is blocks-first (pages are whole, contiguous units).

  ``shape_fn`` defaults to :func:`kvjax.get_kv_cache_shape` (or the MLA shape function).
  Non-MLA must give ``(1, 1, 16, 2)``-like 4-D shapes with the block axis first; MLA 3-D.
  Raises ValueError otherwise: a transfer by whole pages is only valid blocks-first.
  """
  if is_mla:
    fn = shape_fn or (lambda b, n, h, d: S.get_mla_kv_cache_shape(b, n, d))
  else:
    fn = shape_fn or S.get_kv_cache_shape
  shape = tuple(int(x) for x in fn(1, 16, 1, 1))
  want = (1, 16, 1) if is_mla else (1, 1, 16, 2)
  if len(shape) != len(want):
    raise ValueError(f"cache shape probe gave {shape}: expected a {len(want)}-D "
                     f"{'MLA' if is_mla else 'packed KV'} cache shape like {want}")
  if shape != want:
    raise ValueError(f"cache shape probe gave {shape}, not the blocks-first {want}: pages "
                     "are not contiguous (K and V packed per page), so they cannot move whole")
  return LayoutProbe(shape, True, len(shape))


def tp_ratio(tp_size: int, remote_tp_size: int) -> int:
  """``tp / remote`` if ``tp >= remote`` else ``-(remote / tp)``; the sizes must divide."""
  tp = _positive_int("tp_size", tp_size)
  remote = _positive_int("remote_tp_size", remote_tp_size)
  if tp >= remote:
    if tp % remote:
      raise ValueError(f"tp_size={tp} is not a multiple of remote_tp_size={remote}")
    return tp // remote
  if remote % tp:
    raise ValueError(f"remote_tp_size={remote} is not a multiple of tp_size={tp}")
  return -(remote // tp)


def check_heads_split(total_num_kv_heads: int, tp_size: int, name: str = "tp_size") -> None:
  """H must be a multiple of tp, or tp a multiple of H (replication)."""
  h = _positive_int("total_num_kv_heads", total_num_kv_heads)
  tp = _positive_int(name, tp_size)
  if h % tp and tp % h:
    raise ValueError(f"{name}={tp} does not split total_num_kv_heads={h}: one must divide "
                     "the other")


def is_kv_replicated(tp_size: int, total_num_kv_heads: int, is_mla: bool = False) -> bool:
  """KV is replicated across ranks when tp > H; MLA always replicates."""
  return bool(is_mla) or tp_size > total_num_kv_heads


def heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
  """KV heads a rank holds: ``H / tp``, or 1 when replicated (tp > H)."""
  check_heads_split(total_num_kv_heads, tp_size)
  return max(1, total_num_kv_heads // tp_size)


def rank_first_head(rank: int, tp_size: int, total_num_kv_heads: int) -> int:
  """Global index of the first KV head held by ``rank`` (``rank * H // tp``)."""
  return rank * total_num_kv_heads // tp_size


def _check_rank(tp_rank: int, tp_size: int) -> int:
  if isinstance(tp_rank, bool) or not isinstance(tp_rank, (int, np.integer)) or not (
      0 <= tp_rank < tp_size):
    raise ValueError(f"tp_rank={tp_rank!r} must be an int in [0, {tp_size})")
  return int(tp_rank)


def check_topology(tp_rank: int, tp_size: int, remote_tp_size: int, total_num_kv_heads: int,
                   is_mla: bool = False) -> None:
  """Validate a (local rank, local TP, remote TP, H) combination; ValueError if impossible."""
  tp_ratio(tp_size, remote_tp_size)
  _check_rank(tp_rank, tp_size)
  if not is_mla:
    check_heads_split(total_num_kv_heads, tp_size, "tp_size")
    check_heads_split(total_num_kv_heads, remote_tp_size, "remote_tp_size")


def source_ranks(tp_rank: int, tp_size: int, remote_tp_size: int, total_num_kv_heads: int,
                 is_mla: bool = False) -> List[int]:
  """Remote ranks the local rank ``tp_rank`` reads, in local page order.

  Local TP >= remote TP (or MLA): one rank, ``tp_rank * remote // tp``. Local TP <
  remote TP: the ``remote / tp`` consecutive ranks from ``tp_rank * remote / tp``, with
  ranks holding the same KV head under replication (head = ``r * H // remote``) kept once.
  """
  check_topology(tp_rank, tp_size, remote_tp_size, total_num_kv_heads, is_mla)
  if is_mla or tp_size >= remote_tp_size:
    return [tp_rank * remote_tp_size // tp_size]
  k = remote_tp_size // tp_size
  out, seen = [], set()
  for src in range(tp_rank * k, (tp_rank + 1) * k):
    head = src * total_num_kv_heads // remote_tp_size
    if head not in seen:
      seen.add(head)
      out.append(src)
  return out


def rank_offset_factor(tp_rank: int, tp_size: int, remote_tp_size: int, total_num_kv_heads: int,
                       is_mla: bool = False) -> int:
  """Which local-page-sized chunk of the remote page the local rank reads (docs/layout.md §7).

  0 for MLA or ``tp <= remote``; ``r*H/tp - src*H/remote`` when ``tp > H``; else
  ``r % (tp / remote)``. The byte offset is this times the local page bytes.
  """
  check_topology(tp_rank, tp_size, remote_tp_size, total_num_kv_heads, is_mla)
  if is_mla or tp_size <= remote_tp_size:
    return 0
  h = total_num_kv_heads
  if tp_size > h:
    src = tp_rank * remote_tp_size // tp_size
    return tp_rank * h // tp_size - src * h // remote_tp_size
  return tp_rank % (tp_size // remote_tp_size)


def remote_spec(spec: S.KVCacheSpec, remote_tp_size: int, total_num_kv_heads: int):
  """The remote side's per-rank spec: same format and layout, its own head count."""
  return dataclasses.replace(spec, num_kv_heads=heads_per_rank(total_num_kv_heads,
                                                               remote_tp_size))


def local_heads(tp_rank: int, tp_size: int, total_num_kv_heads: int) -> List[int]:
  """Global indices of the KV heads held by ``tp_rank`` (one head when replicated)."""
  n = heads_per_rank(total_num_kv_heads, tp_size)
  first = rank_first_head(tp_rank, tp_size, total_num_kv_heads)
  return list(range(first, first + n))


__all__ = ["LayoutProbe", "probe_layout", "tp_ratio", "check_heads_split", "is_kv_replicated",
           "heads_per_rank", "rank_first_head", "check_topology", "source_ranks",
           "rank_offset_factor", "remote_spec", "local_heads"]
