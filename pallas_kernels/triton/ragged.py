"""Unified ragged paged attention (prefill with cached prefix + decode in one batch), Pallas.

Semantics: exactly :func:`kvjax.reference.unified_attention`. This module builds the static
tiling and launches the kernel in :mod:`pallas_kernels.triton.ragged_kernel` (Triton lowering on GPU,
interpret mode on CPU). Arguments arrive validated by ``kvjax.unified_attention``.

Static sizes and recompilation (bucketing rule)
-----------------------------------------------
The grid must be static while the batch composition is traced. A program
handles one KV head and one *query tile*: ``bq`` consecutive query tokens of
one sequence times the G query heads of that KV head. ``max_query_len``
(default T) is first rounded up to a power of two, the *bucket*; the tile has
``rows = next_pow2(G * bucket)`` clamped to [16, 256] (GPU; [16, 32] in
interpret mode) and ``bq = rows // G`` tokens, so decode-heavy batches get
small tiles and prefills 256-row tiles. The grid is (H, num_tiles) with the
static bound ``num_tiles = min(cdiv(T, bq) + S, S * cdiv(bucket, bq))``
(:mod:`pallas_kernels.ragged_schedule`); the (sequence, tile) of each program is
computed in XLA from ``query_start_loc`` and surplus programs exit at once.
One compiled program therefore serves every step with the same
``(T, S, max_blocks)`` shapes and ``max_query_len`` bucket. Callers should pad T
to a bucket (powers of two, or multiples of 256 above some size) and keep S and
max_blocks at fixed capacities (padding sequences: q_len 0; padding tokens past
``query_start_loc[S]`` cost nothing and output 0). ``max_query_len`` must be a
true upper bound on every sequence's query length, else tokens are dropped.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from kvjax import plain_copy as PC
from kvjax import ragged_batch as RB
from kvjax.spec import KVCacheSpec
from pallas_kernels import ragged_schedule as sched
from pallas_kernels.common import float32_words, next_pow2, static_or_none
from pallas_kernels.triton import ragged_kernel
from pallas_kernels.triton import tuning
from pallas_kernels.triton.adapters import tile_format

def ragged_paged_attention(q, cache, spec: KVCacheSpec, *, query_start_loc, seq_lens, block_table,
                           scale, causal=True, sliding_window=None, soft_cap=None, sinks=None,
                           k_scale=None, v_scale=None, max_query_len=None, interpret=False,
                           tile_config: Optional[ragged_kernel.TileConfig] = None,
                           plain_copy: Optional[bool] = None):
  """Ragged paged attention over the packed cache, one Pallas kernel.

  Args:
    q: ``[T, Hq, D]`` flattened query tokens (bf16/f16/f32).
    cache: the spec's physical cache array (read in place, never split into K/V arrays).
    query_start_loc: int32 ``[S+1]``; seq_lens: int32 ``[S]`` (prefix + new);
      block_table: int32 ``[S, max_blocks]``.
    scale: softmax scale (a Python float, or traced). causal, sliding_window, soft_cap: static.
    sinks: float32 ``[Hq]`` per-query-head sink logits or None.
    k_scale, v_scale: fp8 per-tensor / nvfp4 global scales, scalar or ``[H]`` (else ignored).
    max_query_len: static bound on per-sequence query length (None = T), bucketed (module doc).
    interpret: run the kernel in Pallas interpret mode (CPU tests).
    tile_config: override the tile sizes / launch parameters (benchmarks).
    plain_copy: read a quantized cache through a plain copy of the named pages
      (:mod:`kvjax.plain_copy`); None = :func:`kvjax.plain_copy.worth_a_plain_copy`.
  Returns:
    ``[T, Hq, D]`` in q's dtype; padding tokens and rows with no visible key are 0.
  """
  t, hq, d = q.shape
  h = spec.num_kv_heads
  group = hq // h
  num_seqs = seq_lens.shape[0]
  if t == 0 or num_seqs == 0:
    return jnp.zeros(q.shape, q.dtype)
  if plain_copy is None:
    plain_copy = PC.worth_a_plain_copy(spec, q.dtype, t, num_seqs, block_table.shape[1])
  if plain_copy and spec.codec.is_quantized:
    cache, spec, block_table = PC.plain_pages(cache, spec, block_table, k_scale, v_scale,
                                              dtype=q.dtype)
    k_scale = v_scale = None
  promised = t if max_query_len is None else int(max_query_len)
  mql = min(next_pow2(promised), next_pow2(t))
  fmt = tile_format(spec, q.dtype)
  cfg = tile_config or tuning.ragged_tiles(spec.head_size, group, mql, interpret,
                                           fmt.compute_dtype.itemsize)
  if cfg.rows < group:
    raise ValueError(f"tile rows={cfg.rows} must be >= the GQA group size {group}")
  bq = cfg.rows // group
  st = ragged_kernel.KernelStatics(
      fmt=fmt, head_pad=next_pow2(d), group=group, num_blocks=cache.shape[0],
      max_blocks=block_table.shape[1], num_tiles=sched.num_tiles_bound(t, num_seqs, bq, mql),
      bq=bq, rows=cfg.rows, block_kv=cfg.block_kv, causal=bool(causal),
      window=None if sliding_window is None else int(sliding_window),
      soft_cap=None if soft_cap is None else float(soft_cap), has_sinks=sinks is not None,
      scale=static_or_none(scale), array_cols=bool(interpret), scale_words=fmt.scale_words)
  return _run(q, cache, query_start_loc, seq_lens, block_table, k_scale, v_scale, sinks, scale,
              st=st, cfg=cfg, promised=promised, interpret=bool(interpret))


def _run(q, cache, query_start_loc, seq_lens, block_table, k_scale, v_scale, sinks, scale, *,
         st, cfg, promised, interpret):
  """Launch the kernel. The cache goes in as rows ``[R, C]`` (a free reshape) for formats
  the row tiles read, else as pages ``[B, page_elems]``.

  Metadata is clamped first (:mod:`kvjax.ragged_batch`), so every row and block the kernel
  addresses is in bounds; sequences with more than ``promised`` query tokens get no tile."""
  t, hq, d = q.shape
  fmt = st.fmt
  qsl, sl = RB.clamp_metadata(query_start_loc, seq_lens, num_tokens=t,
                              capacity=st.max_blocks * st.block_size)
  tile_seq, tile_q0 = sched.tile_schedule(qsl, st.num_tiles, st.bq, promised)
  meta = (tile_seq, tile_q0, qsl, sl, block_table.astype(jnp.int32).reshape(-1))
  if fmt.row_table:
    cache2d = cache.reshape(-1, cache.shape[-1])        # free: contiguous physical rows
  else:
    cache2d = cache.reshape(st.num_blocks, fmt.page_elems)
  ks, vs = fmt.tensor_scales(k_scale, v_scale)
  if st.scale is None:      # traced softmax scale: the kernel reads it at ks[H]
    ks = jnp.concatenate([ks, jnp.asarray(scale, jnp.float32).reshape(1)])
  sk = (jnp.zeros((hq,), jnp.float32) if sinks is None
        else jnp.asarray(sinks, jnp.float32).reshape(hq))
  words = float32_words(cache2d) if st.scale_words else None
  out = ragged_kernel.ragged_attention_call(
      q.reshape(t * hq, d), cache2d, meta, ks, vs, sk, jnp.zeros((t * hq, d), q.dtype),
      st=st, cfg=cfg, interpret=interpret, words=words)
  return out.reshape(t, hq, d)
