"""The Pallas dequantize kernels (interpret mode) equal ``kvjax.views.dequantize_pages`` bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import KVCacheSpec, views
from kvjax.reference import cache_update as ref
from kv_testing import random_kv
from pallas_kernels.triton import dequant as dq

NUM_BLOCKS = 4
_ref_write = jax.jit(ref.write_kv, static_argnums=4)

# (cache_dtype, layout, H, D, N, model dtype, scales)
CASES = [
    ("auto", "NHD", 2, 64, 16, jnp.bfloat16, None),
    ("float16", "HND", 1, 128, 16, jnp.float32, None),
    ("fp8", "NHD", 8, 64, 16, jnp.bfloat16, "per_head"),
    ("fp8_e5m2", "HND", 2, 128, 32, jnp.bfloat16, "scalar"),
    ("int8_per_token_head", "NHD", 2, 80, 16, jnp.bfloat16, None),
    ("fp8_per_token_head", "HND", 8, 64, 16, jnp.float16, None),
    ("int4_per_token_head", "NHD", 8, 128, 16, jnp.bfloat16, None),
    ("int4_per_token_head", "HND", 2, 64, 32, jnp.bfloat16, None),
    ("int4_per_token_head", "HND", 1, 80, 16, jnp.float32, None),
    ("nvfp4", "HND", 2, 64, 16, jnp.bfloat16, "scalar"),       # swizzled V scales
    ("nvfp4", "HND", 8, 128, 32, jnp.bfloat16, None),
    ("nvfp4", "HND", 1, 80, 16, jnp.float16, "scalar"),        # S = 5, linear V scales
]


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-H{c[2]}-D{c[3]}-N{c[4]}")
def test_dequantize_pages_equals_views(rng, case):
  cd, layout, h, d, n, dtype, scales = case
  spec = KVCacheSpec(h, d, n, cd, layout, dtype)
  ks = vs = None
  if scales == "scalar":
    ks, vs = jnp.float32(rng.uniform(0.05, 0.5)), jnp.float32(rng.uniform(0.05, 0.5))
  elif scales == "per_head":
    ks, vs = (jnp.asarray(rng.uniform(0.05, 0.5, h).astype(np.float32)) for _ in range(2))
  t = NUM_BLOCKS * n
  key, value = random_kv(rng, spec, t)
  slots = jnp.asarray(rng.permutation(t).astype(np.int32))
  cache = _ref_write(spec.allocate(NUM_BLOCKS), key, value, slots, spec, ks, vs)
  pages = cache[jnp.asarray([2, 0, 3])]                      # a gather of pages, as read_kv does
  got = dq.dequantize_pages(pages, spec, ks, vs, interpret=True)
  want = views.dequantize_pages(pages, spec, ks, vs)
  for g, w in zip(got, want):
    assert g.shape == w.shape == (3, n, h, d) and g.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(g), _bits(w))
  assert np.abs(np.asarray(got[0])).max() > 0                 # real data was read


def test_leading_page_dims_and_read_kv(rng):
  spec = KVCacheSpec(2, 64, 16, "nvfp4", "HND")
  key, value = random_kv(rng, spec, NUM_BLOCKS * 16)
  slots = jnp.arange(NUM_BLOCKS * 16, dtype=jnp.int32)
  cache = _ref_write(spec.allocate(NUM_BLOCKS), key, value, slots, spec, None, None)
  pages = cache.reshape((2, NUM_BLOCKS // 2) + cache.shape[1:])
  k, v = dq.dequantize_pages(pages, spec, interpret=True)
  wk, wv = views.dequantize_pages(pages, spec)
  assert k.shape == (2, NUM_BLOCKS // 2, 16, 2, 64)
  np.testing.assert_array_equal(_bits(k), _bits(wk))
  np.testing.assert_array_equal(_bits(v), _bits(wv))
  # through read_kv: the "pallas" implementation of the read registry
  slots = jnp.asarray([5, 63, 17], jnp.int32)
  got = kvjax.read_kv(cache, spec, slots, impl="pallas", interpret=True)
  want = kvjax.read_kv(cache, spec, slots, impl="reference")
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))
