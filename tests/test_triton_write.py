"""What is particular to the Triton write kernel: launch configs, in-place donation, the CUDA
lowering, and the arithmetic it shares with the reference.

The write case suite (every format, every implementation) is test_op_write.py. The kernel
calls here run in interpret mode on CPU and compiled on a GPU with ``KVJAX_TEST_COMPILED=1``
(``tests/compiled_groups.py``), except the CPU properties (in-place donation in interpret
mode, the CUDA lowering).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import KVCacheSpec, quant
from kvjax.reference import cache_update as ref
from kv_testing import as_bytes, assert_written_as_reference, poisoned_cache, random_kv
from op_suite import triton_interpret
from pallas_kernels.triton import write as cu
from pallas_kernels import common

NUM_BLOCKS = 5
INTERPRET = triton_interpret()   # interpret mode on CPU; compiled on a GPU
_ref_write = jax.jit(ref.write_kv, static_argnums=4)


def _kernel_write(cache, key, value, slots, spec, ks=None, vs=None, config=None):
  return cu.write_kv(cache, key, value, slots, spec, k_scale=ks, v_scale=vs,
                     interpret=INTERPRET, config=config)


def _slots(rng, spec, t, pad):
  """Duplicate-free random slots with ``pad`` padding (-1) slots mixed in."""
  s = rng.choice(NUM_BLOCKS * spec.block_size, t, replace=False)
  s = np.concatenate([s, -np.ones(pad, np.int64)])
  return jnp.asarray(rng.permutation(s).astype(np.int32))


@pytest.mark.parametrize("cache_dtype", ["int4_per_token_head", "nvfp4"])
def test_launch_configs_store_the_same_bytes(rng, cache_dtype):
  """Several tokens a program (a partial last program), and the split pair loads."""
  spec = KVCacheSpec(2, 64, 16, cache_dtype, "HND")
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  t = 13
  slots = _slots(rng, spec, t, pad=2)
  key, value = random_kv(rng, spec, t + 2)
  want = _ref_write(cache, key, value, slots, spec, None, None)
  for config in (cu.WriteConfig(tokens_per_program=4),
                 cu.WriteConfig(tokens_per_program=2, pair_split=True)):
    got = _kernel_write(cache, key, value, slots, spec, config=config)
    assert_written_as_reference(got, want, spec, slots)


@pytest.mark.parametrize("cache_dtype,head_size,words", [
    ("int4_per_token_head", 4, False), ("int4_per_token_head", 16, True),
    ("int8_per_token_head", 6, False), ("int8_per_token_head", 80, True),
    ("fp8_per_token_head", 20, True)])
def test_word_and_byte_stores_write_the_reference_bytes(rng, cache_dtype, head_size, words):
  """Row formats whose segments sit at multiples of 4 bytes are stored as uint32 words, the
  others byte by byte: both store exactly the reference's bytes (poisoned cache, padding)."""
  from pallas_kernels.triton.adapters import tile_format
  spec = KVCacheSpec(3, head_size, 16, cache_dtype, "NHD")
  assert tile_format(spec).write_words == words
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  t = 21
  slots = _slots(rng, spec, t, pad=3)
  key, value = random_kv(rng, spec, t + 3)
  want = _ref_write(cache, key, value, slots, spec, None, None)
  assert_written_as_reference(_kernel_write(cache, key, value, slots, spec), want, spec, slots)
  assert (as_bytes(want) != as_bytes(cache)).any()


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
def test_round_half_away_from_zero_matches_numpy(rng):
  v = np.concatenate([rng.uniform(-40, 40, 2000), np.arange(-20, 20) + 0.5,
                      np.arange(-20, 20, dtype=np.float64), [0.49999997, -0.49999997, 1e9 + 0.5]])
  v = jnp.asarray(v.astype(np.float32))
  a = np.asarray(v)
  np.testing.assert_array_equal(np.asarray(quant.round_half_away_from_zero(v)),
                                np.sign(a) * np.floor(np.abs(a) + np.float32(0.5)))


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
    ("int4_per_token_head", "NHD", 64), ("nvfp4", "HND", 128)])
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


@pytest.mark.parametrize("cache_dtype,layout,head_size", [
    ("fp8", "NHD", 64), ("fp8_e5m2", "HND", 64), ("int8_per_token_head", "NHD", 64),
    ("fp8_per_token_head", "HND", 80), ("nvfp4", "HND", 64)])
def test_writers_use_no_nan_dropping_float_min_or_max(cache_dtype, layout, head_size):
  """The Pallas Triton lowering turns a float ``max`` / ``min`` into ``arith.maxnumf`` /
  ``minnumf``, which drop NaN on the GPU (interpret mode on CPU keeps it, so the NaN / Inf
  contract test of test_op_write.py cannot see this here). The write kernels' Triton IR,
  lowered for CUDA without a GPU, has none: their amax, scale floors and clips keep NaN.

  (int4 keeps its float row min / max: its rows arrive Hadamard-rotated, and one NaN makes
  every rotated value NaN, so they stay NaN; :func:`kvjax.quant.int4_scale`.)"""
  from triton_ir import triton_kernels
  spec = KVCacheSpec(2, head_size, 16, cache_dtype, layout)
  c = jax.ShapeDtypeStruct(spec.physical_shape(8), spec.storage_dtype)
  kv = jax.ShapeDtypeStruct((12, 2, head_size), spec.dtype)
  ks = 0.5 if spec.format.has_tensor_scales else None
  (kernel,) = triton_kernels(
      lambda c, k, v, s: cu.write_kv(c, k, v, s, spec, k_scale=ks, v_scale=ks), c, kv, kv,
      jax.ShapeDtypeStruct((12,), jnp.int32))
  for op in ("arith.maxnumf", "arith.minnumf"):
    assert op not in kernel.text_plain, f"{cache_dtype} {layout}: {op} in the write kernel"
