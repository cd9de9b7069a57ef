"""Shared helpers of the transfer tests: a request's K/V, per-rank caches written directly.

Importable by the tests and by the cross-process peer script (tests/_transfer_peer.py).
"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
import kvjax.transfer

FORMATS = {  # name -> (cache_dtype, head_size)
    "bf16": ("auto", 32),
    "fp8_per_token_head": ("fp8_per_token_head", 32),
    "nvfp4": ("nvfp4", 64),   # D=64: S=4 scales a row, so V scales are 4x4-swizzled
}


def rank_spec(cache_dtype, head_size, layout, total_heads, tp, block_size=16):
  """The per-rank spec of a TP group (``max(1, H/tp)`` heads)."""
  h = kvjax.transfer.heads_per_rank(total_heads, tp)
  return kvjax.KVCacheSpec(h, head_size, block_size, cache_dtype=cache_dtype, layout=layout)


def request_kv(seed, num_tokens, total_heads, head_size, dtype=jnp.bfloat16):
  """A request's K and V for all heads: ``[T, H, D]`` each, random, never all-zero."""
  g = np.random.default_rng(seed)
  k = g.standard_normal((num_tokens, total_heads, head_size), np.float32) * 2.0
  v = g.standard_normal((num_tokens, total_heads, head_size), np.float32)
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def slots_for(block_ids, num_tokens, block_size):
  pos = np.arange(num_tokens)
  return (np.asarray(block_ids)[pos // block_size] * block_size + pos % block_size).astype(np.int32)


@functools.partial(jax.jit, static_argnums=(4,))
def _write(cache, k, v, slots, spec, k_scale, v_scale):
  return kvjax.write_kv(cache, k, v, slots, spec, k_scale=k_scale, v_scale=v_scale,
                        impl="reference")


@functools.partial(jax.jit, static_argnames=("spec", "scale"))
def attention(q, cache, spec, query_start_loc, seq_lens, block_table, scale, k_scale=None,
              v_scale=None):
  """Jitted reference attention (causal, no extras) for the transfer tests."""
  return kvjax.unified_attention(q, cache, spec, query_start_loc=query_start_loc,
                                 seq_lens=seq_lens, block_table=block_table, scale=scale,
                                 k_scale=k_scale, v_scale=v_scale, impl="reference")


def write_rank_caches(spec, tp, total_heads, k, v, block_ids, num_blocks, devices, fill=None,
                      k_scale=None, v_scale=None):
  """Per-rank caches of a TP group with the request's K/V written at ``block_ids``.

  Rank r holds heads ``local_heads(r, tp, H)``; its cache starts as ``fill``
  (a per-rank list of arrays) or zeros; the request's blocks are zeroed before the
  write, so partially filled pages are well defined. Each cache lives on ``devices[r]``.
  """
  slots = jnp.asarray(slots_for(block_ids, k.shape[0], spec.block_size))
  out = []
  for r in range(tp):
    heads = np.asarray(kvjax.transfer.local_heads(r, tp, total_heads))
    cache = spec.allocate(num_blocks) if fill is None else jnp.asarray(fill[r])
    cache = cache.at[np.asarray(block_ids)].set(0)
    cache = _write(cache, k[:, heads], v[:, heads], slots, spec, k_scale, v_scale)
    out.append(jax.device_put(cache, devices[r]))
  return out


def poison_caches(spec, tp, num_blocks, seed):
  """Random-byte per-rank caches (numpy), to show untouched blocks stay untouched."""
  g = np.random.default_rng(seed)
  shape = spec.physical_shape(num_blocks)
  raw = g.integers(0, 256, (tp,) + shape + (spec.itemsize,), dtype=np.uint8)
  out = []
  for r in range(tp):
    x = raw[r].view(spec.storage_dtype).reshape(shape)
    if np.issubdtype(x.dtype, np.floating) or x.dtype.kind == "V":
      x = np.where(np.isfinite(x.astype(np.float32)), x, 0).astype(spec.storage_dtype)
    out.append(x)
  return out


def as_bytes(x):
  return np.asarray(jax.device_get(x)).view(np.uint8)


# -- the peer processes' messages -------------------------------------------------------------
def write_json_atomic(path, obj):
  """``obj`` as JSON at ``path``, appearing whole (a reader polling for the file never sees
  half of it)."""
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f)
  os.replace(path + ".tmp", path)


def reply(obj):
  """One JSON line on stdout: a peer's answer to one job."""
  print(json.dumps(obj), flush=True)
