"""write_kv / read_kv through the reference path: round trips, untouched bytes, jit, errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

import kvjax
from kvjax import KVCacheSpec
from kvjax.formats import CACHE_FORMATS
from pallas_kernels.common import next_pow2
from kv_testing import (ALL_CACHE_DTYPES, as_bytes, assert_roundtrip, jit_write, poisoned_cache,
                        random_kv, random_slots, spec_for)

NUM_BLOCKS = 6


def _scales(spec, rng):
  if not spec.format.has_tensor_scales:
    return None, None
  return (jnp.float32(rng.uniform(0.05, 0.5)), jnp.float32(rng.uniform(0.05, 0.5)))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES)
def test_roundtrip_and_untouched_bytes(rng, cache_dtype, layout):
  if cache_dtype == "nvfp4" and layout == "NHD":
    with pytest.raises(ValueError, match="layout='HND', got layout='NHD'"):
      KVCacheSpec(3, 64, 16, cache_dtype="nvfp4", layout="NHD")
    return
  spec = spec_for(cache_dtype, layout, num_kv_heads=3, head_size=64)
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  before = as_bytes(cache).copy()
  t = 21
  slots = random_slots(rng, spec, NUM_BLOCKS, t, pad=3)
  key, value = random_kv(rng, spec, t + 5)            # longer than slot_mapping: tail ignored
  ks, vs = _scales(spec, rng)
  out = kvjax.write_kv(cache, key, value, slots, spec, k_scale=ks, v_scale=vs)
  assert out.shape == cache.shape and out.dtype == cache.dtype
  k, v = kvjax.read_kv(out, spec, slots[:t], k_scale=ks, v_scale=vs)
  assert_roundtrip(spec, key[:t], k, ks)
  assert_roundtrip(spec, value[:t], v, vs)
  # every page not named by a slot is bit-identical
  after = as_bytes(out)
  named = np.unique(np.asarray(slots[:t]) // spec.block_size)
  untouched = np.setdiff1d(np.arange(NUM_BLOCKS), named)
  np.testing.assert_array_equal(after[untouched], before[untouched])
  assert not np.array_equal(after[named], before[named])
  if spec.format.kind != "nvfp4":   # row granularity: unnamed (token, head) rows keep their bytes
    rows_after = np.asarray(kvjax.token_major(jnp.asarray(after), spec))
    rows_before = np.asarray(kvjax.token_major(jnp.asarray(before), spec))
    written = np.zeros((NUM_BLOCKS, spec.block_size), bool)
    s = np.asarray(slots[:t])
    written[s // spec.block_size, s % spec.block_size] = True
    np.testing.assert_array_equal(rows_after[~written], rows_before[~written])


def test_fp8_per_head_scales(rng):
  spec = spec_for("fp8", num_kv_heads=4)
  cache = spec.allocate(NUM_BLOCKS)
  key, value = random_kv(rng, spec, 10)
  slots = random_slots(rng, spec, NUM_BLOCKS, 10)
  ks = jnp.asarray(rng.uniform(0.05, 0.5, 4), jnp.float32)
  out = kvjax.write_kv(cache, key, value, slots, spec, k_scale=ks, v_scale=ks * 2)
  k, v = kvjax.read_kv(out, spec, slots, k_scale=ks, v_scale=ks * 2)
  assert_roundtrip(spec, key, k, ks)
  assert_roundtrip(spec, value, v, ks * 2)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8_per_token_head", "nvfp4"])
def test_jit_with_donation(rng, cache_dtype):
  spec = spec_for(cache_dtype, "HND", num_kv_heads=2, head_size=64)
  write = jit_write()
  cache = spec.allocate(NUM_BLOCKS)
  for step in range(3):
    key, value = random_kv(rng, spec, 8)
    slots = random_slots(rng, spec, NUM_BLOCKS, 8)
    old = cache
    cache = write(cache, key, value, slots, spec)
    assert old.is_deleted(), "the donated cache buffer should be consumed"
    k, v = kvjax.read_kv(cache, spec, slots)
    assert_roundtrip(spec, key, k)
    assert_roundtrip(spec, value, v)


def test_negative_slots_write_nothing(rng):
  spec = spec_for("bfloat16")
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  key, value = random_kv(rng, spec, 4)
  out = kvjax.write_kv(cache, key, value, jnp.asarray([-1, -1, -5, -1], jnp.int32), spec)
  np.testing.assert_array_equal(as_bytes(out), as_bytes(cache))


def test_read_rejects_and_write_rejects(rng):
  spec = spec_for("int8_per_token_head")
  cache = spec.allocate(NUM_BLOCKS)
  key, value = random_kv(rng, spec, 4)
  slots = jnp.arange(4, dtype=jnp.int32)
  cases = [
      (dict(slot_mapping=jnp.asarray([0, 1, 2, NUM_BLOCKS * 16], jnp.int32)), ValueError, "slot"),
      (dict(slot_mapping=jnp.zeros((2, 2), jnp.int32)), ValueError, "slot_mapping"),
      (dict(slot_mapping=jnp.zeros(4, jnp.float32)), TypeError, "integer"),
      (dict(key=key[:, :1]), ValueError, "key"),
      (dict(value=value.astype(jnp.float32)), TypeError, "value dtype"),
      (dict(key=key[:2]), ValueError, "fewer"),
      (dict(cache=cache[:, :, :, :-1]), ValueError, "physical shape"),
      (dict(cache=cache.astype(jnp.uint8)), TypeError, "dtype"),
      (dict(impl="cuda"), ValueError, "impl"),
  ]
  for override, err, match in cases:
    args = dict(cache=cache, key=key, value=value, slot_mapping=slots, spec=spec)
    args.update(override)
    with pytest.raises(err, match=match):
      kvjax.write_kv(**args)
  with pytest.raises(ValueError, match="non-negative"):
    kvjax.read_kv(cache, spec, jnp.asarray([-1], jnp.int32))
  fp8 = spec_for("fp8", num_kv_heads=2)
  with pytest.raises(ValueError, match="k_scale"):
    kvjax.write_kv(fp8.allocate(2), key, value, slots, fp8, k_scale=jnp.ones(3))
  with pytest.raises(ValueError, match="positive"):
    kvjax.write_kv(fp8.allocate(2), key, value, slots, fp8, k_scale=-1.0)


_PROPERTY_STRATEGIES = dict(
    cache_dtype=st.sampled_from(ALL_CACHE_DTYPES),
    layout=st.sampled_from(["NHD", "HND"]),
    num_kv_heads=st.integers(1, 4),
    head_mult=st.integers(1, 4),
    block_size=st.sampled_from([16, 32]),
    num_blocks=st.integers(1, 5),
    data=st.data(),
)


def _accepts_head_size(cache_dtype, head_size) -> bool:
  try:
    CACHE_FORMATS[cache_dtype].codec.check_head_size(head_size)
    return True
  except ValueError:
    return False


def _write_read_property(cache_dtype, layout, num_kv_heads, head_mult, block_size, num_blocks,
                         data):
  """Random spec, slots (padding anywhere) and poisoned cache: eager write, read back within
  the format's bound, unnamed pages bit-identical. Every example compiles its eager ops anew
  (new shapes): about 1.5 s of CPU each."""
  head_size = 16 * head_mult
  if not _accepts_head_size(cache_dtype, head_size):   # e.g. int4 (Hadamard): powers of two
    head_size = 16 * next_pow2(head_mult)
  spec = spec_for(cache_dtype, layout, num_kv_heads=num_kv_heads, head_size=head_size,
                  block_size=block_size)
  seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
  rng = np.random.default_rng(seed)
  t = data.draw(st.integers(0, min(num_blocks * block_size, 40)), label="tokens")
  pad = data.draw(st.integers(0, 3), label="pad")
  slots = random_slots(rng, spec, num_blocks, t, pad)
  perm = rng.permutation(t + pad)                     # padding anywhere, not only at the end
  slots = slots[perm]
  cache = poisoned_cache(rng, spec, num_blocks)
  key, value = random_kv(rng, spec, t + pad)
  out = kvjax.write_kv(cache, key, value, slots, spec)
  real = np.asarray(slots) >= 0
  k, v = kvjax.read_kv(out, spec, slots[real])
  assert_roundtrip(spec, key[real], k)
  assert_roundtrip(spec, value[real], v)
  named = np.unique(np.asarray(slots)[real] // block_size)
  untouched = np.setdiff1d(np.arange(num_blocks), named)
  np.testing.assert_array_equal(as_bytes(out)[untouched], as_bytes(cache)[untouched])


_PROPERTY = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

test_property_write_read = settings(max_examples=6, **_PROPERTY)(
    given(**_PROPERTY_STRATEGIES)(_write_read_property))
test_property_write_read_long = pytest.mark.slow(settings(max_examples=40, **_PROPERTY)(
    given(**_PROPERTY_STRATEGIES)(_write_read_property)))


def test_views_match_spec_geometry(rng):
  """The functional views read exactly the elements the strided geometry names."""
  spec = spec_for("int8_per_token_head", "NHD", num_kv_heads=2, head_size=32)
  cache = poisoned_cache(rng, spec, 3)
  flat = np.asarray(cache).reshape(-1)
  k_geo, v_geo = spec.kv_view_geometry(3)
  k, v = kvjax.kv_views(cache, spec)
  for geo, view in ((k_geo, k), (v_geo, v)):
    strided = np.lib.stride_tricks.as_strided(
        flat[geo.offset:], geo.shape, [s * flat.itemsize for s in geo.strides])
    np.testing.assert_array_equal(strided[..., :spec.data_dim], np.asarray(view))
  ks_geo, vs_geo = spec.scale_view_geometry(3)
  f32 = flat.view(np.float32)
  ks, vs = kvjax.kv_scale_views(cache, spec)
  for geo, view in ((ks_geo, ks), (vs_geo, vs)):
    strided = np.lib.stride_tricks.as_strided(f32[geo.offset:], geo.shape,
                                              [s * 4 for s in geo.strides])
    np.testing.assert_array_equal(strided.view(np.uint32), np.asarray(view).view(np.uint32))


def test_nvfp4_split_view_matches_geometry(rng):
  spec = spec_for("nvfp4", num_kv_heads=2, head_size=64)
  cache = poisoned_cache(rng, spec, 3)
  flat = np.asarray(cache).reshape(-1)
  for side_name, side in zip("kv", kvjax.nvfp4_sides(cache, spec)):
    data, scale = kvjax.nvfp4_split_data_scale(side)
    d_geo, s_geo = spec.nvfp4_split_geometry(3, side_name)
    for geo, view in ((d_geo, data), (s_geo, scale)):
      strided = np.lib.stride_tricks.as_strided(flat[geo.offset:], geo.shape, geo.strides)
      np.testing.assert_array_equal(strided, np.asarray(view).view(np.uint8))


def test_closed_over_concrete_arguments_under_jit(rng):
  """Concrete scales and slots closed over by a jitted function are checked, not traced."""
  spec = spec_for("fp8", num_kv_heads=2)
  key, value = random_kv(rng, spec, 4)
  slots = random_slots(rng, spec, 2, 4)
  out = jax.jit(lambda c: kvjax.write_kv(c, key, value, slots, spec, k_scale=jnp.float32(.5),
                                         v_scale=jnp.float32(.25)))(spec.allocate(2))
  k, v = kvjax.read_kv(out, spec, slots, k_scale=0.5, v_scale=0.25)
  assert_roundtrip(spec, key, k, 0.5)
  bad = jnp.asarray([0, 1, 2, 999], jnp.int32)
  with pytest.raises(ValueError, match="slot"):
    jax.jit(lambda c: kvjax.write_kv(c, key, value, bad, spec))(spec.allocate(2))


@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES)
def test_empty_write_and_read(rng, cache_dtype):
  """No tokens: the cache comes back bit-identical and reads are empty."""
  spec = spec_for(cache_dtype, num_kv_heads=2, head_size=16)
  cache = poisoned_cache(rng, spec, 2)
  key, value = random_kv(rng, spec, 3)
  none = jnp.zeros((0,), jnp.int32)
  out = kvjax.write_kv(cache, key, value, none, spec)
  np.testing.assert_array_equal(as_bytes(out), as_bytes(cache))
  k, v = kvjax.read_kv(out, spec, none)
  assert k.shape == v.shape == (0, 2, 16)


def test_wide_integer_slots_are_compared_before_narrowing():
  """kvjax.slots.int32_slots (used by every writer): int64 / uint slots outside the cache
  become -1 before the int32 cast, so 2**32 + 7 and -(2**32) + 5 never wrap to 7 and 5."""
  from kvjax.slots import int32_slots
  s64 = np.asarray([3, 2**32 + 7, -(2**32) + 5, 17, 2**31 + 1], np.int64)
  np.testing.assert_array_equal(np.asarray(int32_slots(s64, 64)), [3, -1, -1, 17, -1])
  u32 = np.asarray([5, 2**31 + 5, 63, 64], np.uint32)
  np.testing.assert_array_equal(np.asarray(int32_slots(u32, 64)), [5, -1, 63, -1])
  i32 = jnp.asarray([5, -1, 2**31 - 1], jnp.int32)       # passed through: kernels bound-check
  assert int32_slots(i32, 64).dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(int32_slots(i32, 64)), [5, -1, 2**31 - 1])
