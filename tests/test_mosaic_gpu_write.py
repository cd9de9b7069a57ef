"""Mosaic GPU cache write (pallas_kernels.mosaic_gpu.write): rows stored at their slots in
place, bytes equal to kvjax's reference write on poisoned caches; slots outside the cache
(negative: padding; past the end) leave every byte as it was. Mosaic GPU interpret mode (jax
>= 0.11) or compiled with ``KVJAX_TEST_COMPILED=1``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.reference import write_kv
from op_suite import COMPILED, mosaic_gpu_numerics
from pallas_kernels.mosaic_gpu.write import write_rows


@mosaic_gpu_numerics
@pytest.mark.parametrize("cache_dtype,layout,h,d,n", [
    ("bfloat16", "NHD", 2, 64, 16), ("bfloat16", "HND", 3, 128, 32), ("float16", "NHD", 1, 256, 16),
])
def test_rows_land_at_their_slots_and_nowhere_else(rng, cache_dtype, layout, h, d, n):
  dtype = jnp.float16 if cache_dtype == "float16" else jnp.bfloat16
  spec = kvjax.KVCacheSpec(h, d, n, cache_dtype, layout=layout, dtype=dtype)
  num_blocks = 6
  raw = rng.integers(0, 256, int(np.prod(spec.physical_shape(num_blocks))) * 2, dtype=np.uint8)
  cache = jnp.asarray(raw.view(spec.storage_dtype).reshape(spec.physical_shape(num_blocks)))
  t = 9
  slots = rng.permutation(num_blocks * n)[:t].astype(np.int32)
  slots[2], slots[5] = -1, num_blocks * n + 3             # padding, past the end: skipped
  k, v = (jnp.asarray(rng.standard_normal((t, h, d)), dtype) for _ in range(2))
  want = write_kv(cache, k, v, jnp.asarray(slots), spec)
  got = jax.jit(lambda c, k, v, s: write_rows(c, k, v, s, spec, interpret=not COMPILED),
                donate_argnums=0)(jnp.copy(cache), k, v, jnp.asarray(slots))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
  assert (np.asarray(got).view(np.uint8) != np.asarray(cache).view(np.uint8)).any()


@mosaic_gpu_numerics
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_layered_cache_rows_land_in_their_layer_only(rng, layout):
  spec = kvjax.KVCacheSpec(2, 64, 16, "bfloat16", layout=layout, dtype=jnp.bfloat16)
  blocks, layers, layer, t = 4, 3, 1, 6
  shape = spec.physical_shape(blocks, layers)
  raw = rng.integers(0, 256, int(np.prod(shape)) * 2, dtype=np.uint8)
  cache = jnp.asarray(raw.view(spec.storage_dtype).reshape(shape))
  slots = rng.permutation(blocks * 16)[:t].astype(np.int32)
  slots[3] = -1
  k, v = (jnp.asarray(rng.standard_normal((t, 2, 64)), jnp.bfloat16) for _ in range(2))
  want = kvjax.write_kv(cache, k, v, jnp.asarray(slots), spec, impl="reference", layer=layer)
  got = jax.jit(lambda c, k, v, s, li: write_rows(c, k, v, s, spec, interpret=not COMPILED,
                                                   layer=li), donate_argnums=0)(
      jnp.copy(cache), k, v, jnp.asarray(slots), jnp.int32(layer))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
