"""In-kernel arithmetic for the cache write / dequantize kernels, bit-exact with ``kvjax.quant``.

Everything here runs inside a Pallas kernel body, under the Triton lowering on GPU
or in interpret mode on CPU, so it only uses what the Triton lowering supports:
elementwise ops, selects, equal-width bitcasts and integer shifts. Where the Triton
lowering would differ from XLA it is worked around:

- float32 division: Triton lowers ``/`` to ``div.full.f32`` (approximate, up to 2 ulp);
  XLA divides with IEEE rounding. :meth:`KernelMath.div` emits ``div.rn.f32`` on GPU.
- XLA's algebraic simplifier rewrites divisions (under ``jit``, and eagerly inside one jnp
  op): ``x / c`` for a literal ``c`` becomes ``x * f32(1/c)`` and ``x / broadcast(s)``
  becomes ``x * broadcast(1/s)``. Neither is bit-identical to a true division, so the
  reference computes e.g. ``(max - min) * f32(1/15)`` and ``x * (1/scale)[..., None]``.
  The kernels write those forms explicitly (:func:`div_const`, :meth:`KernelMath.recip`).
- ``jnp.round`` (half to even) has no Triton lowering: :func:`round_half_even` builds
  it from ``floor`` exactly.
- the e2m1 decode table becomes a select chain; float32 <-> 4 bytes uses shifts.
- float negation lowers to ``0 - x`` (so -(+0.0) is +0.0): signs are set as bits.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import quant

_U32 = jnp.uint32


@dataclasses.dataclass(frozen=True)
class KernelMath:
  """How arithmetic is emitted: ``gpu=True`` under the Triton lowering, False in interpret mode."""
  gpu: bool

  def div(self, x, y):
    """IEEE round-to-nearest float32 ``x / y`` (same bits as XLA's divide)."""
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.float32)
    if not self.gpu:
      return x / y
    from jax.experimental.pallas import triton as pltriton
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    x, y = jnp.broadcast_to(x, shape), jnp.broadcast_to(y, shape)
    [out] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out

  def recip(self, s):
    """``1 / s`` rounded to nearest (what XLA hoists out of ``x / broadcast(s)``)."""
    return self.div(jnp.ones_like(s), s)


def div_const(x, c: float):
  """``x / c`` for a literal ``c`` as XLA computes it under jit: ``x * f32(1 / c)``."""
  return x * (np.float32(1.0) / np.float32(c))


def round_half_even(v):
  """``jnp.round`` (ties to even) of float32 ``v``, exact, from ``floor`` only."""
  f = jnp.floor(v)
  d = v - f                                   # exact: v and floor(v) share the binade
  odd = (f - 2.0 * jnp.floor(f * 0.5)) == 1.0
  up = (d > 0.5) | ((d == 0.5) & odd)
  return jnp.where(up, f + 1.0, f)


def round_half_away(v):
  """``sign(v) * floor(|v| + 0.5)`` as in ``kvjax.quant.round_half_away_from_zero``."""
  r = jnp.floor(jnp.abs(v) + 0.5)
  return jnp.where(v < 0, -r, r)


def f32_to_bytes(x):
  """float32 ``[...]`` -> uint8 ``[..., 4]`` (little endian, as ``bitcast_convert_type``)."""
  bits = jax.lax.bitcast_convert_type(x, _U32)
  shifts = jnp.arange(4, dtype=_U32) * _U32(8)
  return ((bits[..., None] >> shifts) & _U32(0xFF)).astype(jnp.uint8)


def bytes_to_u32(b0, b1, b2, b3):
  """Four uint8 arrays (little endian) -> uint32."""
  return (b0.astype(_U32) | (b1.astype(_U32) << _U32(8)) | (b2.astype(_U32) << _U32(16))
          | (b3.astype(_U32) << _U32(24)))


def to_u8(x):
  """Reinterpret an 8-bit integer/float array as uint8 (equal-width bitcast)."""
  if x.dtype == jnp.uint8:
    return x
  return jax.lax.bitcast_convert_type(x, jnp.uint8)


def from_u8(x, dtype):
  """Reinterpret uint8 as another 8-bit dtype (equal-width bitcast)."""
  if np.dtype(dtype) == np.dtype(np.uint8):
    return x
  return jax.lax.bitcast_convert_type(x, dtype)


def signbit_u8(x):
  """1 where float32 ``x`` has its sign bit set (also -0.0), else 0, as uint8."""
  return (jax.lax.bitcast_convert_type(x, _U32) >> _U32(31)).astype(jnp.uint8)


def e2m1_encode(y):
  """float32 -> e2m1 code in [0, 15] (uint8); same codes as ``quant.e2m1_encode``.

  Round to nearest even on the e2m1 grid with few instructions: below 1 the grid is
  {0, 0.5, 1} (two comparisons); from 1 up, e2m1 is float32 rounded to one mantissa bit
  (add the round-to-even bias to the bits, keep exponent and top mantissa bit), saturating
  at code 7 (6.0). Integer-only on the bits, so no compiler can reassociate it.
  """
  a = jnp.abs(y)
  sub = ((a > np.float32(0.25)).astype(_U32) + (a >= np.float32(0.75)).astype(_U32))
  bits = jax.lax.bitcast_convert_type(a, _U32)
  lsb = (bits >> _U32(22)) & _U32(1)
  top = (bits + _U32(0x1FFFFF) + lsb) >> _U32(22)                     # (exp << 1) | mantissa
  norm = jnp.minimum(top, _U32(259)) - _U32(252)                      # 1.0 -> 2 ... 6.0 -> 7
  code = jnp.where(a < np.float32(1.0), sub, norm).astype(jnp.uint8)
  return code | (signbit_u8(y) << jnp.uint8(3))


def e2m1_decode(code):
  """e2m1 code (uint8, low 4 bits) -> float32, a select chain over the 8 magnitudes.

  The sign goes in as a bit: the Triton lowering negates floats as ``0 - x``, which
  turns -0.0 (code 8) into +0.0.
  """
  m = code & jnp.uint8(7)
  mag = jnp.zeros(code.shape, jnp.float32)
  for i, val in enumerate(quant.E2M1_GRID.tolist()):
    if val:
      mag = jnp.where(m == i, jnp.float32(val), mag)
  sign = (code & jnp.uint8(8)).astype(_U32) << _U32(28)
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(mag, _U32) | sign,
                                      jnp.float32)


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (Triton blocks need power-of-2 element counts)."""
  return 1 << max(0, int(n) - 1).bit_length()
