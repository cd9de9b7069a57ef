"""A donated write touches no byte outside the rows it names: not in the cache, not in the
buffers allocated next to it in device memory (where a wrapped or unchecked store would land).

Interpret mode on CPU; compiled on a GPU with ``KVJAX_TEST_COMPILED=1`` (tests/compiled_groups.py,
group "write"), where the neighbours are real device allocations around the cache.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from op_suite import implementations, run_mode

SLOW = pytest.mark.slow
B, H, D, N = 4, 2, 32, 16
VALID = 3                                   # block 0, token 3
#: Slots outside [0, B*N): just past the end, slot * H wrapping int32, int32's ends, negative.
BAD = [B * N, B * N + 5, 2**30 + 5, 2**31 - 1, -1, -(2**31)]


def _bytes(x):
  return np.asarray(jax.device_get(x)).view(np.uint8).copy()


@pytest.mark.parametrize("cache_dtype,layout", [
    ("bfloat16", "NHD"), ("nvfp4", "HND"),
    pytest.param("bfloat16", "HND", marks=SLOW), pytest.param("float32", "NHD", marks=SLOW),
    pytest.param("fp8", "NHD", marks=SLOW),
    pytest.param("int8_per_token_head", "NHD", marks=SLOW),
    pytest.param("fp8_per_token_head", "HND", marks=SLOW),
    pytest.param("int4_per_token_head", "NHD", marks=SLOW)])
@pytest.mark.parametrize("impl", implementations("write", but=("reference",)))
def test_donated_write_stays_inside_its_rows(rng, impl, cache_dtype, layout):
  """Eight random buffers before the cache and eight after it; a donated jitted write of
  invalid slots only leaves the cache bit-identical, one of invalid slots around one valid
  slot changes only that row (nvfp4: that block, its scales are spread through the page), and
  no neighbour changes."""
  spec = kvjax.KVCacheSpec(H, D, N, cache_dtype, layout)
  interpret = run_mode("write", impl, spec)
  shape = spec.physical_shape(B)
  nbytes = int(np.prod(shape)) * spec.itemsize
  random_buffer = lambda: jnp.asarray(rng.integers(0, 256, nbytes, dtype=np.uint8))
  before = [random_buffer() for _ in range(8)]
  raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
  cache = jax.lax.bitcast_convert_type(
      jnp.asarray(raw.reshape(shape + ((spec.itemsize,) if spec.itemsize > 1 else ()))),
      spec.storage_dtype)
  after = [random_buffer() for _ in range(8)]
  jax.block_until_ready((before, cache, after))
  neighbours = [_bytes(x) for x in before + after]
  original = _bytes(cache)
  k, v = (jnp.asarray(rng.standard_normal((len(BAD) + 1, H, D)), spec.dtype) for _ in range(2))
  ks = 1.0 if spec.codec.has_tensor_scales else None
  write = jax.jit(lambda c, s: kvjax.write_kv(c, k, v, s, spec, k_scale=ks, v_scale=ks,
                                              impl=impl, interpret=interpret),
                  donate_argnums=0)
  cache = write(cache, jnp.asarray(BAD + [-1], jnp.int32))
  np.testing.assert_array_equal(_bytes(cache), original, err_msg="invalid slots wrote")
  cache = write(cache, jnp.asarray(BAD[:3] + [VALID] + BAD[3:], jnp.int32))
  changed = (_bytes(cache) != original).reshape(shape + (-1,))
  allowed = np.zeros(changed.shape, bool)
  if cache_dtype == "nvfp4":
    allowed[0] = True
  elif layout == "NHD":
    allowed[0, VALID] = True
  else:
    allowed[0, :, VALID] = True
  assert not np.any(changed & ~allowed), "bytes changed outside the valid row"
  assert np.any(changed & allowed), "the valid slot was not written"
  for i, (buf, old) in enumerate(zip(before + after, neighbours)):
    np.testing.assert_array_equal(_bytes(buf), old, err_msg=f"neighbour buffer {i} changed")
