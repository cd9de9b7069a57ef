"""Reference unified (ragged prefill + decode) paged attention, pure jnp (spec §6).

The oracle for every attention kernel: simple, float32 at HIGHEST precision,
one query token at a time over its sequence's dequantized pages.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.spec import KVCacheSpec
from kvjax.views import dequantize_pages

_HI = jax.lax.Precision.HIGHEST


def token_positions(query_start_loc, seq_lens, num_tokens: int):
  """Per flattened query token: (sequence id, absolute position, is a real token).

  query_start_loc: int ``[S+1]``; seq_lens: int ``[S]`` (prefix + new tokens).
  Tokens at or past ``query_start_loc[S]`` are padding (is-real False).
  """
  qsl = query_start_loc.astype(jnp.int32)
  num_seqs = seq_lens.shape[0]
  i = jnp.arange(num_tokens, dtype=jnp.int32)
  seq = jnp.searchsorted(qsl[1:], i, side="right").astype(jnp.int32)
  real = seq < num_seqs
  seq = jnp.minimum(seq, num_seqs - 1)
  q_len = qsl[seq + 1] - qsl[seq]
  pos = seq_lens.astype(jnp.int32)[seq] - q_len + (i - qsl[seq])
  return seq, pos, real


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
                      k_scale=None, v_scale=None):
  """Ragged paged attention over the packed cache.

  Args:
    q: ``[T, Hq, D]`` flattened query tokens; Hq a multiple of H.
    cache: the spec's physical cache array ``[B, ...]``.
    query_start_loc: int32 ``[S+1]``; seq_lens: int32 ``[S]``; block_table: int32
      ``[S, max_blocks]``.
    scale: softmax scale. sliding_window: W or None. soft_cap: c or None.
    sinks: float32 ``[Hq]`` per-query-head sink logits or None.
    k_scale, v_scale: global scales of fp8 per-tensor / nvfp4 caches.
  Returns:
    ``[T, Hq, D]`` in q's dtype; padding tokens and rows with no visible key are 0.
  """
  t, hq, d = q.shape
  h = spec.num_kv_heads
  g = hq // h
  n = spec.block_size
  num_blocks = cache.shape[0]
  k_all, v_all = dequantize_pages(cache, spec, k_scale, v_scale)    # [B, N, H, D]
  seq, pos, real = token_positions(query_start_loc, seq_lens, t)
  max_blocks = block_table.shape[1]
  key_pos = jnp.arange(max_blocks * n, dtype=jnp.int32)
  sink_hg = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(h, g)

  def one(args):
    qi, si, pi, ri = args
    blocks = jnp.clip(block_table[si].astype(jnp.int32), 0, num_blocks - 1)
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
