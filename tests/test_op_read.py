"""The read case suite: every case on every implementation of the read op (kvjax.read_kv).

Implementations come from ``kvjax.registry.READ`` (see op_suite.py). Each dequantizes
written pages of every format (poisoned pages included) and must equal the reference's
float32 bits.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import KVCacheSpec, registry
from kv_testing import jit_reference_read, jit_reference_write, random_kv
from op_suite import implementations, run_mode, toy_format  # noqa: F401 (fixture)
from toy_format import TOY

NUM_BLOCKS = 4

SLOW = pytest.mark.slow

# (cache_dtype, layout, H, D, N, model dtype, scales)
CASES = [
    ("auto", "NHD", 2, 64, 16, jnp.bfloat16, None),
    ("fp8", "NHD", 8, 64, 16, jnp.bfloat16, "per_head"),
    ("int8_per_token_head", "NHD", 2, 80, 16, jnp.bfloat16, None),
    ("int4_per_token_head", "HND", 1, 16, 16, jnp.float32, None),
    ("nvfp4", "HND", 2, 64, 16, jnp.bfloat16, "scalar"),       # swizzled V scales
    (TOY.name, "HND", 2, 64, 32, jnp.bfloat16, "scalar"),
    pytest.param("float16", "HND", 1, 128, 16, jnp.float32, None, marks=SLOW),
    pytest.param("fp8_e5m2", "HND", 2, 128, 32, jnp.bfloat16, "scalar", marks=SLOW),
    pytest.param("fp8_per_token_head", "HND", 8, 64, 16, jnp.float16, None, marks=SLOW),
    pytest.param("int4_per_token_head", "NHD", 8, 128, 16, jnp.bfloat16, None, marks=SLOW),
    pytest.param("nvfp4", "HND", 1, 80, 16, jnp.float16, "scalar", marks=SLOW),  # S = 5
]


def _id(c):
  c = getattr(c, "values", c)
  return f"{c[0]}-{c[1]}-H{c[2]}-D{c[3]}"


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("cd,layout,h,d,n,dtype,scales", CASES, ids=[_id(c) for c in CASES])
@pytest.mark.parametrize("impl", implementations("read"))
def test_read_equals_the_reference_bits(rng, impl, cd, layout, h, d, n, dtype, scales, request):
  if cd == TOY.name:
    request.getfixturevalue("toy_format")
  spec = KVCacheSpec(h, d, n, cd, layout, dtype)
  interpret = run_mode("read", impl, spec)
  ks = vs = None
  if scales == "scalar":
    ks, vs = jnp.float32(rng.uniform(0.05, 0.5)), jnp.float32(rng.uniform(0.05, 0.5))
  elif scales == "per_head":
    ks, vs = (jnp.asarray(rng.uniform(0.05, 0.5, h).astype(np.float32)) for _ in range(2))
  t = (NUM_BLOCKS - 1) * n                                   # the last page stays unwritten
  key, value = random_kv(rng, spec, t)
  slots = jnp.asarray(rng.permutation(t).astype(np.int32))
  cache = jit_reference_write(spec.allocate(NUM_BLOCKS), key, value, slots, spec, ks, vs)
  read = jax.jit(lambda c, s, a, b: kvjax.read_kv(c, spec, s, k_scale=a, v_scale=b, impl=impl,
                                                  interpret=interpret))
  some = jnp.asarray(rng.choice(NUM_BLOCKS * n, 5, replace=False).astype(np.int32))
  got = read(cache, some, ks, vs)
  if impl == "reference":      # jit against eager: the same bits
    want = kvjax.read_kv(cache, spec, some, k_scale=ks, v_scale=vs, impl="reference")
  else:                        # (jitted: eager runs cost seconds per format)
    want = jit_reference_read(cache, spec, some, ks, vs)
  for g, w in zip(got, want):
    assert g.shape == w.shape == (5, h, d) and g.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(g), _bits(w))
  # pages through the registry's read entry (values as stored), leading page dims kept
  pages = cache.reshape((2, NUM_BLOCKS // 2) + cache.shape[1:])
  run = registry.READ.choose(impl, interpret, spec)
  for g, w in zip(run(pages, spec, k_scale=ks, v_scale=vs),
                  jax.jit(kvjax.views.dequantize_stored)(pages, spec, ks, vs)):
    assert g.shape == (2, NUM_BLOCKS // 2, n, h, d)
    np.testing.assert_array_equal(_bits(g), _bits(w))
