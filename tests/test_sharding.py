"""Head-sharded caches over a TP mesh axis of simulated CPU devices vs the unsharded reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import kvjax
from kvjax import sharding as KS


def mesh_of(tp, extra=1):
  devs = np.asarray(jax.devices()[:tp * extra]).reshape(extra, tp)
  return Mesh(devs, ("dp", "tp"))


def random_kv(rng, t, h, d):
  k = jnp.asarray(rng.standard_normal((t, h, d)) * 2, jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
  return k, v


def test_cache_sharding_splits_head_axis():
  mesh = mesh_of(4)
  nhd = kvjax.KVCacheSpec(8, 32, 16, layout="NHD")
  hnd = kvjax.KVCacheSpec(8, 32, 16, layout="HND")
  assert KS.cache_sharding(mesh, nhd).spec == P(None, None, "tp", None)
  assert KS.cache_sharding(mesh, hnd).spec == P(None, "tp", None, None)
  cache = hnd.allocate(6, sharding=KS.cache_sharding(mesh, hnd))
  shards = KS.rank_caches(cache, hnd, mesh)
  assert [s.shape for s in shards] == [(6, 2, 16, 64)] * 4
  assert [list(s.devices())[0] for s in shards] == jax.devices()[:4]
  assert KS.cache_sharding(mesh, kvjax.MLACacheSpec(64, 16)).spec == P()


def test_cache_sharding_refusals():
  mesh = mesh_of(4)
  with pytest.raises(ValueError, match="K heads then V heads"):
    KS.cache_sharding(mesh, kvjax.KVCacheSpec(8, 64, 16, cache_dtype="nvfp4", layout="HND"))
  with pytest.raises(ValueError, match="multiple of the mesh axis"):
    KS.cache_sharding(mesh, kvjax.KVCacheSpec(2, 32, 16))
  with pytest.raises(ValueError, match="not a mesh axis"):
    KS.cache_sharding(mesh, kvjax.KVCacheSpec(8, 32, 16), axis="model")


@pytest.mark.parametrize("cache_dtype,layout,tp", [("auto", "NHD", 4), ("fp8_per_token_head", "HND", 2),
                                                   ("int8_per_token_head", "NHD", 8),
                                                   ("fp8", "HND", 4)])
def test_sharded_write_and_attention_match_unsharded(rng, cache_dtype, layout, tp):
  h, d, n, nb = 8, 32, 16, 6
  spec = kvjax.KVCacheSpec(h, d, n, cache_dtype=cache_dtype, layout=layout)
  mesh = mesh_of(tp, 8 // tp)
  t = 37
  k, v = random_kv(rng, t, h, d)
  blocks = np.array([4, 0, 5])
  pos = np.arange(t)
  slots = jnp.asarray(blocks[pos // n] * n + pos % n, jnp.int32)
  scales = {}
  if cache_dtype == "fp8":   # per-head scales split with the heads
    scales = dict(k_scale=jnp.asarray(rng.uniform(0.01, 0.05, h), jnp.float32),
                  v_scale=jnp.asarray(0.02, jnp.float32))
  fill = jnp.asarray(rng.integers(0, 100, spec.physical_shape(nb)), spec.storage_dtype)
  want = kvjax.write_kv(fill, k, v, slots, spec, impl="reference", **scales)
  cache = jax.device_put(fill, KS.cache_sharding(mesh, spec))
  got = KS.sharded_write_kv(cache, k, v, slots, spec, mesh, impl="reference", **scales)
  assert got.sharding.is_equivalent_to(KS.cache_sharding(mesh, spec), 4)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))

  hq = 2 * h
  q = jnp.asarray(rng.standard_normal((5, hq, d)), jnp.bfloat16)
  sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
  meta = dict(query_start_loc=jnp.array([0, 2, 5]), seq_lens=jnp.array([t, 20]),
              block_table=jnp.array([[4, 0, 5], [1, 2, 0]]), scale=d ** -0.5, sinks=sinks,
              sliding_window=30, **scales)
  ref = kvjax.unified_attention(q, want, spec, impl="reference", **meta)
  out = KS.sharded_unified_attention(q, got, spec, mesh, impl="reference", **meta)
  assert out.shape == ref.shape and float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) > 0
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_rank_caches_roundtrip(rng):
  spec = kvjax.KVCacheSpec(4, 32, 16, layout="NHD")
  mesh = mesh_of(4)
  per_rank = [jnp.asarray(rng.standard_normal((3, 16, 1, 64)), jnp.bfloat16) for _ in range(4)]
  glob = KS.from_rank_caches(per_rank, spec, mesh)
  np.testing.assert_array_equal(np.asarray(glob, np.float32),
                                np.concatenate([np.asarray(x, np.float32) for x in per_rank], 2))
  back = KS.rank_caches(glob, spec, mesh)
  for a, b in zip(back, per_rank):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
