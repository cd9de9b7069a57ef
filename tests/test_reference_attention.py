"""The public attention entry (defaults, validation, auto on a GPU) and legacy 5-D caches.

The attention case suite, the reference among its implementations, is test_op_attention.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from attention_cases import build_batch, numpy_attention
from kv_testing import spec_for


def test_public_entry_defaults_to_reference_on_cpu_and_validates(rng):
  spec = spec_for("bfloat16", num_kv_heads=2, head_size=32)
  q, cache, meta, kk, vv = build_batch(rng, spec, [3, 1], [4, 9], 4)
  out = jax.jit(lambda q, c, m: kvjax.unified_attention(q, c, spec, scale=0.2, **m))(q, cache,
                                                                                  meta)
  expect = numpy_attention(q, meta, kk, vv, scale=0.2)
  np.testing.assert_allclose(np.asarray(out), expect, rtol=2e-5, atol=2e-5)
  bad = [
      (dict(q=q[:, :3]), ValueError, "multiple of num_kv_heads"),
      (dict(q=q[..., :16]), ValueError, "head size"),
      (dict(seq_lens=meta["seq_lens"][:1]), ValueError, "disagree"),
      (dict(sliding_window=0), ValueError, "sliding_window"),
      (dict(sinks=jnp.zeros(3)), ValueError, "sinks"),
      (dict(seq_lens=meta["seq_lens"] + 1000), ValueError, "capacity"),
      (dict(impl="cuda"), ValueError, "impl"),
      (dict(max_query_len=2), ValueError, "max_query_len"),
  ]
  for override, err, match in bad:
    args = dict(q=q, cache=cache, spec=spec, scale=0.2, **meta)
    args.update(override)
    with pytest.raises(err, match=match):
      kvjax.unified_attention(**args)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_legacy_5d_roundtrip(rng, layout):
  spec = spec_for("bfloat16", layout, num_kv_heads=3, head_size=32)
  legacy = jnp.asarray(rng.standard_normal((4, 2, 16, 3, 32)).astype(np.float32), jnp.bfloat16)
  packed = kvjax.from_legacy_5d(legacy, spec)
  assert packed.shape == spec.physical_shape(4)
  k, v = kvjax.kv_views(packed, spec)
  np.testing.assert_array_equal(np.asarray(k), np.asarray(legacy[:, 0]))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(legacy[:, 1]))
  np.testing.assert_array_equal(np.asarray(kvjax.to_legacy_5d(packed, spec)), np.asarray(legacy))
  with pytest.raises(ValueError, match="legacy"):
    kvjax.from_legacy_5d(legacy[:, :1], spec)
  with pytest.raises(ValueError, match="scales"):
    kvjax.from_legacy_5d(legacy, spec_for("int8_per_token_head"))


def test_auto_on_gpu_runs_the_ragged_kernel(rng, monkeypatch):
  """impl="auto" on a GPU backend sends a ragged batch to the ragged Triton kernel (here in
  interpret mode), not the reference, and matches the numpy oracle."""
  from kvjax import registry
  from pallas_kernels.triton import ragged as ragged_attention
  calls = []
  kernel = ragged_attention.ragged_paged_attention

  def spy(*args, **kwargs):
    calls.append(kwargs.get("interpret"))
    return kernel(*args, **kwargs)

  monkeypatch.setattr(ragged_attention, "ragged_paged_attention", spy)
  spec = spec_for("bfloat16", num_kv_heads=2, head_size=32)
  q, cache, meta, kk, vv = build_batch(rng, spec, [3, 1], [4, 9], 4)
  monkeypatch.setattr(registry, "platform_of", lambda cache: "gpu")   # the cache on a GPU
  out = kvjax.unified_attention(q, cache, spec, scale=0.2, interpret=True, **meta)
  assert calls == [True]
  np.testing.assert_allclose(np.asarray(out), numpy_attention(q, meta, kk, vv, scale=0.2),
                             rtol=2e-5, atol=2e-5)


def test_jit_of_the_public_ops_needs_no_static_argnums(rng):
  """KVCacheSpec is a static pytree node: jax.jit of the public functions just works."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16)
  cache = spec.allocate(4)
  k, v = (jnp.asarray(rng.standard_normal((5, 2, 32)), jnp.bfloat16) for _ in range(2))
  slots = jnp.asarray([3, 20, 41, 60, 7], jnp.int32)
  cache = jax.jit(kvjax.write_kv)(cache, k, v, slots, spec)
  rk, _ = jax.jit(kvjax.read_kv)(cache, spec, slots)
  np.testing.assert_array_equal(np.asarray(rk), np.asarray(k, np.float32))
  q = jnp.asarray(rng.standard_normal((5, 4, 32)), jnp.bfloat16)
  meta = dict(query_start_loc=jnp.asarray([0, 2, 5], jnp.int32),
              seq_lens=jnp.asarray([2, 3], jnp.int32),
              block_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32))
  out = jax.jit(kvjax.unified_attention)(q, cache, spec, scale=0.25, **meta)
  want = kvjax.reference.unified_attention(q, cache, spec, scale=0.25, **meta)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  assert jax.tree_util.tree_leaves(spec) == [] and hash(spec) == hash(
      kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16))
  mla = kvjax.MLACacheSpec()
  assert jax.tree_util.tree_leaves(mla) == [] and hash(mla) == hash(kvjax.MLACacheSpec())
