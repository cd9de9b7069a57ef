"""XLA side of the Mosaic TPU ragged attention: query tiles, their metadata, and back.

A *tile* is up to ``bq`` consecutive query tokens of one sequence together with the G query
heads that share each KV head: per KV head an ``(R, D)`` matrix, ``R = bq * G``, row
``i * G + g`` = token i, group member g. Tiles are listed by
:func:`pallas_kernels.ragged_schedule.tile_schedule` (static count, traced contents).
Queries are gathered into ``[num_tiles, H, R, D]`` before the kernel and the kernel's
``[num_tiles, H, R, D]`` output is gathered back to ``[T, Hq, D]``: two cheap XLA passes over
q and out, so that the kernel sees only whole, aligned blocks.

Per tile the kernel reads int32 metadata (scalar-prefetched into SMEM, ``NUM_FIELDS`` a
tile): its sequence, the number of real query rows, the position of its first token, the
sequence's KV length, and the key range ``[kv_lo, kv_hi)`` the tile can see (causal end,
sliding-window start), from which it derives the pages to fetch.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.reference.attention import token_positions
from pallas_kernels import ragged_schedule as sched
from pallas_kernels.mosaic_tpu.tuning import TARGET_KEYS, TARGET_ROWS

#: Metadata fields, in order, per tile.
SEQ, ROWS, POS0, KV_LEN, KV_LO, KV_HI = range(6)
NUM_FIELDS = 6


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """Static tiling of one call.

  Attributes:
    tokens: bq, query tokens per tile. group: G. num_tiles: the grid size.
    pages_per_step: P, pages fetched per KV step. block_size: N.
  """
  tokens: int
  group: int
  num_tiles: int
  pages_per_step: int
  block_size: int

  @property
  def rows(self) -> int:
    return self.tokens * self.group

  @property
  def keys_per_step(self) -> int:
    return self.pages_per_step * self.block_size


def plan_tiles(num_tokens: int, num_seqs: int, group: int, block_size: int, max_blocks: int,
               max_query_len: int | None) -> TilePlan:
  """The static tiling for T tokens, S sequences and a bound on query length.

  ``max_query_len`` (None = T) is rounded up to a power of two, so steps whose longest
  query falls in the same bucket reuse one compiled program.
  """
  bucket = sched.next_pow2(max(1, max_query_len or num_tokens))
  bq = max(1, min(bucket, TARGET_ROWS // group))
  nt = sched.num_tiles_bound(num_tokens, num_seqs, bq, bucket)
  pages = max(1, min(max_blocks, TARGET_KEYS // block_size))
  return TilePlan(bq, group, nt, pages, block_size)


def tile_metadata(plan: TilePlan, query_start_loc, seq_lens, *, capacity: int, causal: bool,
                  sliding_window, max_query_len=None):
  """(sequence per tile int32 [nt], first local token per tile, metadata int32 [nt * NUM_FIELDS]).

  query_start_loc, seq_lens: clamped (:func:`kvjax.ragged_batch.clamp_metadata`).
  capacity: max_blocks * block_size, the most keys a block table row names.
  max_query_len: a sequence with more query tokens gets no tile (its rows stay 0).
  """
  qsl = query_start_loc.astype(jnp.int32)
  sl = seq_lens.astype(jnp.int32)
  seq, q0 = sched.tile_schedule(qsl, plan.num_tiles, plan.tokens, max_query_len)
  q_len = qsl[seq + 1] - qsl[seq]
  rows = jnp.clip(q_len - q0, 0, plan.tokens)            # 0 for surplus tiles
  live = rows > 0
  pos0 = jnp.where(live, sl[seq] - q_len + q0, 0)
  kv_len = jnp.clip(sl[seq], 0, capacity)
  hi = jnp.minimum(kv_len, pos0 + rows) if causal else kv_len
  lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
  hi = jnp.where(live, jnp.maximum(hi, lo), lo)          # empty range: no KV step
  meta = jnp.stack([seq, rows, pos0, kv_len, lo, hi], axis=1)
  return seq, q0, meta.reshape(-1).astype(jnp.int32)


def gather_queries(q, plan: TilePlan, seq, q0, query_start_loc):
  """q ``[T, Hq, D]`` -> tiles ``[nt, H, R, D]`` (rows past a tile's real tokens: any token)."""
  t, hq, d = q.shape
  h, g = hq // plan.group, plan.group
  start = query_start_loc.astype(jnp.int32)[seq] + jnp.minimum(q0, t)
  tok = jnp.clip(start[:, None] + jnp.arange(plan.tokens, dtype=jnp.int32)[None, :], 0, t - 1)
  tiles = q[tok].reshape(plan.num_tiles, plan.tokens, h, g, d)
  return tiles.transpose(0, 2, 1, 3, 4).reshape(plan.num_tiles, h, plan.rows, d)


def scatter_outputs(out_tiles, plan: TilePlan, query_start_loc, seq_lens, num_tokens: int,
                    max_query_len=None):
  """Kernel output ``[nt, H, R, D]`` -> ``[T, Hq, D]``; padding tokens (and those of sequences
  over ``max_query_len``) are 0. Metadata as :func:`tile_metadata` takes it."""
  nt, h, _, d = out_tiles.shape
  qsl = query_start_loc.astype(jnp.int32)
  seq, _, real = token_positions(qsl, seq_lens, num_tokens, max_query_len)
  q_len = jnp.maximum(qsl[1:] - qsl[:-1], 0)
  if max_query_len is not None:       # as the tile schedule counts them
    q_len = jnp.where(q_len > max_query_len, 0, q_len)
  tiles = (q_len + plan.tokens - 1) // plan.tokens
  first_tile = jnp.cumsum(tiles) - tiles
  local = jnp.arange(num_tokens, dtype=jnp.int32) - qsl[seq]
  tile = jnp.clip(first_tile[seq] + local // plan.tokens, 0, nt - 1)
  row = jnp.clip(local % plan.tokens, 0, plan.tokens - 1)
  per_token = out_tiles.reshape(nt, h, plan.tokens, plan.group, d)[tile, :, row]  # [T, H, G, D]
  out = per_token.reshape(num_tokens, h * plan.group, d)
  return jnp.where(real[:, None, None], out, jnp.zeros((), out.dtype))
