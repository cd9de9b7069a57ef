"""Paged decode attention over the packed cache: one query token per sequence.

Entry point :func:`paged_decode_attention`. The kernel
(:mod:`pallas_kernels.triton.decode_kernel`) reads q and the physical cache directly (K
and V of a token in the same step, dequantized in the kernel). With one split it
writes the output itself; with several (few long sequences) this module merges
the per-split partials and the sinks in XLA. Works under ``jax.jit``: ``seq_lens`` and
``block_table`` may be traced; shapes, window and soft cap are static. Arguments arrive
validated by ``kvjax.unified_attention``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvjax import ragged_batch as RB
from kvjax.spec import KVCacheSpec
from kvjax import quant
from pallas_kernels.common import merge_splits, static_or_none, words_view
from pallas_kernels.triton import pairs, tuning
from pallas_kernels.triton.adapters import tile_format
from pallas_kernels.triton.decode_config import DecodeConfig
from pallas_kernels.triton.decode_kernel import decode_call
from pallas_kernels.triton.formats import TileFormat


def _kernel_scales(tf: TileFormat, k_scale, v_scale, scale=None):
  """float32 ``[2, H]`` k / v global scales per KV head; ``[3, H]`` with the softmax scale in
  row 2 when ``scale`` (traced) is given."""
  ts = tf.tensor_scales(k_scale, v_scale)
  if scale is None:
    return ts
  return jnp.concatenate([ts, quant.per_head_scales(scale, tf.num_heads)[None]])


def paged_decode_attention(q, cache, spec: KVCacheSpec, *, seq_lens, block_table, scale,
                           sliding_window: Optional[int] = None, soft_cap=None, sinks=None,
                           k_scale=None, v_scale=None, query_start_loc=None,
                           interpret: bool = False, config: Optional[DecodeConfig] = None):
  """Decode attention (causal, query at position seq_len - 1) over the packed paged cache.

  Args:
    q: ``[S, Hq, D]``, one query token per sequence; Hq a multiple of H.
    cache: the spec's physical array (``spec.physical_shape(B)``, storage dtype).
    spec: static :class:`kvjax.KVCacheSpec` (layout, cache dtype, geometry).
    seq_lens: int32 ``[S]`` (0 = no keys: output 0); block_table: int32 ``[S, M]``.
    scale: softmax scale (a Python float, or traced). sliding_window: W or None; soft_cap: c
      or None (static).
    sinks: float32 ``[Hq]`` per-query-head sink logits or None.
    k_scale, v_scale: global scales (fp8 per-tensor: scalar or [H]; nvfp4: scalar).
    interpret: Pallas interpret mode (CPU tests).
    query_start_loc: int ``[S+1]`` or None (= ``arange(S+1)``): row i of q is the query of
      the sequence whose entries are ``(i, i+1)``; rows of no such sequence output 0
      (:func:`kvjax.ragged_batch.decode_sequences`).
    config: static :class:`DecodeConfig` (None = the format's measured config,
      :func:`pallas_kernels.triton.tuning.decode_config`).
  Returns:
    ``[S, Hq, D]`` in q's dtype. Metadata outside the contract follows
    :mod:`kvjax.ragged_batch` (seq_lens clipped to the capacity, block ids to [0, B)).
  """
  s, hq, d = q.shape
  h = spec.num_kv_heads
  g = hq // h
  tf = tile_format(spec, q.dtype)
  config = tuning.decode_config(tf) if config is None else config
  tf = dataclasses.replace(tf, fast_decode=config.fast_decode, compute_dtype=np.dtype(
      config.compute_dtype or tf.compute_dtype))
  if config.pair_codes:
    tf = tf.paired(ptx=not interpret and pairs.pairs_in_ptx(spec.codec.quant))
  num_blocks = cache.shape[0]
  splits = tuning.choose_num_splits(config, s, h, jnp.shape(block_table)[1], spec.block_size)
  sink_hg = (jnp.zeros((h, g), jnp.float32) if sinks is None
             else jnp.asarray(sinks, jnp.float32).reshape(h, g))
  static_scale = static_or_none(scale)
  if query_start_loc is None:
    seq_of_row = jnp.arange(s, dtype=jnp.int32)
  else:
    seq_of_row = RB.decode_sequences(query_start_loc, s)
  pages = cache.reshape(num_blocks, tf.page_elems)
  res = decode_call(
      q.reshape(s, h, g, d), seq_of_row, jnp.asarray(seq_lens, jnp.int32),
      jnp.asarray(block_table, jnp.int32),
      _kernel_scales(tf, k_scale, v_scale, None if static_scale is not None else scale),
      sink_hg, pages, tuple(words_view(pages, dt) for dt in tf.view_dtypes(config.scale_words)),
      tf=tf, config=config,
      num_splits=splits,
      scale=static_scale, window=None if sliding_window is None else int(sliding_window),
      soft_cap=None if soft_cap is None else float(soft_cap), has_sinks=sinks is not None,
      interpret=bool(interpret))
  if not isinstance(res, tuple):
    return res.reshape(s, hq, d)                      # written by the kernel: [S, H, G, D]
  acc, m, l = res
  out = merge_splits(acc, m, l, None if sinks is None else sink_hg, g)  # [S, H, G, parts*W]
  w, dp = tf.part_width, d // tf.num_parts      # part j holds head dims P*i + j
  out = jnp.stack([out[..., j * w:j * w + dp] for j in range(tf.num_parts)], axis=-1)
  return out.reshape(s, hq, d).astype(q.dtype)
