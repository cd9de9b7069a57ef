"""Helpers every kernel backend shares: sizes, float32 <-> bytes without a bitcast, the dot
operand dtype rule, and the XLA merge of split-KV partials.

Number-format formulas (rounding, e2m1, int4 nibbles and scales, the nvfp4 V-scale swizzle)
are in :mod:`kvjax.quant`, shared with the reference; row addresses in
:class:`kvjax.codecs.RowAddress`. What is here lowers in the Pallas Triton lowering and in
interpret mode alike: integer shifts, equal-width bitcasts, selects.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import quant

_U32 = jnp.uint32


def gpu_sm_count(default: int) -> int:
  """Streaming multiprocessors of this process's first GPU (its ``core_count``), or
  ``default`` where there is no GPU (a kernel lowered for CUDA on a CPU host). Sizes grids."""
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return default
  return int(getattr(gpus[0], "core_count", 0) or default)


def gpu_device_kind() -> str:
  """This process's first GPU's ``device_kind`` (e.g. "NVIDIA H200"), "" without one.
  Selects the per-GPU rows of the tuning tables."""
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return ""
  return str(getattr(gpus[0], "device_kind", ""))


@functools.cache
def triton_lowering_available() -> bool:
  """Whether this JAX has Pallas' Triton lowering (deprecated in JAX 0.11): the Mosaic GPU
  ``auto`` rules weigh their kernels against the Triton ones only while it exists."""
  try:
    from jax.experimental.pallas import triton  # noqa: F401  pylint: disable=unused-import
  except ImportError:
    return False
  return True


def cdiv(a: int, b: int) -> int:
  """``ceil(a / b)`` for Python ints."""
  return -(-a // b)


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (and 1 for n <= 1): Triton blocks need power-of-2 sizes."""
  return 1 << max(0, int(n) - 1).bit_length()


def f32_to_bytes(x):
  """float32 ``[...]`` -> uint8 ``[..., 4]`` (little endian, as ``bitcast_convert_type``)."""
  bits = jax.lax.bitcast_convert_type(x, _U32)
  shifts = jnp.arange(4, dtype=_U32) * _U32(8)
  return ((bits[..., None] >> shifts) & _U32(0xFF)).astype(jnp.uint8)


def pack_words(codes, bits: int):
  """Unsigned codes ``[..., 32 // bits]`` of ``bits`` bits each -> uint32 words ``[...]``,
  code ``i`` in bits ``[i * bits, (i + 1) * bits)``: the little-endian word the codes' bytes
  make (bits 8: byte ``i`` of the word; bits 4: low nibble = even code)."""
  shifts = jnp.arange(32 // bits, dtype=jnp.int32) * bits
  # int32: Triton reduces signless integers only; the codes' bits never overlap, so the sum
  # is their bitwise or, whatever the sign bit
  placed = jax.lax.bitcast_convert_type(codes.astype(_U32), jnp.int32) << shifts
  return jax.lax.bitcast_convert_type(jnp.sum(placed, axis=-1, dtype=jnp.int32), _U32)


def f32_from_bytes(load_byte):
  """The float32 held little-endian in 4 one-byte elements; ``load_byte(i)`` loads byte ``i``
  (any integer dtype, any shape) and the result has its shape."""
  bits = None
  for i in range(4):
    b = (load_byte(i).astype(jnp.int32) & 0xFF) << (8 * i)
    bits = b if bits is None else bits | b
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def words_view(table, dtype):
  """A 2-D table of one-byte elements ``[R, E]`` viewed as ``dtype`` words ``[R, E / k]``
  (k = its item size; E a multiple of k): an XLA bitcast of the same bytes (no copy,
  checked on a GPU), for kernels that read 2- or 4-byte units stored among byte data
  with one load (float32 scales; uint16 pairs of codes)."""
  r, e = table.shape
  k = np.dtype(dtype).itemsize
  return jax.lax.bitcast_convert_type(table.reshape(r, e // k, k), dtype)


def float32_words(table):
  """:func:`words_view` as float32 words."""
  return words_view(table, jnp.float32)


#: The 16-bit float dtypes the kernels take as dot operands.
SIXTEEN_BIT = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def compute_dtype(codec, storage, q_dtype) -> np.dtype:
  """Dot operand dtype, one rule for every kernel of every GPU backend.

  Quantized caches (fp8, int8, int4 codes, e2m1 x e4m3) with 16-bit queries: float16. Every
  dequantized value (before scales) is exact in it, fp8 and the integer codes convert to it
  in fewer instructions than to bfloat16 (e4m3 -> float16 is one conversion per two values
  on Hopper; bfloat16 goes through float32), and its 10 mantissa bits hold q and the softmax
  weights more precisely than bfloat16's 7. Queries are clamped to float16's range.
  An unquantized cache computes in its own dtype when q has it, else in float32 (a float32
  or float16 cache read with bfloat16 queries).
  """
  q_dtype = np.dtype(q_dtype)
  if q_dtype in SIXTEEN_BIT and codec.is_quantized:
    return np.dtype(np.float16)
  if q_dtype in SIXTEEN_BIT and np.dtype(storage) == q_dtype:
    return q_dtype
  return np.dtype(np.float32)


def as_operand(x, dtype):
  """``x`` (q, or a 16-bit tile) as a dot operand of ``dtype``; float16 operands are clamped
  to float16's range (a bfloat16 value beyond it would otherwise become inf)."""
  if np.dtype(dtype) == np.dtype(np.float16) and x.dtype != np.dtype(np.float16):
    return quant.to_f16_saturating(x)
  return x.astype(dtype)


def static_or_none(x):
  """``float(x)`` when ``x`` has a value now (a Python number or a concrete array); None when
  it is traced under ``jit`` (the kernels then read it from an operand)."""
  return None if isinstance(x, jax.core.Tracer) else float(x)


def merge_splits(acc, m, l, sinks, num_groups: int):
  """Combine split-KV partials into normalized outputs (XLA).

  acc ``[S, H, K, Gp, X]`` unnormalized ``sum_k exp(s_k - m) v_k``, m ``[S, H, K, Gp]`` the
  running max (natural-log domain), l the sums, float32; sinks float32 ``[H, G]`` or None.
  Returns float32 ``[S, H, G, X]``; rows with no visible key are 0.
  """
  acc, m, l = acc[..., :num_groups, :], m[..., :num_groups], l[..., :num_groups]
  m_max = jnp.max(m, axis=2)                                     # [S, H, G]
  if sinks is not None:
    m_max = jnp.maximum(m_max, sinks[None])
  wgt = jnp.exp(m - m_max[:, :, None])                           # [S, H, K, G]
  lsum = jnp.sum(wgt * l, axis=2)
  denom = lsum
  if sinks is not None:
    denom = denom + jnp.exp(sinks[None] - m_max)
  out = jnp.sum(wgt[..., None] * acc, axis=2)
  safe = jnp.where(lsum > 0, denom, 1.0)
  return jnp.where((lsum > 0)[..., None], out / safe[..., None], 0.0)
