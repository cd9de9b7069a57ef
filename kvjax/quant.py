"""Quantize / dequantize for every cache dtype, pure jnp (spec §5).

Row functions work on any leading shape: ``x [..., D]`` is one (token, head)
row per leading index. The same formulas are the oracle for the Pallas write
kernels, which must store bit-identical bytes.

Divisions are written as multiplications by a float32 reciprocal (``x * (1/s)``,
``a * f32(1/15)``): that is the form XLA's algebraic simplifier turns ``x / s``
into under ``jit``, so writing it out makes eager, jitted and kernel results the
same bits. Only a true elementwise ``a / b`` (int4's zero point) stays a division.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import formats as F

SCALE_EPS = 1e-6
E4M3_MAX = 448.0
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# Boundaries between e2m1 codes k and k+1 and whether a tie rounds up (to the even code).
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                (3.5, True), (5.0, False))


def round_half_away_from_zero(x):
  return jnp.sign(x) * jnp.floor(jnp.abs(x) + 0.5)


def _finite_max(dtype) -> float:
  return float(jnp.finfo(dtype).max)


def _times_inverse(x, c: float):
  """``x / c`` for a constant ``c``, as ``x * f32(1 / c)``."""
  return x * (np.float32(1.0) / np.float32(c))


# -- storage bits ------------------------------------------------------------------------------
_UINT_OF_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def bits_dtype(dtype) -> np.dtype:
  """The unsigned integer dtype as wide as ``dtype`` (what writers move bytes as)."""
  return _UINT_OF_SIZE[np.dtype(dtype).itemsize]


def to_bits(x):
  """``x`` reinterpreted as :func:`bits_dtype` (free). Writers scatter bits, never floats:
  XLA may canonicalize the NaN payload of a float it passes through (fp8 scatters on CPU
  do), and bytes a write does not name must keep every bit."""
  bt = bits_dtype(x.dtype)
  return x if np.dtype(x.dtype) == bt else jax.lax.bitcast_convert_type(x, bt)


def from_bits(x, dtype):
  """Inverse of :func:`to_bits`."""
  return x if np.dtype(x.dtype) == np.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


# -- fp8 per tensor --------------------------------------------------------------------------
def per_head_scale(scale, num_heads: int):
  """A scalar or [H] float32 scale, shaped to broadcast over ``[..., H, D]``."""
  s = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
  if s.ndim == 0:
    return s
  if s.shape != (num_heads,):
    raise ValueError(f"scale must be a scalar or shape ({num_heads},), got {s.shape}")
  return s[:, None]


def quantize_fp8_per_tensor(x, scale, fp8_dtype):
  """``x [..., H, D]`` -> fp8 ``x / scale`` saturated to the finite range."""
  m = _finite_max(fp8_dtype)
  y = x.astype(jnp.float32) * (1.0 / per_head_scale(scale, x.shape[-2]))
  return jnp.clip(y, -m, m).astype(fp8_dtype)


def dequantize_fp8_per_tensor(q, scale):
  return q.astype(jnp.float32) * per_head_scale(scale, q.shape[-2])


# -- per token-head --------------------------------------------------------------------------
def _int4_pack(q):
  """uint8 values in [0, 15], ``[..., D]`` -> ``[..., D/2]``, low nibble = even element."""
  q = q.astype(jnp.uint8)
  return q[..., 0::2] | (q[..., 1::2] << 4)


def _int4_unpack(packed):
  lo = packed & 0xF
  hi = packed >> 4
  return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def int4_scale(lo, hi):
  """int4 row scale ``max((max - min) / 15, eps)`` from the row's min and max, float32.

  Computed as ``max/15 - min/15`` so rows near the float32 limits (e.g. -3e38 and 3e38,
  whose difference overflows) still get a finite scale. Used as is inside the write kernels.
  """
  return jnp.maximum(_times_inverse(hi, 15.0) - _times_inverse(lo, 15.0), SCALE_EPS)


def quantize_per_token_head(x, fmt: F.CacheFormat):
  """One scale per row. ``x [..., D]`` -> (data ``[..., data_dim]`` in storage dtype, scale f32 ``[...]``).

  int4 stores the 4-bit zero point in the low mantissa bits of the scale.
  """
  x = x.astype(jnp.float32)
  if fmt.quant == "int4":
    lo, hi = jnp.min(x, -1), jnp.max(x, -1)
    scale = int4_scale(lo, hi)
    zp = jnp.clip(jnp.round(-lo / scale), 0, 15)
    q = jnp.clip(jnp.round(x * (1.0 / scale)[..., None] + zp[..., None]), 0, 15)
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    bits = (bits & jnp.uint32(0xFFFFFFF0)) | zp.astype(jnp.uint32)
    return _int4_pack(q), jax.lax.bitcast_convert_type(bits, jnp.float32)
  scale = jnp.maximum(_times_inverse(jnp.max(jnp.abs(x), -1), fmt.qmax), SCALE_EPS)
  y = x * (1.0 / scale)[..., None]
  if fmt.quant == np.dtype(np.int8):
    return jnp.clip(round_half_away_from_zero(y), -128, 127).astype(jnp.int8), scale
  q = jnp.clip(y, -fmt.qmax, fmt.qmax).astype(fmt.quant)
  return jax.lax.bitcast_convert_type(q, fmt.storage), scale


def dequantize_per_token_head(data, scale, fmt: F.CacheFormat):
  """Inverse of :func:`quantize_per_token_head`: float32 ``[..., D]``."""
  if fmt.quant == "int4":
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    zp = (bits & 0xF).astype(jnp.float32)
    s = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFFFF0), jnp.float32)
    q = _int4_unpack(data).astype(jnp.float32)
    return (q - zp[..., None]) * s[..., None]
  if fmt.quant == np.dtype(np.int8):
    q = data.astype(jnp.float32)
  else:
    q = jax.lax.bitcast_convert_type(data, fmt.quant).astype(jnp.float32)
  return q * scale[..., None]


def scale_to_storage(scale, storage_dtype):
  """float32 ``[...]`` -> its 4 bytes as ``[..., 4 // itemsize]`` storage elements."""
  return jax.lax.bitcast_convert_type(scale, storage_dtype)


def scale_from_storage(raw):
  """``[..., 4 // itemsize]`` storage elements -> float32 ``[...]``."""
  if raw.dtype.itemsize == 4:
    return jax.lax.bitcast_convert_type(raw[..., 0], jnp.float32)
  return jax.lax.bitcast_convert_type(raw, jnp.float32)


# -- nvfp4 -------------------------------------------------------------------------------------
def e2m1_encode(x):
  """float32 -> 4-bit e2m1 code (uint8 in [0, 15]), round to nearest even, saturating."""
  a = jnp.abs(x)
  code = jnp.zeros(x.shape, jnp.uint8)
  for bound, tie_up in _E2M1_BOUNDS:
    code = code + (a >= bound if tie_up else a > bound).astype(jnp.uint8)
  return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


def e2m1_decode(code):
  mag = jnp.asarray(E2M1_GRID)[(code & 7).astype(jnp.int32)]
  return jnp.where((code & 8) != 0, -mag, mag)


def quantize_nvfp4(x, global_scale):
  """``x [..., D]`` -> (packed e2m1 uint8 ``[..., D/2]``, e4m3 scales ``[..., D/16]``).

  ``global_scale`` is k_scale (or v_scale), a float32 scalar: values are
  multiplied by ``gs = 1 / global_scale`` before quantizing.
  """
  x = x.astype(jnp.float32)
  gs = 1.0 / jnp.asarray(1.0 if global_scale is None else global_scale, jnp.float32)
  g = x.reshape(x.shape[:-1] + (x.shape[-1] // 16, 16))
  sf = jnp.clip(_times_inverse(gs * jnp.max(jnp.abs(g), -1), 6.0), 0, E4M3_MAX)
  sf = sf.astype(jnp.float8_e4m3fn)
  sf32 = sf.astype(jnp.float32)[..., None]
  y = jnp.where(sf32 == 0, 0.0, (g * gs) * (1.0 / jnp.where(sf32 == 0, 1.0, sf32)))
  code = e2m1_encode(y).reshape(x.shape)
  packed = code[..., 0::2] | (code[..., 1::2] << 4)
  return packed, sf


def dequantize_nvfp4(packed, sf, global_scale):
  """Inverse of :func:`quantize_nvfp4`: float32 ``[..., D]``."""
  gscale = jnp.asarray(1.0 if global_scale is None else global_scale, jnp.float32)
  codes = jnp.stack([packed & 0xF, packed >> 4], -1).reshape(
      packed.shape[:-1] + (2 * packed.shape[-1],))
  vals = e2m1_decode(codes)
  g = vals.reshape(vals.shape[:-1] + (sf.shape[-1], 16))
  out = g * sf.astype(jnp.float32)[..., None] * gscale
  return out.reshape(vals.shape)


def nvfp4_v_swizzle_index(block_size: int, num_scales: int) -> np.ndarray:
  """Flat position of logical (t, s) inside a V scale tile of ``block_size x num_scales``.

  ``((t // 4)·4 + s // (S/4))·S + (s % (S/4))·4 + t % 4`` (spec §5); needs S % 4 == 0.
  Returns int ``[N, S]``; the tile is ``tile.flat[idx[t, s]] = scale[t, s]``.
  """
  n, s_ = block_size, num_scales
  if s_ % 4 or n % 4:
    raise ValueError(f"V scale swizzle needs block_size % 4 == 0 and D/16 % 4 == 0, got "
                     f"block_size={n}, D/16={s_}")
  t = np.arange(n)[:, None]
  s = np.arange(s_)[None, :]
  q = s_ // 4
  return ((t // 4) * 4 + s // q) * s_ + (s % q) * 4 + t % 4


def nvfp4_v_scales_swizzled(block_size: int, num_scales: int) -> bool:
  """Whether V scales of this geometry are swizzled (S % 4 == 0), else stored linearly."""
  return num_scales % 4 == 0
