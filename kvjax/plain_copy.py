"""A plain (16-bit) copy of the pages a batch reads, for prefill-heavy batches on quantized caches.

A prefill does many query rows of work per KV token, so a kernel that dequantizes K/V tiles
in its inner loop pays the conversion once per query tile; on tensor cores that read their
operands from shared memory in one dtype, a quantized tile also needs a register round trip
before every product. When the batch has at least :data:`MIN_TOKENS_PER_KV` query tokens
per KV token it can read, it is cheaper to dequantize the named pages once, into a plain
cache in the query dtype, and run the plain kernel over it.

:func:`worth_a_plain_copy` is that static rule (shapes only); :func:`plain_pages` builds the
copy (the format's own dequantize, :meth:`kvjax.codecs.Codec.dequantize`, on the gathered
pages) and the block table that reads it. Values: every dequantized element rounded once to
the query dtype (as a cache of that dtype holds them); scales are applied in float32 first.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax import ragged_batch as RB
from kvjax.spec import KVCacheSpec

#: Query tokens per KV token of block-table capacity from which the copy pays (one page
#: read and one 16-bit page written per KV token against the dequantization in every query
#: tile's inner loop).
MIN_TOKENS_PER_KV = 0.25
#: The copy is never larger than this (bytes).
MAX_COPY_BYTES = 2 << 30


def is_plain(spec: KVCacheSpec) -> bool:
  """Whether the cache already is plain (values stored as they are, no scales): a plain
  kernel can read it without a copy."""
  return spec.codec.is_plain


def copy_bytes(spec: KVCacheSpec, num_seqs: int, max_blocks: int, dtype) -> int:
  """Bytes of the plain copy of ``num_seqs * max_blocks`` pages in ``dtype``."""
  kv = 2 * spec.num_kv_heads * spec.head_size * np.dtype(dtype).itemsize
  return num_seqs * max_blocks * spec.block_size * kv


def worth_a_plain_copy(spec: KVCacheSpec, q_dtype, num_tokens: int, num_seqs: int,
                       max_blocks: int) -> bool:
  """Whether attention over a quantized cache should read a plain copy of its pages.

  True when the cache is quantized, q is 16-bit, the batch has at least
  :data:`MIN_TOKENS_PER_KV` query tokens per KV token of capacity
  (``num_seqs * max_blocks * block_size``), and the copy stays under
  :data:`MAX_COPY_BYTES`. Static: decided from shapes.
  """
  if not spec.codec.is_quantized or np.dtype(q_dtype).itemsize != 2:
    return False
  capacity = num_seqs * max_blocks * spec.block_size
  if capacity == 0 or num_tokens < MIN_TOKENS_PER_KV * capacity:
    return False
  return copy_bytes(spec, num_seqs, max_blocks, q_dtype) <= MAX_COPY_BYTES


def plain_spec(spec: KVCacheSpec, dtype) -> KVCacheSpec:
  """The plain cache spec of the copy: same geometry and layout, ``dtype`` storage."""
  return KVCacheSpec(num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                     block_size=spec.block_size, cache_dtype="auto", layout=spec.layout,
                     dtype=dtype)


def plain_pages(cache, spec: KVCacheSpec, block_table, k_scale=None, v_scale=None, *,
                dtype=jnp.bfloat16):
  """Plain copy of the pages ``block_table`` names.

  Args:
    cache: ``spec``'s physical cache ``[B, ...]``.
    block_table: int32 ``[S, M]``; ids outside [0, B) are clamped into it first
      (:func:`kvjax.ragged_batch.clamp_blocks`, the rule every kernel follows).
    k_scale, v_scale: the format's global scales, if any.
    dtype: the copy's dtype (16-bit: the query dtype).
  Returns:
    ``(pages, plain, table)``: the physical plain cache ``[S*M, ...]`` of ``plain`` =
    :func:`plain_spec`, and int32 ``[S, M]`` ``table[s, j] = s*M + j`` that reads it.
  """
  s, m = block_table.shape
  ids = RB.clamp_blocks(jnp.asarray(block_table, jnp.int32).reshape(-1), cache.shape[0])
  k, v = spec.codec.dequantize(cache[ids], spec, k_scale, v_scale)     # [S*M, N, H, D] f32
  plain = plain_spec(spec, dtype)
  big = float(jnp.finfo(dtype).max)                                   # saturate, as q does
  rows = jnp.clip(jnp.concatenate([k, v], axis=-1), -big, big).astype(dtype)  # token-major
  pages = jnp.swapaxes(rows, 1, 2) if spec.layout == "HND" else rows
  table = jnp.arange(s * m, dtype=jnp.int32).reshape(s, m)
  return pages, plain, table
