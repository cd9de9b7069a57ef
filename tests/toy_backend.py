"""A test-only attention backend, added by this one file plus one registry line.

"toy_dense": every sequence's pages dequantized at once and attended with dense masked
softmax (plain jnp, vectorized over tokens: no per-token map like the reference). It runs
anywhere. Its adapter table has one row, matching every codec: the codec's own reference
dequantize is its per-format code. The op suites register it with
``registry.ATTENTION.register("toy_dense", "toy_backend:unified_attention",
supports="toy_backend:supports_attention")`` (after the reference, so ``auto`` never picks
it).
"""
import jax
import jax.numpy as jnp

from kvjax import ragged_batch as RB
from kvjax.adapters import Adapter, AdapterTable

ADAPTERS = AdapterTable("toy_dense", (
    Adapter("every codec (pages dequantized by the codec)", lambda codec: True,
            lambda pages, spec, k_scale, v_scale: spec.codec.dequantize(pages, spec, k_scale,
                                                                         v_scale)),
))


def supports_attention(spec, q_dtype):
  del q_dtype
  return ADAPTERS.reason(spec)


def unified_attention(q, cache, spec, *, query_start_loc, seq_lens, block_table, scale,
                      causal=True, sliding_window=None, soft_cap=None, sinks=None, k_scale=None,
                      v_scale=None, max_query_len=None):
  t, hq, d = q.shape
  h, n = spec.num_kv_heads, spec.block_size
  g = hq // h
  max_blocks = block_table.shape[1]
  qsl, sl = RB.clamp_metadata(query_start_loc, seq_lens, num_tokens=t, capacity=max_blocks * n)
  seq, pos, real = RB.token_positions(qsl, sl, t, max_query_len)
  dequantize = ADAPTERS.hooks(spec.codec)
  k, v = dequantize(cache, spec, k_scale, v_scale)                   # [B, N, H, D]
  blocks = RB.clamp_blocks(block_table, cache.shape[0])[seq]         # [T, M]
  k = k[blocks].reshape(t, max_blocks * n, h, d)
  v = v[blocks].reshape(t, max_blocks * n, h, d)
  key = jnp.arange(max_blocks * n)
  ok = (key[None, :] < sl[seq][:, None]) & real[:, None]
  if causal:
    ok &= key[None, :] <= pos[:, None]
  if sliding_window is not None:
    ok &= pos[:, None] - key[None, :] < sliding_window
  qf = q.astype(jnp.float32).reshape(t, h, g, d)
  s = jnp.einsum("thgd,tkhd->thgk", qf, k, precision=jax.lax.Precision.HIGHEST) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  if sinks is not None:
    m = jnp.maximum(m, sinks.reshape(h, g)[None])
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(ok[:, None, None, :], jnp.exp(s - m[..., None]), 0.0)
  denom = jnp.sum(p, axis=-1)
  if sinks is not None:
    denom = denom + jnp.exp(sinks.reshape(h, g)[None] - m)
  v = jnp.where(ok[:, :, None, None], v, 0.0)
  out = jnp.einsum("thgk,tkhd->thgd", p, v, precision=jax.lax.Precision.HIGHEST)
  out = jnp.where((denom > 0)[..., None], out / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
  return out.reshape(t, hq, d).astype(q.dtype)
