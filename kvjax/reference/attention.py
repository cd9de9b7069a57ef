"""Reference unified (ragged prefill + decode) paged attention, pure jnp (docs/layout.md §6).

The oracle for every attention kernel: simple, float32 at HIGHEST precision,
one query token at a time over its sequence's dequantized pages. Like every implementation it
computes on the values as stored: for a rotated format (int4 per token-head) q arrives rotated
and the output leaves rotated (``kvjax.unified_attention`` does both).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import ragged_batch as RB
from kvjax.ragged_batch import token_positions  # noqa: F401  (pallas_kernels.mosaic_tpu's import)
from kvjax.spec import KVCacheSpec
from kvjax.views import dequantize_stored

_HI = jax.lax.Precision.HIGHEST


def attention_row(q, k, v, valid, *, scale, soft_cap=None, sink=None):
  """One query token over its keys.

  q: ``[H, G, D]`` (GQA groups), k, v: float32 ``[L, H, D]``, valid: bool ``[L]``,
  sink: float32 ``[H, G]`` or None. Returns float32 ``[H, G, D]``, 0 where no key is valid.
  """
  s = jnp.einsum("hgd,lhd->hgl", q.astype(jnp.float32), k, precision=_HI) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  s = jnp.where(valid[None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  if sink is not None:
    m = jnp.maximum(m, sink)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid[None, None, :], jnp.exp(s - m_safe[..., None]), 0.0)
  denom = jnp.sum(p, axis=-1)
  if sink is not None:
    denom = denom + jnp.exp(sink - m_safe)
  v = jnp.where(valid[:, None, None], v, 0.0)   # 0 * NaN of an unwritten slot would be NaN
  out = jnp.einsum("hgl,lhd->hgd", p, v, precision=_HI)
  any_valid = jnp.any(valid)
  return jnp.where(any_valid, out / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


def unified_attention(q, cache, spec: KVCacheSpec, *, query_start_loc, seq_lens, block_table,
                      scale, causal=True, sliding_window=None, soft_cap=None, sinks=None,
                      k_scale=None, v_scale=None, max_query_len=None):
  """Ragged paged attention over the packed cache.

  Args:
    q: ``[T, Hq, D]`` flattened query tokens; Hq a multiple of H.
    cache: the spec's physical cache array ``[B, ...]``.
    query_start_loc: int32 ``[S+1]``; seq_lens: int32 ``[S]``; block_table: int32
      ``[S, max_blocks]``.
    scale: softmax scale. sliding_window: W or None. soft_cap: c or None.
    sinks: float32 ``[Hq]`` per-query-head sink logits or None.
    k_scale, v_scale: global scales of fp8 per-tensor / nvfp4 caches.
    max_query_len: None, or the bound the caller promises on every sequence's query length;
      a sequence above it outputs 0 (as the kernels do, which tile by it).
  Returns:
    ``[T, Hq, D]`` in q's dtype; padding tokens and rows with no visible key are 0.

  Metadata outside the contract (possible under ``jit``) follows the rules of
  :mod:`kvjax.ragged_batch`, as every kernel does: ``query_start_loc`` clipped to [0, T] and
  made non-decreasing, ``seq_lens`` clipped to the block table's capacity, block ids clipped
  to [0, B), rows of no sequence (or of a sequence longer than ``max_query_len``) are 0.
  """
  t, hq, d = q.shape
  h = spec.num_kv_heads
  g = hq // h
  n = spec.block_size
  num_blocks = cache.shape[0]
  max_blocks = block_table.shape[1]
  k_all, v_all = dequantize_stored(cache, spec, k_scale, v_scale)   # [B, N, H, D]
  qsl, seq_lens = RB.clamp_metadata(query_start_loc, seq_lens, num_tokens=t,
                                    capacity=max_blocks * n)
  seq, pos, real = RB.token_positions(qsl, seq_lens, t, max_query_len)
  key_pos = jnp.arange(max_blocks * n, dtype=jnp.int32)
  sink_hg = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(h, g)

  def one(args):
    qi, si, pi, ri = args
    blocks = RB.clamp_blocks(block_table[si], num_blocks)
    k = k_all[blocks].reshape(max_blocks * n, h, d)
    v = v_all[blocks].reshape(max_blocks * n, h, d)
    valid = (key_pos < seq_lens[si]) & ri
    if causal:
      valid &= key_pos <= pi
    if sliding_window is not None:
      valid &= pi - key_pos < sliding_window
    return attention_row(qi.reshape(h, g, d), k, v, valid, scale=scale, soft_cap=soft_cap,
                         sink=sink_hg)

  out = jax.lax.map(one, (q, seq, pos, real), batch_size=min(t, 16) or None)
  return out.reshape(t, hq, d).astype(q.dtype)
