"""The jitted JAX functions behind the facade, shared by every backend with the same config.

vLLM builds one attention backend per layer; keying the jitted functions by their
static configuration (spec, scale, options, impl) makes every layer reuse the
same compiled programs. Arguments are arrays (or None) only, so calls take jit's
fast C++ dispatch path.
"""
from __future__ import annotations

import functools

import jax

import kvjax
from kvjax.spec import KVCacheSpec


@functools.lru_cache(maxsize=None)
def write_fn(spec: KVCacheSpec, impl: str, interpret, donate: bool):
  """``f(cache, key, value, slot_mapping, k_scale, v_scale) -> new cache``.

  With ``donate`` the cache argument is donated, so the write lands in its buffer.
  """
  def write(cache, key, value, slot_mapping, k_scale, v_scale):
    return kvjax.write_kv(cache, key, value, slot_mapping, spec, k_scale=k_scale,
                          v_scale=v_scale, impl=impl, interpret=interpret)
  return jax.jit(write, donate_argnums=(0,) if donate else ())


@functools.lru_cache(maxsize=None)
def attention_fn(spec: KVCacheSpec, scale: float, causal: bool, sliding_window, soft_cap,
                 max_query_len: int, impl: str, interpret, donate_out: bool = False):
  """``f(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale) -> out``.

  ``out`` is ``[T, Hq, D]`` in q's dtype (kvjax.unified_attention). With
  ``donate_out`` the function takes a ninth argument, a donated ``[T, Hq, D]``
  buffer (its values unused) that XLA reuses for the result: the output lands there.
  """
  def attend(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale):
    return kvjax.unified_attention(
        q, cache, spec, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_table=block_table, scale=scale, causal=causal, sliding_window=sliding_window,
        soft_cap=soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        max_query_len=max_query_len, impl=impl, interpret=interpret)
  if not donate_out:
    return jax.jit(attend)

  def attend_into(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale,
                  out):
    del out   # only its buffer is wanted: donated, aliased to the result
    return attend(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale)
  return jax.jit(attend_into, donate_argnums=(8,), keep_unused=True)


def query_len_bucket(max_query_len: int, num_tokens: int) -> int:
  """1 for a pure decode step, else the next power of two (at most T): few compilations."""
  if max_query_len <= 1:
    return 1
  return min(1 << (max_query_len - 1).bit_length(), max(num_tokens, 1))
