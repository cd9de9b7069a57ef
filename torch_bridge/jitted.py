"""The jitted JAX functions behind the facade, shared by every backend with the same config,
and the shape buckets that bound how many programs a serving run compiles.

vLLM builds one attention backend per layer; keying the jitted functions by their
static configuration (spec, scale, options, impl, matmul precision) makes every layer
reuse the same compiled programs. Arguments are arrays (or None) only, so calls take
jit's fast C++ dispatch path.

Matmul precision: ``precision`` (None, or a ``jax.default_matmul_precision`` name) is
applied while the function is traced, so every dot inside (Pallas kernels included)
carries it; None leaves JAX's own setting in force.
"""
from __future__ import annotations

import contextlib
import functools

import jax

import kvjax
from kvjax.spec import KVCacheSpec


#: ``torch.get_float32_matmul_precision()`` -> ``jax.default_matmul_precision`` name.
TORCH_TO_JAX_PRECISION = {"highest": "float32", "high": "tensorfloat32", "medium": "bfloat16"}


def _precision(precision):
  return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


@functools.lru_cache(maxsize=None)
def write_fn(spec: KVCacheSpec, impl: str, interpret, donate: bool, precision=None):
  """``f(cache, key, value, slot_mapping, k_scale, v_scale, layer) -> new cache``.

  With ``donate`` the cache argument is donated, so the write lands in its buffer.
  ``layer``: None (one layer's cache) or an int32 scalar (a layered cache): traced, so
  every layer runs one program.
  """
  def write(cache, key, value, slot_mapping, k_scale, v_scale, layer):
    with _precision(precision):
      return kvjax.write_kv(cache, key, value, slot_mapping, spec, k_scale=k_scale,
                            v_scale=v_scale, impl=impl, interpret=interpret, layer=layer)
  return jax.jit(write, donate_argnums=(0,) if donate else ())


@functools.lru_cache(maxsize=None)
def attention_fn(spec: KVCacheSpec, scale: float, causal: bool, sliding_window, soft_cap,
                 max_query_len: int, impl: str, interpret, donate_out: bool = False,
                 precision=None):
  """``f(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale, layer)
  -> out``.

  ``out`` is ``[T, Hq, D]`` in q's dtype (kvjax.unified_attention); ``layer`` as in
  :func:`write_fn`. With ``donate_out`` the function takes a tenth argument, a donated
  ``[T, Hq, D]`` buffer (its values unused) that XLA reuses for the result: the output
  lands there.
  """
  def attend(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale, layer):
    with _precision(precision):
      return kvjax.unified_attention(
          q, cache, spec, query_start_loc=query_start_loc, seq_lens=seq_lens,
          block_table=block_table, scale=scale, causal=causal, sliding_window=sliding_window,
          soft_cap=soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
          max_query_len=max_query_len, impl=impl, interpret=interpret, layer=layer)
  if not donate_out:
    return jax.jit(attend)

  def attend_into(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale,
                  layer, out):
    del out   # only its buffer is wanted: donated, aliased to the result
    return attend(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale,
                  layer)
  return jax.jit(attend_into, donate_argnums=(9,), keep_unused=True)


def pow2_at_least(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def query_len_bucket(max_query_len: int, num_tokens: int) -> int:
  """1 for a pure decode step, else the next power of two (at most T): few compilations."""
  if max_query_len <= 1:
    return 1
  return min(pow2_at_least(max_query_len), max(num_tokens, 1))


def num_seqs_bucket(num_seqs: int, num_tokens: int) -> int:
  """How many sequences the facade passes for ``num_seqs`` real ones and T query rows.

  Sequences are padded with zero-length entries (no query rows, no KV: they change no
  output row), so the count is a function of T alone or a power of two: at most
  ``log2(T) + 2`` values per token count. ``S == T`` (one token per sequence: the
  decode kernel's case) is kept as is; otherwise the bucket stays below T, so padding
  never turns a ragged batch into the decode kernel's ``S == T`` shape.
  """
  if num_seqs >= num_tokens:
    return num_seqs
  return min(pow2_at_least(num_seqs), num_tokens - 1)


def table_width_bucket(width: int) -> int:
  """Block-table columns passed (the next power of two; extra columns are never read)."""
  return pow2_at_least(width)
