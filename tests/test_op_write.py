"""The write case suite: every case on every implementation of kvjax.write_kv.

Implementations come from ``kvjax.registry.WRITE`` (see op_suite.py for how they run). Each
case writes random K/V (rows of magnitudes over decades, padding slots mixed in, more tokens
than slots) into a poisoned cache, under jit, and checks: the bytes equal the reference's
(in interpret mode; compiled kernels: the documented rounding-boundary exceptions), every
byte not named by a slot keeps its bits, and the rows read back within the format's bound.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import KVCacheSpec, quant, registry
from kv_testing import (as_bytes, assert_roundtrip, assert_written_as_reference,
                        nonfinite_spread, poisoned_cache, random_kv)
from op_suite import exact_bytes, implementations, run_mode, toy_format  # noqa: F401
from toy_format import TOY

NUM_BLOCKS = 5

SLOW = pytest.mark.slow

# (cache_dtype, layout, H, D, N, model dtype, explicit / per-head scales)
CASES = [
    ("auto", "NHD", 2, 64, 16, jnp.bfloat16, False),
    ("auto", "HND", 3, 64, 32, jnp.float16, False),            # H not a power of 2
    ("fp8_e4m3", "HND", 8, 64, 16, jnp.bfloat16, True),        # [H] scales
    ("int8_per_token_head", "HND", 2, 80, 32, jnp.bfloat16, False),   # D = 80
    ("int4_per_token_head", "NHD", 1, 16, 16, jnp.float32, False),    # D/2 = 8: padded
    ("nvfp4", "HND", 2, 64, 16, jnp.bfloat16, False),          # S = 4: swizzled V scales
    (TOY.name, "NHD", 3, 64, 16, jnp.bfloat16, True),
    pytest.param("float32", "HND", 8, 64, 32, jnp.bfloat16, False, marks=SLOW),
    pytest.param("fp8_per_token_head", "NHD", 2, 64, 16, jnp.float16, False, marks=SLOW),
    pytest.param("nvfp4", "HND", 2, 80, 16, jnp.bfloat16, True, marks=SLOW),  # S = 5: linear
    pytest.param("auto", "HND", 8, 128, 32, jnp.bfloat16, False, marks=SLOW),
    pytest.param("float16", "NHD", 1, 128, 16, jnp.float32, False, marks=SLOW),
    pytest.param("fp8", "NHD", 2, 128, 16, jnp.bfloat16, False, marks=SLOW),  # unit scales
    pytest.param("fp8_e5m2", "NHD", 1, 64, 32, jnp.float32, True, marks=SLOW),
    pytest.param("int8_per_token_head", "NHD", 8, 128, 16, jnp.bfloat16, False, marks=SLOW),
    pytest.param("int4_per_token_head", "HND", 8, 64, 32, jnp.bfloat16, False, marks=SLOW),
    pytest.param("nvfp4", "HND", 8, 128, 32, jnp.bfloat16, True, marks=SLOW),  # S = 8
]


def _id(c):
  c = getattr(c, "values", c)                # a pytest.param or a plain tuple
  return f"{c[0]}-{c[1]}-H{c[2]}-D{c[3]}-N{c[4]}"


def _scales(rng, spec, explicit):
  codec = spec.codec
  if not (explicit and codec.has_tensor_scales):
    return None, None
  if codec.per_head_tensor_scales:
    return tuple(jnp.asarray(rng.uniform(0.05, 0.5, spec.num_kv_heads).astype(np.float32))
                 for _ in range(2))
  return jnp.float32(rng.uniform(0.05, 0.5)), jnp.float32(rng.uniform(0.05, 0.5))


def _writer(name, interpret, spec):
  """The registered implementation, jitted with the cache donated (in place)."""
  run = registry.WRITE.choose(name, interpret, spec)
  return jax.jit(functools.partial(run, spec=spec), donate_argnums=0)


def _slots(rng, spec, t, pad):
  s = rng.choice(NUM_BLOCKS * spec.block_size, t, replace=False)
  return jnp.asarray(rng.permutation(np.concatenate([s, -np.ones(pad, np.int64)])).astype(
      np.int32))


@pytest.mark.parametrize("cd,layout,h,d,n,dtype,explicit", CASES, ids=[_id(c) for c in CASES])
@pytest.mark.parametrize("impl", implementations("write"))
def test_write_bytes_roundtrip_and_untouched_rows(rng, impl, cd, layout, h, d, n, dtype, explicit,
                                                 request):
  if cd == TOY.name:
    request.getfixturevalue("toy_format")
  spec = KVCacheSpec(h, d, n, cd, layout, dtype)
  interpret = run_mode("write", impl, spec)
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  before = as_bytes(cache).copy()
  t = int(rng.integers(7, 2 * n + 3))
  slots = _slots(rng, spec, t, pad=3)
  key, value = random_kv(rng, spec, t + 3 + 4)               # more tokens than slots
  ks, vs = _scales(rng, spec, explicit)
  rot = spec.codec.rotation               # what kvjax.write_kv hands every implementation
  stored_key, stored_value = rot.rotate(key), rot.rotate(value)
  want = as_bytes(jax.jit(kvjax.reference.write_kv, static_argnums=4)(
      cache, stored_key, stored_value, slots, spec, ks, vs))
  out = _writer(impl, interpret, spec)(jnp.asarray(before.view(spec.storage_dtype).reshape(
      cache.shape)), stored_key, stored_value, slots, k_scale=ks, v_scale=vs)
  got = as_bytes(out)
  if exact_bytes(impl, interpret):
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} bytes differ from the reference, first {bad[:3].tolist()}"
  real = np.asarray(slots) >= 0
  named = np.unique(np.asarray(slots)[real] // n)
  unnamed = np.setdiff1d(np.arange(NUM_BLOCKS), named)
  np.testing.assert_array_equal(got[unnamed], before[unnamed])
  assert not np.array_equal(got[named], before[named])
  if spec.codec.content_halves:      # row granularity: unnamed (token, head) rows keep bytes
    rows_after = np.asarray(kvjax.token_major(jnp.asarray(got), spec))
    rows_before = np.asarray(kvjax.token_major(jnp.asarray(before), spec))
    written = np.zeros((NUM_BLOCKS, n), bool)
    s = np.asarray(slots)[real]
    written[s // n, s % n] = True
    np.testing.assert_array_equal(rows_after[~written], rows_before[~written])
  k, v = kvjax.read_kv(out, spec, slots[real], k_scale=ks, v_scale=vs, impl="reference")
  for x, back, gs in ((key, k, ks), (value, v, vs)):
    x = x[:t + 3][real]
    if cd == TOY.name:       # bf16 rounding of x / s, scaled back
      x = np.asarray(x, np.float32)
      assert np.all(np.abs(np.asarray(back) - x) <= np.abs(x) * 2.0 ** -8 + 1e-30)
    else:
      assert_roundtrip(spec, x, back, gs)


@pytest.mark.parametrize("cache_dtype,layout,heads", [
    ("auto", "NHD", 4), ("nvfp4", "HND", 4),
    pytest.param("auto", "HND", 2, marks=SLOW),
    pytest.param("int8_per_token_head", "NHD", 2, marks=SLOW)])
@pytest.mark.parametrize("impl", implementations("write"))
def test_slots_outside_the_cache_write_nothing_under_jit(rng, impl, cache_dtype, layout, heads):
  """Slots >= B*N (just past the end, 2**30+5 whose slot*H wraps int32, 2**31-1) and negative
  slots store nothing, traced under jit: the result equals writing the valid slots alone."""
  spec = KVCacheSpec(heads, 64, 16, cache_dtype, layout)
  interpret = run_mode("write", impl, spec)
  b = 4
  cache = poisoned_cache(rng, spec, b)
  valid = rng.choice(b * 16, 5, replace=False)
  bad = [b * 16, b * 16 + 5, 2**30 + 5, 2**31 - 1, -1, -(2**31)]
  slots = jnp.asarray(rng.permutation(np.concatenate([valid, bad])).astype(np.int32))
  key, value = random_kv(rng, spec, slots.shape[0])
  keep = (np.asarray(slots) >= 0) & (np.asarray(slots) < b * 16)
  want = kvjax.reference.write_kv(cache, key[keep], value[keep], slots[keep], spec)
  got = jax.jit(lambda c, k, v, s: kvjax.write_kv(
      c, k, v, s, spec, impl=impl, interpret=interpret))(cache, key, value, slots)
  assert_written_as_reference(got, want, spec, slots[keep])


@pytest.mark.parametrize("cache_dtype", ["auto", "float16", "fp8", "fp8_e5m2",
                                         "int8_per_token_head", "fp8_per_token_head",
                                         "int4_per_token_head", "nvfp4"])
@pytest.mark.parametrize("impl", implementations("write"))
def test_nan_and_inf_spread_as_far_as_the_scale(rng, impl, cache_dtype):
  """One NaN and one +Inf in K (different tokens and heads): what reads back non-finite is the
  element, the (token, head) row or the 16-value group docs/edges.md names, on every
  implementation; the other head of each token stays finite."""
  h, d, t = 2, 64, 4
  spec = KVCacheSpec(h, d, 16, cache_dtype, "HND" if cache_dtype == "nvfp4" else "NHD",
                     jnp.float32)
  interpret = run_mode("write", impl, spec)
  x = rng.standard_normal((t, h, d)).astype(np.float32)
  col = 19
  x[0, 0, col], x[1, 1, col] = np.nan, np.inf
  ks = jnp.float32(1.0) if spec.codec.has_tensor_scales else None
  slots = jnp.asarray(rng.choice(NUM_BLOCKS * 16, t, replace=False).astype(np.int32))
  cache = jax.jit(lambda c, k, s: kvjax.write_kv(c, k, k, s, spec, k_scale=ks, v_scale=ks,
                                                 impl=impl, interpret=interpret))(
      spec.allocate(NUM_BLOCKS), jnp.asarray(x), slots)
  k = np.asarray(kvjax.read_kv(cache, spec, slots, k_scale=ks, v_scale=ks,
                               impl="reference")[0])
  bad = ~np.isfinite(k)
  nan_to, inf_to = nonfinite_spread(cache_dtype, d, col)
  assert set(np.flatnonzero(bad[0, 0])) == nan_to
  assert set(np.flatnonzero(bad[1, 1])) == inf_to
  assert not bad[0, 1].any() and not bad[1, 0].any() and not bad[2:].any()
  if cache_dtype in ("fp8", "fp8_e5m2"):
    assert k[1, 1, col] == float(jnp.finfo(spec.storage_dtype).max)


# A NaN with a payload for every float storage dtype (bits).
_NAN_PAYLOADS = {"auto": 0x7FC1, "float16": 0x7E01, "float32": 0x7FC00001,
                 "fp8_e5m2": 0xFD, "fp8_e4m3": 0x7F}


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("cache_dtype", [
    "auto", "fp8_e5m2",                      # the two XLA:CPU rewrites
    *(pytest.param(c, marks=SLOW) for c in ("float16", "float32", "fp8_e4m3"))])
@pytest.mark.parametrize("impl", implementations("write"))
def test_untouched_nan_payloads_keep_their_bits(rng, impl, cache_dtype, jitted):
  """XLA on CPU scatters bf16 / fp8_e5m2 through float32 and rewrites NaN payloads: writers
  move bits, so every byte not named by a slot keeps its bits (eager and jit, donated)."""
  spec = KVCacheSpec(2, 32, 16, cache_dtype, "NHD")
  interpret = run_mode("write", impl, spec)
  if interpret and not jitted:
    pytest.skip("eager and jitted are one path for a kernel (XLA scatters only in the reference)")
  bits = quant.bits_dtype(spec.storage_dtype)
  raw = np.full(spec.physical_shape(3), _NAN_PAYLOADS[cache_dtype], bits)
  slots = jnp.asarray([20, 5], jnp.int32)                   # rows of blocks 1 and 0
  key, value = random_kv(rng, spec, 2)
  run = functools.partial(registry.WRITE.choose(impl, interpret, spec), spec=spec)
  run = jax.jit(run, donate_argnums=0) if jitted else run
  got = np.asarray(run(jnp.asarray(raw.view(spec.storage_dtype)), key, value, slots)).view(bits)
  rows = got.reshape(3 * 16, -1)                             # NHD: (block * N + token, H*C)
  untouched = np.setdiff1d(np.arange(3 * 16), [20, 5])
  np.testing.assert_array_equal(rows[untouched], raw.reshape(3 * 16, -1)[untouched])
  assert not np.array_equal(rows[[20, 5]], raw.reshape(3 * 16, -1)[[20, 5]])


@pytest.mark.slow        # the fast tier has it in test_edges.py (reference and Pallas, eager and jit)
@pytest.mark.parametrize("impl", implementations("write"))
def test_int4_rows_at_the_rotation_limit_round_trip_finite(rng, impl):
  """Rows whose magnitudes sum to 2**126 (+-2e36 values at D = 64: the rotation adds D values,
  max - min of the rotated row must stay finite) read back finite."""
  spec = KVCacheSpec(2, 64, 16, "int4_per_token_head", "HND", jnp.float32)
  interpret = run_mode("write", impl, spec)
  x = rng.uniform(-1, 1, (4, 2, 64))
  x[:, :, 0], x[:, :, 1] = 1.0, -1.0
  x = x / np.abs(x).sum(-1, keepdims=True) * 2.0**126
  x[3] = rng.standard_normal((2, 64))                       # an ordinary row next to them
  key = value = jnp.asarray(x.astype(np.float32))
  slots = jnp.asarray([0, 17, 33, 2], jnp.int32)
  cache = kvjax.write_kv(spec.allocate(3), key, value, slots, spec, impl=impl,
                         interpret=interpret)
  if exact_bytes(impl, interpret):
    np.testing.assert_array_equal(as_bytes(cache), as_bytes(
        kvjax.write_kv(spec.allocate(3), key, value, slots, spec, impl="reference")))
  k, _ = kvjax.read_kv(cache, spec, slots)
  assert np.isfinite(np.asarray(k)).all()
  assert_roundtrip(spec, key, k)


@pytest.mark.parametrize("impl", implementations("write"))
def test_all_padding_and_empty_writes_change_nothing(rng, impl):
  spec = KVCacheSpec(2, 64, 16, "int8_per_token_head", "NHD")
  interpret = run_mode("write", impl, spec)
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  before = as_bytes(cache).copy()
  key, value = random_kv(rng, spec, 6)
  for slots in (jnp.full((6,), -1, jnp.int32), jnp.zeros((0,), jnp.int32)):
    out = kvjax.write_kv(cache, key, value, slots, spec, impl=impl, interpret=interpret)
    np.testing.assert_array_equal(as_bytes(out), before)
