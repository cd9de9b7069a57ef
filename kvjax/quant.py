"""Number formats of the cache, pure jnp: the one place each formula is written.

Everything here is elementwise (or a reduction over the last axis) and uses only what the
Pallas Triton lowering also lowers (selects, floor, integer shifts, equal-width bitcasts), so
the reference and the kernels call the *same* functions and store the same bits.

Row functions work on any leading shape: ``x [..., D]`` is one (token, head) row per leading
index. Divisions are written as multiplications by a float32 reciprocal (``x * (1/s)``,
``a * f32(1/15)``): that is the form XLA's algebraic simplifier turns ``x / s`` into under
``jit``, so writing it out makes eager, jitted and kernel results the same bits. Reciprocals
``1 / s`` are IEEE (kernels emit ``div.rn.f32``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SCALE_EPS = 1e-6
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_U32 = jnp.uint32


# -- arithmetic ----------------------------------------------------------------------------------
def div_const(x, c: float):
  """``x / c`` for a literal ``c`` as XLA computes it under jit: ``x * f32(1 / c)``."""
  return x * (np.float32(1.0) / np.float32(c))


def round_half_away_from_zero(v):
  """``sign(v) * floor(|v| + 0.5)`` (the sign set by a select: Triton negates as 0 - x).

  The same bits as vLLM's ``v + 0.5`` (``v - 0.5`` below 0) truncated by a float -> int
  conversion: both round ``|v| + 0.5`` in float32 first (so 0.49999997 rounds to 1)."""
  r = jnp.floor(jnp.abs(v) + 0.5)
  return jnp.where(v < 0, -r, r)


def round_clip_unsigned(v, hi: float, dtype=None, to_uint=None):
  """``clip(round_half_away_from_zero(v), 0, hi)`` for an integer ``hi > 0``, as the cheaper
  ``floor(clip(v + 0.5, 0, hi))``: the same bits (below zero both give 0; above it
  :func:`round_half_away_from_zero` is ``floor(v + 0.5)``, and ``floor`` commutes with
  clipping to integers). ``dtype``: an unsigned integer type to convert to (the conversion
  truncates, which is the floor of a non-negative value), else float32. ``to_uint``: a
  float32 -> uint32 conversion that truncates and saturates below at 0 (a kernel's
  one-instruction form), which makes the lower clip its own."""
  if dtype is None:
    return jnp.floor(jnp.clip(v + 0.5, 0.0, hi))
  if to_uint is None:
    return jnp.clip(v + 0.5, 0.0, hi).astype(jnp.uint32).astype(dtype)
  return to_uint(jnp.minimum(v + 0.5, hi)).astype(dtype)


def clamp(v, lo: float, hi: float):
  """``v`` clipped to ``[lo, hi]`` with NaN kept NaN, as XLA's clamp: two selects.

  Not ``jnp.clip``: the Pallas Triton lowering turns float ``max`` / ``min`` into the
  NaN-dropping ``max.f32`` / ``min.f32`` of PTX, so a clipped NaN would become ``lo`` on a GPU
  and ``NaN`` on a CPU (docs/edges.md: a NaN stays NaN)."""
  return jnp.where(v < lo, lo, jnp.where(v > hi, hi, v))


def at_least(v, lo: float):
  """``max(v, lo)`` with NaN kept NaN on every backend (see :func:`clamp`)."""
  return jnp.where(v < lo, lo, v)


def abs_max(*xs, axis, keepdims: bool = False):
  """Largest magnitude of the arrays ``xs`` (one shape) along ``axis`` (an int or a tuple,
  reduced last axis first), float32; NaN wherever a reduced element is NaN.

  Taken as an integer maximum of the bits of ``|x|`` (int32: for non-negative floats the
  integer order is the float order, and every NaN lies above +Inf), the same number as
  ``max(|x|)`` on finite data, on every backend: a float maximum would drop NaN in Pallas
  Triton kernels (see :func:`clamp`)."""
  m = None
  for x in xs:
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & jnp.int32(0x7FFFFFFF)
    m = bits if m is None else jnp.maximum(m, bits)
  axes = (axis,) if isinstance(axis, int) else tuple(axis)
  for ax in sorted((a % m.ndim for a in axes), reverse=True):
    m = jnp.max(m, axis=ax, keepdims=keepdims)
  return jax.lax.bitcast_convert_type(m, jnp.float32)


def finite_max(dtype) -> float:
  return float(jnp.finfo(dtype).max)


# -- storage bits ------------------------------------------------------------------------------
_UINT_OF_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def bits_dtype(dtype) -> np.dtype:
  """The unsigned integer dtype as wide as ``dtype`` (what writers move bytes as)."""
  return _UINT_OF_SIZE[np.dtype(dtype).itemsize]


def to_bits(x):
  """``x`` reinterpreted as :func:`bits_dtype` (free). Writers scatter bits, never floats:
  XLA may canonicalize the NaN payload of a float it passes through (bf16 and fp8_e5m2
  scatters on CPU do), and bytes a write does not name must keep every bit."""
  bt = bits_dtype(x.dtype)
  return x if np.dtype(x.dtype) == bt else jax.lax.bitcast_convert_type(x, bt)


def from_bits(x, dtype):
  """Inverse of :func:`to_bits` (also any equal-width reinterpretation)."""
  return x if np.dtype(x.dtype) == np.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def scale_to_storage(scale, storage_dtype):
  """float32 ``[...]`` -> its 4 bytes as ``[..., 4 // itemsize]`` storage elements."""
  return jax.lax.bitcast_convert_type(scale, storage_dtype)


def scale_from_storage(raw):
  """``[..., 4 // itemsize]`` storage elements -> float32 ``[...]``."""
  if raw.dtype.itemsize == 4:
    return jax.lax.bitcast_convert_type(raw[..., 0], jnp.float32)
  return jax.lax.bitcast_convert_type(raw, jnp.float32)


# -- global (per-tensor) scales --------------------------------------------------------------------
def per_head_scales(scale, num_heads: int):
  """A global scale (None = 1.0, a scalar or ``[H]``) as float32 ``[H]``."""
  s = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
  return jnp.broadcast_to(s.reshape(-1) if s.ndim else s, (num_heads,))


def per_head_scale(scale, num_heads: int):
  """:func:`per_head_scales` shaped ``[H, 1]`` (pallas_kernels.mosaic_tpu's name for it)."""
  return per_head_scales(scale, num_heads)[:, None]


# -- fp8 per tensor --------------------------------------------------------------------------
def to_fp8(v, fp8_dtype, cast_saturates: bool = False):
  """float32 ``v`` -> ``fp8_dtype``, saturated at +-its largest finite value, NaN kept NaN.

  ``cast_saturates``: the conversion does both itself, so the clamp is left out (same bits):
  PTX's only float32 -> fp8 conversion is ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32``, what
  compiled Triton kernels emit. XLA's conversion does not saturate (500 becomes NaN in e4m3fn,
  61440 inf in e5m2), so the reference and interpret mode clamp."""
  if not cast_saturates:
    m = finite_max(fp8_dtype)
    v = clamp(v, -m, m)
  return v.astype(fp8_dtype)


def quantize_fp8_per_tensor(x, scale, fp8_dtype):
  """``x [..., H, D]`` -> fp8 ``x / scale`` (scale: None, scalar or ``[H]``), saturated."""
  inv = 1.0 / per_head_scales(scale, x.shape[-2])[:, None]
  return to_fp8(x.astype(jnp.float32) * inv, fp8_dtype)


def dequantize_fp8_per_tensor(q, scale):
  return q.astype(jnp.float32) * per_head_scales(scale, q.shape[-2])[:, None]


# -- per token-head: int8 / fp8 ------------------------------------------------------------------
def row_scale(amax, qmax: float):
  """Per-token-head scale ``max(amax / QMAX, eps)`` of a row with largest magnitude ``amax``
  (NaN for a NaN ``amax``: the whole row then reads NaN)."""
  return at_least(div_const(amax, qmax), SCALE_EPS)


def quantize_scaled(y, quant, qmax: float, cast_saturates: bool = False):
  """Values already divided by their row scale -> quantized (int8: round half away from zero
  and clamp to [-128, 127]; fp8: clamp to +-QMAX, its largest finite value, and cast).

  Divided by ``amax / QMAX``, a finite row has ``|y| <= QMAX * (1 + 2**-21)``: the clamps
  never change a finite value's code, they only pin NaN rows (whose scale is NaN, so they
  read NaN whatever the codes). ``cast_saturates``: as :func:`to_fp8`; for int8 PTX's
  float -> integer conversions saturate too, so compiled kernels convert directly.
  int8 clamps as integers (no float min / max, see :func:`clamp`)."""
  if np.dtype(quant) == np.dtype(np.int8):
    r = round_half_away_from_zero(y)
    if cast_saturates:
      return r.astype(jnp.int8)
    return jnp.clip(r.astype(jnp.int32), -128, 127).astype(jnp.int8)
  assert qmax == finite_max(quant), (quant, qmax)
  return to_fp8(y, quant, cast_saturates)


def quantize_per_token_head(x, fmt):
  """int8 / fp8, one scale per row. ``x [..., D]`` -> (data ``[..., D]`` in the storage
  dtype, scale float32 ``[...]``). ``fmt``: a format (or codec) with ``quant``, ``qmax`` and
  ``storage``. (int4: :func:`quantize_int4`.)"""
  x = x.astype(jnp.float32)
  scale = row_scale(abs_max(x, axis=-1), fmt.qmax)
  q = quantize_scaled(x * (1.0 / scale)[..., None], fmt.quant, fmt.qmax)
  return from_bits(q, fmt.storage), scale


def dequantize_per_token_head(data, scale, fmt):
  """Inverse of :func:`quantize_per_token_head`: float32 ``[..., D]``."""
  return from_bits(data, fmt.quant).astype(jnp.float32) * scale[..., None]


# -- int4 per token-head -------------------------------------------------------------------------
def int4_scale(lo, hi):
  """int4 row scale ``max((max - min) / 15, eps)`` from the row's min and max, float32.

  ``/ 15`` is ``* f32(1/15)`` (:func:`div_const`), as XLA computes it under jit and as
  Triton's ``div.full.f32`` computes vLLM's ``(max - min) / 15.0`` on the GPU. ``max - min``
  overflows when the (rotated) row's extremes pass +-1.7e38 (docs/edges.md). A NaN
  anywhere in a row makes every rotated value NaN, so ``lo`` and ``hi`` are NaN even where a
  kernel's minimum / maximum drops NaN, and the scale is NaN (:func:`at_least`).
  """
  return at_least(div_const(hi - lo, 15.0), SCALE_EPS)


def int4_zero_point(lo, inv_scale):
  """``clamp(round(-min * (1/scale)), 0, 15)`` rounded half away from zero, float32."""
  return round_clip_unsigned(-lo * inv_scale, 15.0)


def int4_codes(x, inv_scale, zp, dtype=jnp.uint8, to_uint=None):
  """``clamp(round(x * (1/scale) + zp), 0, 15)`` rounded half away from zero, as ``dtype``
  (an unsigned integer type; ``to_uint`` as in :func:`round_clip_unsigned`).

  ``x * (1/scale) + zp`` is meant as one fused multiply-add: XLA contracts it under jit and
  Triton on the GPU (vLLM's writer and ours alike).
  """
  return round_clip_unsigned(x * inv_scale + zp, 15.0, dtype, to_uint)


def int4_pack_scale(scale, zp):
  """The stored float32: ``scale`` with the 4-bit zero point in its low mantissa bits."""
  bits = jax.lax.bitcast_convert_type(scale, _U32)
  bits = (bits & _U32(0xFFFFFFF0)) | zp.astype(_U32)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def int4_unpack_scale(stored):
  """Inverse of :func:`int4_pack_scale`: (scale, zero point), both float32."""
  bits = jax.lax.bitcast_convert_type(stored, _U32)
  zp = (bits & _U32(0xF)).astype(jnp.float32)
  return jax.lax.bitcast_convert_type(bits & _U32(0xFFFFFFF0), jnp.float32), zp


def nibbles(packed):
  """uint8 (or uint16) ``[...]`` -> its 4-bit codes from the low bits up, uint8 in [0, 15]:
  (low, high) of a byte, the low nibble holding the even element; four of a uint16 word
  (little-endian: its low byte first)."""
  t = packed.dtype.type
  return tuple(((packed >> t(s)) & t(0xF)).astype(jnp.uint8)
               for s in range(0, 8 * packed.dtype.itemsize, 4))


def interleave(even, odd):
  """``[..., n]`` even and odd elements -> ``[..., 2n]``."""
  return jnp.stack([even, odd], axis=-1).reshape(even.shape[:-1] + (2 * even.shape[-1],))


@jax.jit
def quantize_int4(x):
  """``x [..., D]`` float32 -> (packed uint8 ``[..., D/2]``, stored scale float32 ``[...]``).

  vLLM's int4 quantizer: ``r = 1/scale`` (one IEEE reciprocal, where vLLM's GPU code divides
  with ``div.full.f32``, i.e. multiplies by an approximate reciprocal), zero point and codes
  from :func:`int4_zero_point` and :func:`int4_codes`. Jitted, so that eager calls contract
  ``x * r + zp`` into an fma as jitted ones do (same bits either way).
  """
  lo, hi = jnp.min(x, -1), jnp.max(x, -1)
  scale = int4_scale(lo, hi)
  r = 1.0 / scale
  zp = int4_zero_point(lo, r)
  q = int4_codes(x, r[..., None], zp[..., None])
  return q[..., 0::2] | (q[..., 1::2] << jnp.uint8(4)), int4_pack_scale(scale, zp)


def dequantize_int4(packed, stored_scale):
  """Inverse of :func:`quantize_int4`: ``(q - zp) * scale``, float32 ``[..., D]``."""
  scale, zp = int4_unpack_scale(stored_scale)
  q = interleave(*nibbles(packed)).astype(jnp.float32)
  return (q - zp[..., None]) * scale[..., None]


# -- exact float16 operands for the kernels' dots --------------------------------------------------
# Every quantized value (int8, int4 codes, e2m1, e4m3) is exact in float16, so the attention
# kernels feed their tensor-core dots float16 operands. These build them from the stored bits
# with integer ops (float16 1024 has an ulp of 1, so bits ``0x6400 | n`` hold ``1024 + n``
# exactly for n < 1024) instead of per-element integer-to-float conversions.
F16_MAX = 65504.0
_U16 = jnp.uint16


def biased_f16(n, flip: int = 0):
  """uint8 ``n`` -> float16 ``1024 + (n ^ flip)`` (exact), built from its bits: one xor of the
  widened byte with ``0x6400 | flip`` (``flip`` < 256)."""
  return jax.lax.bitcast_convert_type(n.astype(_U16) ^ _U16(0x6400 | flip), jnp.float16)


def int8_to_f16(x):
  """int8 -> float16, exact: ``1024 + (x + 128) - 1152``, with ``x + 128`` the byte ``x ^ 0x80``."""
  return biased_f16(jax.lax.bitcast_convert_type(x, jnp.uint8), 0x80) - jnp.float16(1152.0)


def nibbles_to_f16(packed):
  """uint8 bytes of two int4 codes -> (low code, 16 x high code) as float16, exact: each
  nibble masked in place into the mantissa of 1024 (the high one stays 4 bits up, so it
  carries a factor 16 that the caller divides out of its float32 dot product), then 1024
  subtracted."""
  w = packed.astype(_U16)
  lo = jax.lax.bitcast_convert_type((w & _U16(0x0F)) | _U16(0x6400), jnp.float16)
  hi = jax.lax.bitcast_convert_type((w & _U16(0xF0)) | _U16(0x6400), jnp.float16)
  return lo - jnp.float16(1024.0), hi - jnp.float16(1024.0)


def e2m1_pair_to_f16(packed):
  """uint8 bytes of two e2m1 codes -> (low, high) values as float16, exact, from their bits:
  a code's 3 magnitude bits placed at float16 bits 9-11 give ``value * 2**-14`` for every
  code (e = 0 lands on the float16 subnormals, as e2m1's own subnormal 0.5 does), its sign
  bit goes to bit 15, then one exact power-of-two scaling. Same values as
  :func:`e2m1_decode`."""
  w = packed.astype(_U16)
  lo = ((w << _U16(9)) & _U16(0x0E00)) | ((w << _U16(12)) & _U16(0x8000))
  hi = ((w << _U16(5)) & _U16(0x0E00)) | ((w << _U16(8)) & _U16(0x8000))
  return tuple(jax.lax.bitcast_convert_type(b, jnp.float16) * jnp.float16(16384.0)
               for b in (lo, hi))


def to_f16_saturating(x):
  """Any float -> float16, clamped to float16's finite range (a bfloat16 query beyond it
  would otherwise become inf)."""
  return clamp(x.astype(jnp.float32), -F16_MAX, F16_MAX).astype(jnp.float16)


# -- nvfp4 -------------------------------------------------------------------------------------
def e2m1_encode(y):
  """float32 -> 4-bit e2m1 code (uint32 in [0, 15]), round to nearest even, saturating
  (|y| >= 6, inf and NaN give 6.0's code 7), y's sign bit as bit 3.

  e2m1's grid is uniform on three pieces and its codes count along it: ``2a`` on [0, 2],
  ``a + 2`` on [2, 4], ``a / 2 + 4`` on [4, 6] (``a = min(|y|, 6)``). The code is the lower
  envelope of the three lines, so (rounding being monotone) it is the smallest of the three
  rounded to integers. Rounding a float32 below 2**22 to an integer is adding 2**23 (no
  fraction survives); each piece's offset goes into that constant. ``2a`` and ``a / 2`` are
  exact: one rounding a piece, nothing for a compiler to reassociate. Ties to an even integer
  are e2m1's ties to an even code (a code's low bit is its mantissa bit).
  """
  bits = jax.lax.bitcast_convert_type(y, _U32)
  a = jax.lax.bitcast_convert_type(jnp.minimum(bits & _U32(0x7FFFFFFF), _U32(0x40C00000)),
                                   jnp.float32)                            # min(|y|, 6.0)
  pieces = [jax.lax.bitcast_convert_type(a * np.float32(k) + np.float32(2**23 + off), _U32)
            for k, off in ((2.0, 0), (1.0, 2), (0.5, 4))]
  code = jnp.minimum(jnp.minimum(pieces[0], pieces[1]), pieces[2])      # 2**23 + code
  sign = bits >> _U32(28)                                   # sign bit at bit 3, below it < 8
  return sign ^ ((code ^ sign) & _U32(7))                 # code's low bits, the sign above


def e2m1_decode(code):
  """e2m1 code (uint8, low 4 bits) -> float32, built from its bits (no lookup): exponent
  e = bits 1-2, mantissa m = bit 0; e > 0 is ``2**(e-1) * (1 + m/2)``, i.e. float32 exponent
  ``e + 126`` with m as the top mantissa bit; e = 0 is 0 or 0.5. The sign is set as a bit
  (code 8 is -0.0)."""
  c = code.astype(_U32)
  e = (c >> _U32(1)) & _U32(3)
  m = c & _U32(1)
  normal = ((e + _U32(126)) << _U32(23)) | (m << _U32(22))
  bits = jnp.where(e > _U32(0), normal, m * _U32(0x3F000000))
  return jax.lax.bitcast_convert_type(bits | ((c & _U32(8)) << _U32(28)), jnp.float32)


def nvfp4_group_scale(amax, gs, cast_saturates: bool = False):
  """e4m3 scale of a 16-value group: ``e4m3(gs * amax / 6)`` (``gs = 1 / global scale``),
  saturated at 448 (an Inf in the group), NaN for a NaN ``amax`` (the group reads NaN).
  ``cast_saturates``: as :func:`to_fp8`."""
  return to_fp8(div_const(gs * amax, 6.0), jnp.float8_e4m3fn, cast_saturates)


def nvfp4_recip(sf32, recip=None):
  """(``1 / sf`` with 1 for a zero scale, where the scale is zero) of float32 group scales;
  ``recip``: the kernel's IEEE reciprocal (default ``1.0 / x``)."""
  zero = sf32 == 0
  safe = jnp.where(zero, 1.0, sf32)
  return (1.0 / safe if recip is None else recip(safe)), zero


def nvfp4_pack(even, odd, gs, r, zero):
  """Bytes of e2m1 code pairs: value ``x`` becomes ``e2m1((x * gs) * r)`` (``r`` its group's
  :func:`nvfp4_recip`), even-index values in the low nibble; 0 in groups whose scale is zero.
  Arrays broadcast together; returns uint8."""
  packed = (e2m1_encode((even * gs) * r) | (e2m1_encode((odd * gs) * r) << _U32(4)))
  return jnp.where(zero, _U32(0), packed).astype(jnp.uint8)


def quantize_nvfp4(x, global_scale):
  """``x [..., D]`` -> (packed e2m1 uint8 ``[..., D/2]``, e4m3 scales ``[..., D/16]``).

  ``global_scale`` is k_scale (or v_scale), a float32 scalar: values are
  multiplied by ``gs = 1 / global_scale`` before quantizing.
  """
  x = x.astype(jnp.float32)
  gs = 1.0 / jnp.asarray(1.0 if global_scale is None else global_scale, jnp.float32)
  g = x.reshape(x.shape[:-1] + (x.shape[-1] // 16, 8, 2))
  sf = nvfp4_group_scale(abs_max(g, axis=(-2, -1)), gs)
  r, zero = nvfp4_recip(sf.astype(jnp.float32)[..., None])
  packed = nvfp4_pack(g[..., 0], g[..., 1], gs, r, zero)
  return packed.reshape(x.shape[:-1] + (x.shape[-1] // 2,)), sf


def dequantize_nvfp4(packed, sf, global_scale):
  """Inverse of :func:`quantize_nvfp4`: ``e2m1 * sf * global_scale``, float32 ``[..., D]``."""
  gscale = jnp.asarray(1.0 if global_scale is None else global_scale, jnp.float32)
  vals = e2m1_decode(interleave(*nibbles(packed)))
  g = vals.reshape(vals.shape[:-1] + (sf.shape[-1], 16))
  out = g * sf.astype(jnp.float32)[..., None] * gscale
  return out.reshape(vals.shape)


def nvfp4_v_scales_swizzled(block_size: int, num_scales: int) -> bool:
  """Whether V scales of this geometry are swizzled (S % 4 == 0), else stored linearly."""
  return num_scales % 4 == 0


def nvfp4_v_scale_position(t, s, num_scales: int):
  """Position of V scale (token ``t``, group ``s``) in its block's ``N x S`` scale tile.

  Swizzled (S % 4 == 0): ``((t // 4)*4 + s // (S/4))*S + (s % (S/4))*4 + t % 4``; else
  linear ``t*S + s``. Plain integer arithmetic: numpy, jnp and in-kernel alike.
  """
  if not nvfp4_v_scales_swizzled(0, num_scales):
    return t * num_scales + s
  q = num_scales // 4
  return ((t // 4) * 4 + s // q) * num_scales + (s % q) * 4 + t % 4


def nvfp4_v_swizzle_index(block_size: int, num_scales: int) -> np.ndarray:
  """int ``[N, S]`` table of :func:`nvfp4_v_scale_position` for a swizzled geometry:
  the tile is ``tile.flat[idx[t, s]] = scale[t, s]``."""
  if num_scales % 4 or block_size % 4:
    raise ValueError(f"V scale swizzle needs block_size % 4 == 0 and D/16 % 4 == 0, got "
                     f"block_size={block_size}, D/16={num_scales}")
  return nvfp4_v_scale_position(np.arange(block_size)[:, None], np.arange(num_scales)[None, :],
                                num_scales)
