"""Quantization formulas (docs/layout.md §5): the worked examples and independent numpy oracles."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax import formats as F
from kvjax import quant

INT8 = F.get_format("int8_per_token_head")
FP8 = F.get_format("fp8_per_token_head")

# The nvfp4 / e2m1 formulas run jitted here: eagerly each of their jnp ops compiles on its own
# for every new shape (seconds per test); test_eager_and_jit_store_the_same_bits checks that
# eager and jit store the same bits. (Not int4: under jit XLA may contract its scale
# hi * (1/15) - lo * (1/15) into an fma, one ulp off the numpy oracle below.)
quantize_nvfp4, dequantize_nvfp4 = jax.jit(quant.quantize_nvfp4), jax.jit(quant.dequantize_nvfp4)
e2m1_encode, e2m1_decode = jax.jit(quant.e2m1_encode), jax.jit(quant.e2m1_decode)


def test_int8_worked_example():
  row = np.zeros(8, np.float32)
  row[:4] = [127.0, 2.5, -2.5, -0.4]
  data, scale = quant.quantize_per_token_head(jnp.asarray(row), INT8)
  assert float(scale) == 1.0
  np.testing.assert_array_equal(np.asarray(data)[:4], [127, 3, -3, 0])
  data, scale = quant.quantize_per_token_head(jnp.zeros(8), INT8)
  assert float(scale) == np.float32(1e-6)
  assert not np.asarray(data).any()


def test_fp8_per_token_head_worked_example(rng):
  row = rng.uniform(-400, 400, 16).astype(np.float32)
  row[3] = 448.0
  row = np.asarray(jnp.asarray(row).astype(jnp.float8_e4m3fn).astype(jnp.float32))  # exact in e4m3
  data, scale = quant.quantize_per_token_head(jnp.asarray(row), FP8)
  assert float(scale) == 1.0
  values = np.asarray(data).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(values, row)


def _int8_numpy(x, scale):
  y = x * (np.float32(1) / scale)[..., None]
  return np.clip(np.sign(y) * np.floor(np.abs(y) + 0.5), -128, 127).astype(np.int8)


def test_int8_matches_numpy(rng):
  x = (rng.standard_normal((64, 4, 96)) * rng.uniform(0.01, 50, (64, 4, 1))).astype(np.float32)
  data, scale = quant.quantize_per_token_head(jnp.asarray(x), INT8)
  s_np = np.maximum(np.abs(x).max(-1) * (np.float32(1) / np.float32(127)), np.float32(1e-6))
  np.testing.assert_array_equal(np.asarray(scale), s_np)
  q_np = _int8_numpy(x, s_np)
  np.testing.assert_array_equal(np.asarray(data), q_np)
  back = np.asarray(quant.dequantize_per_token_head(data, scale, INT8))
  # Half a step, plus float32 rounding of q * scale (relative to |x|, so no seed can break it).
  assert np.all(np.abs(back - x) <= s_np[..., None] * 0.5 + np.abs(x) * 2.0**-22)


def test_int4_worked_example():
  """docs/layout.md §5: scale 15 * f32(1/15) = 1.0000001, zero point 8, ties away from zero."""
  row = np.array([-8, 7, 0.5, 1.5, -0.5, 3.25, 0, 0], np.float32)
  packed, stored = quant.quantize_int4(jnp.asarray(row))
  p = np.asarray(packed)
  np.testing.assert_array_equal(np.stack([p & 0xF, p >> 4], -1).ravel(),
                                [0, 15, 9, 10, 8, 11, 8, 8])
  assert int(np.asarray(stored).view(np.uint32)) == 0x3F800008    # 1.0000001, low bits = zp
  np.testing.assert_array_equal(np.asarray(quant.dequantize_int4(packed, stored)),
                                [-8, 7, 1, 2, 0, 3, 0, 0])


def test_int8_rows_hold_rounding_ties(rng):
  """docs/layout.md §5: x = amax/2 is exactly 63.5 in units of amax/127, and Gaussian bf16
  rows hold about 3 such ties in 1000 elements (where a last-bit difference in 1/scale, e.g.
  a GPU's approximate reciprocal, can move a code by one)."""
  x = (rng.standard_normal((4000, 128)) * np.exp(rng.uniform(-1, 1, (4000, 1))))
  x = x.astype(ml_dtypes.bfloat16).astype(np.float64)
  y = x * 127 / np.abs(x).max(-1, keepdims=True)                  # exact to ~1e-14
  ties = np.abs(np.abs(y) % 1 - 0.5) < 1e-9
  assert 0.002 < ties.mean() < 0.005, ties.mean()
  half = np.abs(np.abs(x) * 2 - np.abs(x).max(-1, keepdims=True)) == 0
  assert np.all(ties[half]) and half.any()


def _int4_numpy(x):
  """vLLM's int4 quantizer in numpy (docs/layout.md §5): ``x * r + zp`` as one fma (float64
  holds the product exactly), ``+-0.5`` then truncation for rounding."""
  half_away = lambda v: np.where(v >= 0, np.trunc(v + np.float32(0.5)),
                                 np.trunc(v - np.float32(0.5))).astype(np.float32)
  lo, hi = x.min(-1), x.max(-1)
  s = np.maximum((hi - lo) * (np.float32(1) / np.float32(15)), np.float32(1e-6))
  r = np.float32(1) / s
  zp = np.clip(half_away(-lo * r), 0, 15)
  y = (x.astype(np.float64) * r[..., None] + zp[..., None]).astype(np.float32)
  return np.clip(half_away(y), 0, 15).astype(np.uint8), s, zp


@pytest.mark.parametrize("jitted", [False, True])
def test_int4_matches_numpy(rng, jitted):
  import jax
  x = ((rng.standard_normal((2000, 2, 64)) + 0.3 * rng.standard_normal((2000, 2, 1)))
       * rng.uniform(0.01, 50, (2000, 2, 1))).astype(np.float32)
  x[0, 0] = np.round(x[0, 0])                          # integer rows: ties everywhere
  x[1, 1] = 2.5                                        # a constant row: scale 1e-6
  f = jax.jit(quant.quantize_int4) if jitted else quant.quantize_int4
  # on the CPU device: the formula is checked as XLA-CPU compiles it (XLA-GPU's compile of it
  # may round a code in ~1 of 250,000 differently, benchmarks/RESULTS.md, "Writes"; the kernels
  # are checked against the CPU reference)
  packed, scale = f(jax.device_put(x, jax.devices("cpu")[0]))
  q, s, zp = _int4_numpy(x)
  got = np.asarray(packed)
  np.testing.assert_array_equal(np.stack([got & 0xF, got >> 4], -1).reshape(q.shape), q)
  bits = np.asarray(scale).view(np.uint32)
  np.testing.assert_array_equal(bits & 0xF, zp.astype(np.uint32))
  np.testing.assert_array_equal(bits >> 4, s.view(np.uint32) >> 4)
  back = np.array(quant.dequantize_int4(packed, scale))
  # zp is clamped to [0, 15]: a row that does not straddle 0 is clipped (docs/edges.md), the
  # constant row reads back as 15 * 1e-6
  np.testing.assert_allclose(back[1, 1], 15e-6, rtol=1e-5)   # the scale with its low bits 0
  back[1, 1] = x[1, 1]
  assert np.all(np.abs(back - x) <= s[..., None] * 0.5 * 1.001 + 1e-5)


def test_fp8_per_tensor_saturates(rng):
  x = jnp.asarray(rng.standard_normal((3, 2, 16)).astype(np.float32) * 10)
  x = x.at[0, 0, 0].set(1e6).at[0, 0, 1].set(-1e6)
  q = quant.quantize_fp8_per_tensor(x, 0.5, jnp.float8_e4m3fn)
  back = np.asarray(q.astype(jnp.float32))
  assert back[0, 0, 0] == 448.0 and back[0, 0, 1] == -448.0
  assert np.isfinite(back).all()
  per_head = quant.quantize_fp8_per_tensor(x, jnp.asarray([0.5, 2.0]), jnp.float8_e4m3fn)
  expect = np.clip(np.asarray(x) / np.array([0.5, 2.0])[:, None], -448, 448)
  np.testing.assert_array_equal(np.asarray(per_head.astype(jnp.float32)),
                                expect.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_e2m1_grid_and_ties():
  vals = np.array([0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 100, -0.75, -6, -7],
                  np.float32)
  codes = np.asarray(e2m1_encode(jnp.asarray(vals)))
  decoded = np.asarray(e2m1_decode(jnp.asarray(codes)))
  np.testing.assert_array_equal(decoded, [0, 0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, -1, -6, -6])
  all_codes = jnp.arange(16, dtype=jnp.uint8)
  np.testing.assert_array_equal(np.asarray(e2m1_encode(e2m1_decode(all_codes)))[:8],
                                np.arange(8))


def _e2m1_codes_numpy(y):
  """Nearest e2m1 code of float32 ``y``, ties to the even code, |y| >= 6 (inf, NaN) -> 7,
  the sign bit as bit 3: by distance to the grid, no bit tricks."""
  with np.errstate(invalid="ignore"):                     # signalling NaN bit patterns
    a = np.abs(y.astype(np.float64))
  a = np.where(np.isnan(a), 6.0, np.minimum(a, 6.0))
  dist = np.abs(a[..., None] - quant.E2M1_GRID.astype(np.float64))
  best = dist.min(-1, keepdims=True)
  ties = dist == best                                     # one or two nearest codes
  idx = np.where(ties[..., ::2].any(-1), np.argmax(ties & (np.arange(8) % 2 == 0), -1),
                 np.argmax(ties, -1))
  return (idx | (np.signbit(y) << 3)).astype(np.uint32)


def test_e2m1_encode_against_nearest_grid_point(rng):
  """Every midpoint and grid point with its float32 neighbours (ties and one ulp off them),
  random values over the range, and random bit patterns (subnormals, inf, NaN)."""
  marks = np.concatenate([quant.E2M1_GRID, (quant.E2M1_GRID[1:] + quant.E2M1_GRID[:-1]) / 2,
                          [6.5, 7.0, 1e30]]).astype(np.float32)
  up, down = [marks], [marks]
  for _ in range(3):
    up.append(np.nextafter(up[-1], np.float32(np.inf)))
    down.append(np.nextafter(down[-1], np.float32(-np.inf)))
  vals = np.concatenate(up + down + [rng.uniform(-8, 8, 4096).astype(np.float32),
                                     rng.integers(0, 2**32, 4096, dtype=np.uint64)
                                     .astype(np.uint32).view(np.float32),
                                     np.array([np.inf, -np.inf, np.nan, -np.nan, 1e-45, -0.0],
                                              np.float32)])
  vals = np.concatenate([vals, -vals])
  np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(vals))),
                                _e2m1_codes_numpy(vals))


def _nvfp4_numpy(x, global_scale):
  gs = np.float32(1.0) / np.float32(global_scale)
  g = x.reshape(x.shape[:-1] + (-1, 16))
  sf = np.clip(gs * np.abs(g).max(-1) * (np.float32(1) / np.float32(6)), 0, 448)
  sf = sf.astype(ml_dtypes.float8_e4m3fn)
  sf32 = sf.astype(np.float32)[..., None]
  y = np.where(sf32 == 0, 0, (g * gs) * (np.float32(1) / np.where(sf32 == 0, 1, sf32)))
  grid = quant.E2M1_GRID
  a = np.abs(y)
  idx = np.abs(a[..., None] - grid).argmin(-1)            # nearest; ties resolved below
  lower = grid[np.maximum(idx - 1, 0)]
  # ties go to the even code
  tie_down = (np.abs(a - lower) == np.abs(a - grid[idx])) & (idx % 2 == 1)
  idx = np.where(tie_down, idx - 1, idx)
  code = (idx | (np.signbit(y) << 3)).astype(np.uint8).reshape(x.shape)
  return code[..., 0::2] | (code[..., 1::2] << 4), sf


def test_nvfp4_matches_numpy(rng):
  x = (rng.standard_normal((16, 2, 64)) * rng.uniform(0.1, 20, (16, 2, 1))).astype(np.float32)
  packed, sf = quantize_nvfp4(jnp.asarray(x), 0.25)
  p_np, sf_np = _nvfp4_numpy(x, 0.25)
  np.testing.assert_array_equal(np.asarray(sf).view(np.uint8), sf_np.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(packed), p_np)
  back = np.asarray(dequantize_nvfp4(packed, sf, 0.25))
  group_max = np.abs(x.reshape(16, 2, 4, 16)).max(-1, keepdims=True)
  err = np.abs(back - x).reshape(16, 2, 4, 16)
  assert np.all(err <= group_max * 0.25 + 1e-6)   # half of e2m1's widest step (2 of 6) + e4m3


def test_v_swizzle_is_a_permutation_and_matches_formula():
  idx = quant.nvfp4_v_swizzle_index(16, 8)
  assert sorted(idx.ravel()) == list(range(128))
  # (t, s) = (5, 3): ((5//4)*4 + 3//2)*8 + (3%2)*4 + 5%4 = 5*8 + 4 + 1
  assert idx[5, 3] == 45
  with pytest.raises(ValueError, match="swizzle"):
    quant.nvfp4_v_swizzle_index(16, 2)


@pytest.mark.parametrize("name", ["int8_per_token_head", "fp8_per_token_head", "nvfp4", "fp8",
                                  "int4_per_token_head"])
def test_eager_and_jit_store_the_same_bits(rng, name):
  """The written-out reciprocal forms leave XLA nothing to rewrite: eager == jit, bit for bit."""
  fmt = F.get_format(name)
  x = jnp.asarray((rng.standard_normal((64, 4, 64)) * rng.uniform(0.01, 30, (64, 4, 1)))
                  .astype(np.float32))
  if fmt.kind == F.NVFP4:
    f = lambda x: quant.quantize_nvfp4(x, jnp.float32(0.3))
  elif fmt.kind == F.FP8_PER_TENSOR:
    f = lambda x: (quant.quantize_fp8_per_tensor(x, jnp.float32(0.3), fmt.storage),)
  elif fmt.quant == "int4":
    f = quant.quantize_int4
  else:
    f = lambda x: quant.quantize_per_token_head(x, fmt)
  for a, b in zip(f(x), jax.jit(f)(x)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_nvfp4_flushes_tiny_groups_without_a_global_scale():
  """docs/layout.md §5: with k_scale 1.0, a group whose amax is below 6 * 2**-10 (~0.006)
  gets scale 0 (e4m3's smallest step is 2**-9) and reads back as zeros; a k_scale fixes it."""
  x = np.zeros((2, 16), np.float32)
  x[0, :] = np.linspace(-0.0055, 0.0055, 16)
  x[1, :] = np.linspace(-0.0062, 0.0062, 16)
  packed, sf = quantize_nvfp4(jnp.asarray(x), None)
  back = np.asarray(dequantize_nvfp4(packed, sf, None))
  assert not back[0].any() and np.abs(back[1]).max() > 0
  packed, sf = quantize_nvfp4(jnp.asarray(x), 0.001)
  back = np.asarray(dequantize_nvfp4(packed, sf, 0.001))
  assert np.all(np.abs(back - x) <= np.abs(x).max(-1, keepdims=True) * 0.25 + 1e-9)


def test_abs_max_clamp_and_at_least_keep_nan(rng):
  """The NaN-keeping forms every writer shares: the same numbers as numpy's max / clip on
  finite data, NaN wherever numpy's NaN-propagating forms give NaN."""
  x = rng.standard_normal((6, 4, 8)).astype(np.float32) * 100
  x[0, 1, 3], x[1, 2, 5], x[2, 0, 0], x[3, 3, 7] = np.nan, np.inf, -np.inf, -0.0
  x[4, 1, 1] = -np.float32(np.nan)                       # a NaN with its sign bit set
  y = -np.abs(rng.standard_normal((6, 4, 8)).astype(np.float32))
  for axis in (-1, 2, (1, 2), (0, 2)):
    want = np.max(np.maximum(np.abs(x), np.abs(y)), axis=axis)
    got = np.asarray(quant.abs_max(jnp.asarray(x), jnp.asarray(y), axis=axis))
    np.testing.assert_array_equal(got, want, err_msg=str(axis))
    assert np.isnan(got).sum() > 0
  got = np.asarray(quant.abs_max(jnp.asarray(x), axis=-1, keepdims=True))
  np.testing.assert_array_equal(got, np.max(np.abs(x), axis=-1, keepdims=True))
  v = np.array([np.nan, -np.inf, -500, -448, -1.5, -0.0, 0.0, 3, 448, 449, np.inf], np.float32)
  np.testing.assert_array_equal(np.asarray(quant.clamp(jnp.asarray(v), -448.0, 448.0)),
                                np.clip(v, -448, 448))
  np.testing.assert_array_equal(np.asarray(quant.at_least(jnp.asarray(v), 1e-6)),
                                np.maximum(v, np.float32(1e-6)))


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8", "fp8"])
def test_row_clamps_never_change_a_finite_code(rng, fmt):
  """Compiled kernels leave the per-token-head clamps to their saturating conversions
  (``cast_saturates``): sound because a finite row divided by its scale stays within
  ``QMAX * (1 + 2**-21)``, which both casts map as the clamp would. Rows of every magnitude,
  scale-floored tiny ones included, quantize to the same bits either way (on the CPU, where
  the unclamped cast would not saturate)."""
  x = rng.standard_normal((64, 128)).astype(np.float32)
  x *= np.float32(10.0) ** rng.integers(-12, 30, (64, 1)).astype(np.float32)
  x[::7, 0] = -np.abs(x[::7]).max(axis=1) * 1.0000001          # the extreme entry negative
  x = jnp.asarray(x)
  scale = quant.row_scale(quant.abs_max(x, axis=-1), fmt.qmax)
  y = x * (1.0 / scale)[:, None]
  assert float(jnp.abs(y).max()) <= fmt.qmax * (1 + 2.0 ** -21)
  clamped = quant.quantize_scaled(y, fmt.quant, fmt.qmax)
  cast_only = quant.quantize_scaled(y, fmt.quant, fmt.qmax, cast_saturates=True)
  np.testing.assert_array_equal(np.asarray(cast_only).view(np.uint8),
                                np.asarray(clamped).view(np.uint8))
  codes = np.asarray(clamped).astype(np.float32)
  assert codes.max() == fmt.qmax and codes.min() == -fmt.qmax     # the edges were reached
