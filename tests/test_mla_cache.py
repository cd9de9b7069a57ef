"""MLA latent caches through ``kvjax.write_kv`` / ``kvjax.read_kv``: vLLM's
``concat_and_cache_mla`` (rows ``[kv_c | k_pe]`` by slot mapping) on a ``(B, N, D_latent)``
cache of the model dtype."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax

BITS = {np.dtype(jnp.bfloat16): np.uint16, np.dtype(np.float16): np.uint16,
        np.dtype(np.float32): np.uint32}


def _poisoned(spec, num_blocks, rng):
  """A cache of random bits, NaN payloads included: a stray or missing write shows."""
  bits = BITS[spec.dtype]
  raw = rng.integers(0, np.iinfo(bits).max, spec.physical_shape(num_blocks), dtype=np.uint64)
  return jax.lax.bitcast_convert_type(jnp.asarray(raw.astype(bits)), spec.dtype)


def _bits(x):
  return np.asarray(x).view(BITS[np.dtype(x.dtype)])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_write_is_concat_and_cache_mla(dtype):
  rng = np.random.default_rng(0)
  spec = kvjax.MLACacheSpec(latent_dim=576, block_size=16, dtype=dtype)
  cache = _poisoned(spec, 4, rng)
  before = _bits(cache)
  kv_c = jnp.asarray(rng.standard_normal((6, 512)), dtype)
  k_pe = jnp.asarray(rng.standard_normal((6, 64)), dtype)
  slots = np.array([0, 17, -1, 63, 40, 5])                     # a negative slot writes nothing
  write = jax.jit(kvjax.write_kv, donate_argnums=0)
  out = write(cache, kv_c, k_pe, jnp.asarray(slots, jnp.int32), spec)
  assert out.shape == (4, 16, 576) and out.dtype == spec.dtype
  want = before.copy()
  rows = np.concatenate([_bits(kv_c), _bits(k_pe)], axis=-1)
  for i, s in enumerate(slots):
    if s >= 0:
      want[s // 16, s % 16] = rows[i]
  np.testing.assert_array_equal(_bits(out), want)              # every other bit kept
  back = kvjax.read_kv(out, spec, [17, 40])
  assert back.shape == (2, 576) and back.dtype == jnp.float32
  np.testing.assert_array_equal(back, np.asarray(jnp.concatenate(
      [kv_c, k_pe], -1)[jnp.array([1, 4])].astype(jnp.float32)))


def test_whole_latent_rows_and_padding_tokens():
  spec = kvjax.MLACacheSpec(latent_dim=32, block_size=16, dtype=jnp.float32)
  rows = jnp.arange(3 * 32, dtype=jnp.float32).reshape(3, 32)   # 3 rows, 2 slots: padding
  cache = kvjax.write_kv(spec.allocate(2), rows, None, [31, 0], spec)
  np.testing.assert_array_equal(cache[1, 15], rows[0])
  np.testing.assert_array_equal(cache[0, 0], rows[1])
  assert float(jnp.abs(cache).sum()) == float(rows[:2].sum())


def test_traced_slots_outside_the_cache_are_dropped():
  spec = kvjax.MLACacheSpec(latent_dim=32, block_size=16, dtype=jnp.float32)
  cache = spec.allocate(2, fill=7.0)
  rows = jnp.ones((3, 32), jnp.float32)
  write = jax.jit(lambda c, s: kvjax.write_kv(c, rows, None, s, spec))
  for slots in ([32, 2**31 - 1, 1], np.array([32, 2**32 + 1, 1], np.int64)):
    out = write(cache, jnp.asarray(slots) if isinstance(slots, list) else slots)
    assert float(out[0, 1, 0]) == 1.0
    assert float(jnp.sum(out != 7.0)) == 32                    # row 1 only; nothing wrapped
  read = jax.jit(lambda c, s: kvjax.read_kv(c, spec, s))
  got = read(out, jnp.array([1, 99], jnp.int32))
  assert float(got[0, 0]) == 1.0 and bool(jnp.isnan(got[1]).all())


def test_one_program_for_every_step():
  spec = kvjax.MLACacheSpec(latent_dim=64, block_size=16)
  write = jax.jit(lambda c, k, v, s: kvjax.write_kv(c, k, v, s, spec), donate_argnums=0)
  cache = spec.allocate(4)
  kv_c, k_pe = jnp.ones((2, 48), jnp.bfloat16), jnp.ones((2, 16), jnp.bfloat16)
  for step in range(3):
    cache = write(cache, kv_c, k_pe, jnp.array([2 * step, 2 * step + 1]))
  assert write._cache_size() == 1
  assert float(cache[0, :6].astype(jnp.float32).sum()) == 6 * 64


@pytest.mark.parametrize("call,error,match", [
    (lambda c, s: kvjax.write_kv(c, jnp.ones((1, 500), jnp.bfloat16),
                                 jnp.ones((1, 64), jnp.bfloat16), [0], s),
     ValueError, r"500 \+ 64 = 564 must add up to the spec's latent_dim 576"),
    (lambda c, s: kvjax.write_kv(c, jnp.ones((1, 576), jnp.float32), None, [0], s),
     TypeError, "key dtype float32 is not the spec's dtype bfloat16"),
    (lambda c, s: kvjax.write_kv(c, jnp.ones((1, 1, 576), jnp.bfloat16), None, [0], s),
     ValueError, r"key must be 2-D \[T, D\]"),
    (lambda c, s: kvjax.write_kv(c, jnp.ones((1, 576), jnp.bfloat16), None, [0, 1], s),
     ValueError, r"key has 1 tokens, fewer than len\(slot_mapping\)=2"),
    (lambda c, s: kvjax.write_kv(c, jnp.ones((1, 576), jnp.bfloat16), None, [64], s),
     ValueError, r"slot_mapping\[0\] = 64 is past the cache"),
    (lambda c, s: kvjax.write_kv(c, jnp.ones((1, 576), jnp.bfloat16), None, [0], s,
                                 impl="pallas"),
     ValueError, "pure-jnp reference only"),
    (lambda c, s: kvjax.write_kv(c, jnp.ones((1, 576), jnp.bfloat16), None, [0], s, layer=0),
     ValueError, "no layered form"),
    (lambda c, s: kvjax.write_kv(c[:, :8], jnp.ones((1, 576), jnp.bfloat16), None, [0], s),
     ValueError, r"is not .*latent cache \(B, 16, 576\)"),
    (lambda c, s: kvjax.write_kv(np.asarray(c), jnp.ones((1, 576), jnp.bfloat16), None, [0], s),
     TypeError, "wrap it once with jnp.asarray"),
    (lambda c, s: kvjax.read_kv(c, s, [-1]), ValueError, "slots must be non-negative"),
])
def test_bad_input_is_named(call, error, match):
  spec = kvjax.MLACacheSpec(latent_dim=576, block_size=16)
  with pytest.raises(error, match=match):
    call(spec.allocate(4), spec)
