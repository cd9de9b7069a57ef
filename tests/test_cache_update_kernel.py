"""The Pallas write kernel (interpret mode) stores the reference's bytes, touches nothing else.

Reference = ``kvjax.reference.cache_update.write_kv`` under ``jax.jit`` (see
``pallas_kernels.cache_update_math``: XLA rewrites divisions by literal constants under jit,
and the kernel follows the jitted form).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import KVCacheSpec, quant
from kvjax.reference import cache_update as ref
from kv_testing import as_bytes, assert_roundtrip, poisoned_cache, random_kv
from pallas_kernels.triton import write as cu
from pallas_kernels import common

NUM_BLOCKS = 5
_ref_write = jax.jit(ref.write_kv, static_argnums=4)


def _kernel_write(cache, key, value, slots, spec, ks=None, vs=None, config=None):
  return cu.write_kv(cache, key, value, slots, spec, k_scale=ks, v_scale=vs, interpret=True,
                     config=config)


def _scales(rng, spec, per_head):
  kind = spec.format.kind
  if kind == "fp8_per_tensor":
    if per_head:
      return tuple(jnp.asarray(rng.uniform(0.05, 0.5, spec.num_kv_heads).astype(np.float32))
                   for _ in range(2))
    return jnp.float32(rng.uniform(0.05, 0.5)), jnp.float32(rng.uniform(0.05, 0.5))
  if kind == "nvfp4" and per_head:
    return jnp.float32(rng.uniform(0.05, 0.5)), jnp.float32(rng.uniform(0.05, 0.5))
  return None, None


def _slots(rng, spec, t, pad):
  """Duplicate-free random slots with ``pad`` padding (-1) slots mixed in."""
  s = rng.choice(NUM_BLOCKS * spec.block_size, t, replace=False)
  s = np.concatenate([s, -np.ones(pad, np.int64)])
  return jnp.asarray(rng.permutation(s).astype(np.int32))


# (cache_dtype, layout, H, D, N, model dtype, per-head / explicit scales)
CASES = [
    ("auto", "NHD", 2, 64, 16, jnp.bfloat16, False),
    ("auto", "HND", 8, 128, 32, jnp.bfloat16, False),
    ("auto", "NHD", 3, 64, 16, jnp.float16, False),            # H not a power of 2
    ("float16", "NHD", 1, 128, 16, jnp.float32, False),
    ("bfloat16", "HND", 2, 64, 16, jnp.float16, False),
    ("float32", "NHD", 8, 64, 32, jnp.bfloat16, False),
    ("fp8", "NHD", 2, 128, 16, jnp.bfloat16, False),           # scalar scales
    ("fp8_e4m3", "HND", 8, 64, 16, jnp.bfloat16, True),        # [H] scales
    ("fp8_e5m2", "NHD", 1, 64, 32, jnp.float32, False),
    ("fp8_e5m2", "HND", 2, 128, 16, jnp.bfloat16, True),
    ("int8_per_token_head", "NHD", 8, 128, 16, jnp.bfloat16, False),
    ("int8_per_token_head", "HND", 2, 80, 32, jnp.bfloat16, False),   # D = 80
    ("fp8_per_token_head", "NHD", 2, 64, 16, jnp.float16, False),
    ("fp8_per_token_head", "HND", 8, 128, 32, jnp.bfloat16, False),
    ("int4_per_token_head", "NHD", 2, 128, 16, jnp.bfloat16, False),
    ("int4_per_token_head", "HND", 8, 64, 32, jnp.bfloat16, False),
    ("int4_per_token_head", "NHD", 1, 80, 16, jnp.float32, False),    # D = 80
    ("nvfp4", "HND", 2, 64, 16, jnp.bfloat16, False),          # S = 4: swizzled V scales
    ("nvfp4", "HND", 8, 128, 32, jnp.bfloat16, True),          # S = 8, global scales
    ("nvfp4", "HND", 1, 128, 16, jnp.float16, True),
    ("nvfp4", "HND", 2, 80, 16, jnp.bfloat16, True),           # S = 5: linear V scales
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-H{c[2]}-D{c[3]}-N{c[4]}")
def test_bytes_equal_reference_and_unnamed_pages_untouched(rng, case):
  cd, layout, h, d, n, dtype, explicit = case
  spec = KVCacheSpec(h, d, n, cd, layout, dtype)
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  before = as_bytes(cache).copy()
  t = int(rng.integers(7, 2 * n + 3))
  slots = _slots(rng, spec, t, pad=3)
  key, value = random_kv(rng, spec, t + 3 + 4)          # longer than slot_mapping
  ks, vs = _scales(rng, spec, explicit)
  want = as_bytes(_ref_write(cache, key, value, slots, spec, ks, vs))
  got = as_bytes(_kernel_write(cache, key, value, slots, spec, ks, vs))
  bad = np.argwhere(got != want)
  assert bad.size == 0, f"{len(bad)} bytes differ from the reference, first at {bad[:3].tolist()}"
  named = np.unique(np.asarray(slots)[np.asarray(slots) >= 0] // n)
  unnamed = np.setdiff1d(np.arange(NUM_BLOCKS), named)
  np.testing.assert_array_equal(got[unnamed], before[unnamed])
  assert not np.array_equal(got[named], before[named])


@pytest.mark.parametrize("cache_dtype", ["int4_per_token_head", "nvfp4"])
def test_launch_configs_store_the_same_bytes(rng, cache_dtype):
  """Several tokens a program (a partial last program), and the split pair loads."""
  spec = KVCacheSpec(2, 64, 16, cache_dtype, "HND")
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  t = 13
  slots = _slots(rng, spec, t, pad=2)
  key, value = random_kv(rng, spec, t + 2)
  want = as_bytes(_ref_write(cache, key, value, slots, spec, None, None))
  for config in (cu.WriteConfig(tokens_per_program=4),
                 cu.WriteConfig(tokens_per_program=2, pair_split=True)):
    got = as_bytes(_kernel_write(cache, key, value, slots, spec, config=config))
    np.testing.assert_array_equal(got, want, err_msg=str(config))


def test_all_slots_padding_and_empty_mapping_change_nothing(rng):
  spec = KVCacheSpec(2, 64, 16, "int8_per_token_head", "NHD")
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  before = as_bytes(cache).copy()
  key, value = random_kv(rng, spec, 6)
  out = _kernel_write(cache, key, value, jnp.full((6,), -1, jnp.int32), spec)
  np.testing.assert_array_equal(as_bytes(out), before)
  out = _kernel_write(cache, key, value, jnp.zeros((0,), jnp.int32), spec)
  np.testing.assert_array_equal(as_bytes(out), before)


@pytest.mark.parametrize("cache_dtype,layout", [("int4_per_token_head", "NHD"), ("nvfp4", "HND")])
def test_jit_donated_write_round_trips(rng, cache_dtype, layout):
  """Through kvjax.write_kv(impl="pallas") under jit with the cache donated, read back."""
  spec = KVCacheSpec(2, 64, 16, cache_dtype, layout)
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  t = 20
  slots = _slots(rng, spec, t, pad=0)
  key, value = random_kv(rng, spec, t)
  ks, vs = _scales(rng, spec, True)
  if ks is not None and ks.ndim:                  # fp8 [H] scales
    ks, vs = ks[0], vs[0]
  want = as_bytes(_ref_write(cache, key, value, slots, spec, ks, vs))

  def step(cache, key, value, slots, ks, vs):
    return kvjax.write_kv(cache, key, value, slots, spec, k_scale=ks, v_scale=vs,
                          impl="pallas", interpret=True)

  out = jax.jit(step, donate_argnums=0)(cache, key, value, slots, ks, vs)
  assert cache.is_deleted()                        # the donated buffer was consumed
  np.testing.assert_array_equal(as_bytes(out), want)
  k, v = kvjax.read_kv(out, spec, slots, k_scale=ks, v_scale=vs)
  assert_roundtrip(spec, key, k, ks)
  assert_roundtrip(spec, value, v, vs)


def test_donated_write_is_in_place():
  """Donated, the output aliases the cache (CPU, interpret mode); the CUDA lowering hands the
  cache buffer itself to the kernel (aliased, no bits view or copy of it in between)."""
  from jax import export
  spec = KVCacheSpec(8, 128, 16, "auto", "NHD")
  c = jax.ShapeDtypeStruct(spec.physical_shape(32), spec.storage_dtype)
  kv = jax.ShapeDtypeStruct((40, 8, 128), spec.dtype)
  s = jax.ShapeDtypeStruct((40,), jnp.int32)
  nbytes = int(np.prod(c.shape)) * 2
  f = lambda c, k, v, s: cu.write_kv(c, k, v, s, spec, interpret=True)
  for donate, alias in (((0,), nbytes), ((), 0)):
    mem = jax.jit(f, donate_argnums=donate).lower(c, kv, kv, s).compile().memory_analysis()
    assert mem.alias_size_in_bytes == alias
  g = jax.jit(lambda c, k, v, s: cu.write_kv(c, k, v, s, spec), donate_argnums=0)
  allow = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  text = export.export(g, platforms=["cuda"], disabled_checks=allow)(c, kv, kv, s).mlir_module()
  assert "output_operand_aliases" in text and "tf.aliasing_output = 0" in text
  assert "bitcast_convert" not in text


# -- the arithmetic the kernels and the reference share --------------------------------------
def test_round_half_even_matches_jnp_round(rng):
  v = np.concatenate([rng.uniform(-40, 40, 2000), np.arange(-20, 20) + 0.5,
                      np.arange(-20, 20, dtype=np.float64), [0.49999997, -0.49999997, 1e9 + 0.5]])
  v = jnp.asarray(v.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(quant.round_half_even(v)), np.asarray(jnp.round(v)))
  a = np.asarray(v)
  np.testing.assert_array_equal(np.asarray(quant.round_half_away_from_zero(v)),
                                np.sign(a) * np.floor(np.abs(a) + 0.5))


def test_div_const_is_what_jit_computes(rng):
  """Guards the assumption the kernel relies on: jitted ``x / c`` == ``x * f32(1/c)``."""
  x = jnp.asarray(rng.standard_normal(4096).astype(np.float32) * 10)
  for c in (15.0, 127.0, 448.0, 6.0):
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x / c)(x)),
                                  np.asarray(quant.div_const(x, c)))


def test_e2m1_decode_and_byte_helpers(rng):
  codes = jnp.arange(16, dtype=jnp.uint8)
  grid = np.concatenate([quant.E2M1_GRID, -quant.E2M1_GRID])
  np.testing.assert_array_equal(np.asarray(quant.e2m1_decode(codes)).view(np.uint32),
                                grid.astype(np.float32).view(np.uint32))   # -0.0 for code 8
  s = jnp.asarray(rng.standard_normal(64).astype(np.float32))
  b = common.f32_to_bytes(s)
  np.testing.assert_array_equal(np.asarray(b), np.asarray(jax.lax.bitcast_convert_type(
      s, jnp.uint8)))
  back = common.f32_from_bytes(lambda i: b[:, i])
  np.testing.assert_array_equal(np.asarray(back).view(np.uint32), np.asarray(s).view(np.uint32))
  assert [common.next_pow2(n) for n in (0, 1, 2, 3, 64, 80)] == [1, 1, 2, 4, 64, 128]
  assert common.cdiv(7, 2) == 4 and common.cdiv(8, 2) == 4


@pytest.mark.parametrize("cache_dtype,layout,head_size", [
    ("auto", "NHD", 128), ("fp8_e5m2", "HND", 64), ("int8_per_token_head", "HND", 80),
    ("int4_per_token_head", "NHD", 80), ("nvfp4", "HND", 128)])
def test_kernels_lower_to_triton_for_cuda(cache_dtype, layout, head_size):
  """The Triton lowering (what runs on the GPU) accepts every op the kernels use.

  Lowered here without a GPU through ``jax.export``; compiling the Triton IR needs the GPU.
  """
  from jax import export
  from pallas_kernels.triton import dequant as dq
  spec = KVCacheSpec(2, head_size, 16, cache_dtype, layout)
  c = jax.ShapeDtypeStruct(spec.physical_shape(8), spec.storage_dtype)
  kv = jax.ShapeDtypeStruct((40, 2, head_size), spec.dtype)
  s = jax.ShapeDtypeStruct((33,), jnp.int32)
  allow = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  for config in (None, cu.WriteConfig(tokens_per_program=4, pair_split=False)):
    write = jax.jit(lambda c, k, v, s: cu.write_kv(c, k, v, s, spec, config=config),
                    donate_argnums=0)
    text = export.export(write, platforms=["cuda"], disabled_checks=allow)(c, kv, kv, s)
    assert "xla.gpu.triton" in text.mlir_module()
  deq = jax.jit(lambda p: dq.dequantize_pages(p, spec))
  text = export.export(deq, platforms=["cuda"], disabled_checks=allow)(c)
  assert "xla.gpu.triton" in text.mlir_module()


# -- slots outside the cache, NaN payloads, extreme int4 rows (every writer) ----------------
_WRITERS = {
    "reference": lambda c, k, v, s, spec: ref.write_kv(c, k, v, s, spec),
    "pallas": lambda c, k, v, s, spec: cu.write_kv(c, k, v, s, spec, interpret=True),
}


@pytest.mark.parametrize("writer", sorted(_WRITERS))
@pytest.mark.parametrize("cache_dtype,layout,heads", [
    ("auto", "NHD", 4), ("auto", "HND", 2), ("int8_per_token_head", "NHD", 2),
    ("nvfp4", "HND", 4)])
def test_slots_outside_the_cache_write_nothing_under_jit(rng, writer, cache_dtype, layout, heads):
  """Slots >= B*N (just past the end, 2**30+5 whose slot*H wraps int32, 2**31-1) and negative
  slots store nothing, traced under jit: the result equals writing the valid slots alone."""
  spec = KVCacheSpec(heads, 64, 16, cache_dtype, layout)
  b = 4
  cache = poisoned_cache(rng, spec, b)
  valid = rng.choice(b * 16, 5, replace=False)
  bad = [b * 16, b * 16 + 5, 2**30 + 5, 2**31 - 1, -1, -(2**31)]
  slots = jnp.asarray(rng.permutation(np.concatenate([valid, bad])).astype(np.int32))
  key, value = random_kv(rng, spec, slots.shape[0])
  keep = np.asarray(slots) >= 0
  keep &= np.asarray(slots) < b * 16
  want = as_bytes(_ref_write(cache, key[keep], value[keep], slots[keep], spec, None, None))
  got = as_bytes(jax.jit(_WRITERS[writer], static_argnums=4)(cache, key, value, slots, spec))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("writer", sorted(_WRITERS))
def test_wide_integer_slots_are_checked_before_narrowing(rng, writer):
  """int64 slots (numpy) 2**32+7 and -(2**32)+5 would wrap to 7 and 5 in int32: dropped."""
  spec = KVCacheSpec(2, 64, 16, "auto", "NHD")
  cache = poisoned_cache(rng, spec, 4)
  slots = np.asarray([3, 2**32 + 7, -(2**32) + 5, 17], np.int64)
  key, value = random_kv(rng, spec, 4)
  pick = jnp.asarray([0, 3])
  want = as_bytes(_ref_write(cache, key[pick], value[pick], jnp.asarray([3, 17], jnp.int32),
                             spec, None, None))
  np.testing.assert_array_equal(as_bytes(_WRITERS[writer](cache, key, value, slots, spec)), want)


# A NaN with a payload for every float storage dtype (bits), and a plain float value.
_NAN_PAYLOADS = {"auto": 0x7FC1, "float16": 0x7E01, "float32": 0x7FC00001,
                 "fp8_e5m2": 0xFD, "fp8_e4m3": 0x7F}


@pytest.mark.parametrize("writer", sorted(_WRITERS))
@pytest.mark.parametrize("cache_dtype", sorted(_NAN_PAYLOADS))
@pytest.mark.parametrize("jitted", [False, True])
def test_untouched_nan_payloads_keep_their_bits(rng, writer, cache_dtype, jitted):
  """XLA on CPU scatters bf16 / fp8_e5m2 through float32 and rewrites NaN payloads: writers
  move bits, so every byte not named by a slot keeps its bits (eager and jit, donated)."""
  spec = KVCacheSpec(2, 32, 16, cache_dtype, "NHD")
  bits = quant.bits_dtype(spec.storage_dtype)
  raw = np.full(spec.physical_shape(3), _NAN_PAYLOADS[cache_dtype], bits)
  cache = jnp.asarray(raw.view(spec.storage_dtype))
  slots = jnp.asarray([20, 5], jnp.int32)                   # rows of blocks 1 and 0
  key, value = random_kv(rng, spec, 2)
  fn = functools.partial(_WRITERS[writer], spec=spec)
  run = jax.jit(fn, donate_argnums=0) if jitted else fn
  got = np.asarray(run(cache, key, value, slots)).view(bits)
  rows = got.reshape(3 * 16, -1)                             # NHD: (block * N + token, H*C)
  untouched = np.setdiff1d(np.arange(3 * 16), [20, 5])
  np.testing.assert_array_equal(rows[untouched], raw.reshape(3 * 16, -1)[untouched])
  assert not np.array_equal(rows[[20, 5]], raw.reshape(3 * 16, -1)[[20, 5]])


@pytest.mark.parametrize("writer", sorted(_WRITERS))
def test_int4_rows_near_the_float32_limit_round_trip_finite(rng, writer):
  """max - min of a row holding -3e38 and 3e38 overflows float32; the scale must not."""
  spec = KVCacheSpec(2, 64, 16, "int4_per_token_head", "HND", jnp.float32)
  x = rng.uniform(-3e38, 3e38, (4, 2, 64)).astype(np.float32)
  x[:, :, 0], x[:, :, 1] = 3e38, -3e38
  x[3] = rng.standard_normal((2, 64))                       # an ordinary row next to them
  key = value = jnp.asarray(x)
  slots = jnp.asarray([0, 17, 33, 2], jnp.int32)
  cache = _WRITERS[writer](spec.allocate(3), key, value, slots, spec)
  np.testing.assert_array_equal(as_bytes(cache), as_bytes(
      _ref_write(spec.allocate(3), key, value, slots, spec, None, None)))
  k, _ = kvjax.read_kv(cache, spec, slots)
  k = np.asarray(k, np.float64)
  assert np.isfinite(k).all()
  x64 = x.astype(np.float64)
  step = (x64.max(-1) - x64.min(-1)) / 15                   # one int4 step, in float64
  assert np.all(np.abs(k - x64) <= step[..., None] + 1e-6)
