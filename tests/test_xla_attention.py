"""The XLA attention (``impl="xla"``, kvjax/xla_attention.py): equal to the reference on fresh
data, and memory bounded by the batch, not the cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import KVCacheSpec, registry
from kvjax.xla_attention import XlaAttentionConfig, unified_attention as xla_attention

# Runs where the XLA attention is registered (kvjax/registry.py): compiled on those platforms.
pytestmark = pytest.mark.skipif(
    registry.platform() not in registry.ATTENTION.get("xla").platforms,
    reason="the XLA attention is not registered for this platform")


def _batch(rng, spec, num_seqs, ctx, q_len, num_blocks, hq):
  per = -(-ctx // spec.block_size)
  cache = spec.allocate(num_blocks)
  key = jnp.asarray(rng.standard_normal((num_blocks * spec.block_size, spec.num_kv_heads,
                                         spec.head_size)), spec.dtype)
  cache = kvjax.write_kv(cache, key, key * 0.5 - 0.1, jnp.arange(key.shape[0]), spec,
                         impl="reference")
  bt = jnp.asarray(rng.permutation(num_blocks)[:num_seqs * per].reshape(num_seqs, per))
  q = jnp.asarray(rng.standard_normal((num_seqs * q_len, hq, spec.head_size)), jnp.bfloat16)
  meta = dict(query_start_loc=jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len,
              seq_lens=jnp.full((num_seqs,), ctx, jnp.int32), block_table=bt)
  return q, cache, meta


@pytest.mark.parametrize("cache_dtype,layout", [("auto", "NHD"), ("fp8", "HND"),
                                                ("int8_per_token_head", "NHD"),
                                                ("nvfp4", "HND")])
@pytest.mark.parametrize("shape", ["decode 8x512", "prefill 1x256"])
def test_equals_the_reference(rng, cache_dtype, layout, shape):
  spec = KVCacheSpec(2, 64, 16, cache_dtype, layout)
  num_seqs, ctx, q_len = (8, 512, 1) if shape.startswith("decode") else (1, 256, 256)
  q, cache, meta = _batch(rng, spec, num_seqs, ctx, q_len, num_seqs * ctx // 16 + 5, 8)
  kw = dict(scale=0.125, max_query_len=q_len, **meta)
  run = lambda impl: np.asarray(jax.jit(lambda q, c: kvjax.unified_attention(
      q, c, spec, impl=impl, **kw))(q, cache), np.float32)
  want, got = run("reference"), run("xla")
  assert np.abs(want).max() > 0.05
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_equals_the_reference_in_token_rows_and_small_steps(rng):
  """A ragged batch with no max_query_len (rows are tokens) and one page a step."""
  spec = KVCacheSpec(2, 64, 16, "auto", "HND")
  q, cache, meta = _batch(rng, spec, 6, 40, 3, 40, 4)
  kw = dict(scale=0.125, sliding_window=20, soft_cap=4.0, **meta)
  want = kvjax.unified_attention(q, cache, spec, impl="reference", **kw)
  got = xla_attention(q, cache, spec, config=XlaAttentionConfig(step_bytes=1,
                                                                tokens_per_chunk=4), **kw)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_equals_the_reference_in_query_chunks(rng, layout):
  """Rows are sequences of ragged query lengths with cached prefixes, attended 16 query slots
  at a time (the last chunk padded), each chunk's key loop cut at its last position; window,
  soft cap and sinks."""
  spec = KVCacheSpec(2, 64, 16, "int8_per_token_head", layout)
  q_lens, prefix = np.array([37, 5, 60]), np.array([10, 30, 0])
  q, cache, _ = _batch(rng, spec, 3, 96, 60, 30, 4)
  q = q[:int(q_lens.sum())]
  meta = dict(query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
              seq_lens=jnp.asarray(q_lens + prefix, jnp.int32),
              block_table=jnp.asarray(rng.permutation(30)[:15].reshape(3, 5), jnp.int32))
  kw = dict(scale=0.125, sliding_window=40, soft_cap=4.0, max_query_len=60,
            sinks=jnp.asarray(rng.standard_normal(4), jnp.float32), **meta)
  want = kvjax.unified_attention(q, cache, spec, impl="reference", **kw)
  got = jax.jit(lambda q, c: xla_attention(q, c, spec, config=XlaAttentionConfig(
      query_chunk=16, step_bytes=1), **kw))(q, cache)
  assert np.abs(np.asarray(want, np.float32)).max() > 0.05
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


def _temp_bytes(impl, spec, num_blocks):
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  f = lambda q, c, qsl, sl, bt: kvjax.unified_attention(
      q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.1,
      max_query_len=1, impl=impl)
  compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((4, 8, 64), jnp.bfloat16),
                              jax.ShapeDtypeStruct(spec.physical_shape(num_blocks),
                                                   spec.storage_dtype),
                              i32(5), i32(4), i32(4, 8)).compile()
  analysis = compiled.memory_analysis()
  if analysis is None:
    pytest.skip("no memory_analysis on this backend")
  return analysis.temp_size_in_bytes


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_per_token_head"])
def test_memory_does_not_grow_with_unused_cache_blocks(cache_dtype):
  """A decode of 4 sequences: the XLA attention's temporaries are the same on a cache of 64
  blocks and on one of 32,768 blocks, and far below the large cache's float32 size."""
  spec = KVCacheSpec(2, 64, 16, cache_dtype, "NHD")
  small, large = (_temp_bytes("xla", spec, b) for b in (64, 32768))
  assert large <= small + 4096, (small, large)
  assert large < 32768 * spec.block_size * 2 * spec.num_kv_heads * spec.head_size * 4 / 100
