"""Static tiling of a ragged query batch: which (sequence, query tile) each program handles.

A query tile is up to ``bq`` consecutive query tokens of one sequence. The
number of tiles depends on the (traced) query lengths, so the grid uses a
static upper bound and surplus programs find an empty tile and do nothing:

  sum_s cdiv(q_len_s, bq) <= cdiv(T, bq) + S        (each sequence wastes < 1 tile)
  sum_s cdiv(q_len_s, bq) <= S * cdiv(max_query_len, bq)

Everything here is pure jnp on int32 metadata ``[S+1]`` / ``[S]``, with no loop: a few
fused XLA kernels per step, no host sync.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import cdiv, next_pow2  # noqa: F401 (also for the Mosaic backends)

#: q0 of an empty (surplus) tile: past any sequence, so it holds no query row.
EMPTY_TILE_Q0 = 1 << 30


def num_tiles_bound(num_tokens: int, num_seqs: int, bq: int, max_query_len: int) -> int:
  """Static grid size along query tiles (>= 1)."""
  return max(1, min(cdiv(num_tokens, bq) + num_seqs, num_seqs * cdiv(max_query_len, bq)))


def tile_schedule(query_start_loc, num_tiles: int, bq: int, max_query_len=None):
  """Per static tile index j: (sequence id int32 [num_tiles], first local query token int32).

  Tiles of one sequence are consecutive and in token order; tiles past the real
  count get sequence S-1 and q0 = EMPTY_TILE_Q0 (so they hold no query token).
  A sequence with more than ``max_query_len`` query tokens gets no tile (its rows stay 0,
  :mod:`kvjax.ragged_batch` rule 2), so the static bound is never short.
  """
  qsl = query_start_loc.astype(jnp.int32)
  num_seqs = qsl.shape[0] - 1
  q_len = jnp.maximum(qsl[1:] - qsl[:-1], 0)
  if max_query_len is not None:
    q_len = jnp.where(q_len > max_query_len, 0, q_len)
  tiles = (q_len + bq - 1) // bq
  ends = jnp.cumsum(tiles)
  starts = ends - tiles
  j = jnp.arange(num_tiles, dtype=jnp.int32)
  # Unrolled binary search: log2(S + 1) gathers and selects that XLA fuses. The default "scan"
  # is a while loop whose small kernels and gaps cost a prefill call tens of µs
  # (`ragged-schedule-unrolled` in benchmarks/RESULTS.md).
  seq = jnp.searchsorted(ends, j, side="right", method="scan_unrolled").astype(jnp.int32)
  valid = seq < num_seqs
  seq = jnp.minimum(seq, num_seqs - 1)
  q0 = (j - starts[seq]) * bq
  return seq, jnp.where(valid, q0, EMPTY_TILE_Q0).astype(jnp.int32)
