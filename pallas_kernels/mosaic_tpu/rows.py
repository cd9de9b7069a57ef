"""The Mosaic TPU kernels' per-format hooks: each supported format's row, in-kernel.

A row is one (token, head) of the packed cache: ``C`` storage elements laid out
``[K data | K scale | V data | V scale]`` (the scale slots exist only for per-token-head
formats: 4 bytes holding a float32). The write kernel *encodes* rows, the attention kernel
*decodes* the K or V part of a page tile. Everything here runs inside a Mosaic TPU kernel
body (or its interpret-mode simulation): elementwise ops, lane slices, casts through
float32, same-width bitcasts and integer shifts only. The numbers are the formulas of
:mod:`kvjax.quant` themselves (the reference's), bit for bit.

:mod:`.adapters` picks the class of a codec: :class:`PlainRows`, :class:`Fp8Rows` (fp8 with
per-tensor scales), :class:`RowScaledRows` (int8 / fp8 data with a float32 scale a row) or
:class:`Int4Rows` (two int4 values a byte, a float32 scale with its zero point a row).

Formats that pack two values a byte keep even and odd head dims apart (``split_halves``): the
kernels see the head dim of q, K/V and the output permuted to ``[even dims | odd dims]``
(:func:`halves_order`, applied around the kernels), so a byte's low nibble belongs to the
first half and its high nibble to the second, and no lane ever needs interleaving.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import quant
from kvjax.spec import KVCacheSpec
from pallas_kernels.common import f32_from_bytes, f32_to_bytes


@dataclasses.dataclass(frozen=True)
class Rows:
  """Static geometry of one format's rows (base of the hook classes).

  Attributes:
    head_size: D. side: storage elements per side (D, or D + 4 bytes of scale).
    storage: the cache array's dtype. quant: the quantized dtype (per-token-head: int8 or
      e4m3 stored as uint8; None when not quantized). qmax: its largest magnitude.
  """
  head_size: int
  side: int
  storage: np.dtype
  quant: object
  qmax: float

  #: Whether k_scale / v_scale apply: the write kernel gets ``1 / scale`` per head, the
  #: attention kernel folds the scales into the scores and the output.
  tensor_scaled: ClassVar[bool] = False
  #: Whether each side ends in the 4 bytes of a float32 row scale.
  row_scaled: ClassVar[bool] = False
  #: Whether the kernels see head dims as ``[even | odd]`` (:func:`halves_order`).
  split_halves: ClassVar[bool] = False

  @classmethod
  def of(cls, spec: KVCacheSpec) -> "Rows":
    return cls(spec.head_size, spec.padded_head_size, spec.storage_dtype, spec.codec.quant,
               spec.codec.qmax)

  @property
  def width(self) -> int:
    """C: storage elements of a whole row."""
    return 2 * self.side

  def data_start(self, side: int) -> int:
    """First lane of side ``side``'s data (0 = K, 1 = V)."""
    return side * self.side

  @property
  def data_width(self) -> int:
    """Storage elements of one side's data (before its row scale, if any)."""
    return self.head_size

  def decode_parts(self, data, scale_bytes, dtype):
    """:meth:`decode_side` as ``[(first head dim, values [..., width])]``: the head-dim
    ranges the values fill (one range, or two where :attr:`split_halves`)."""
    return [(0, self.decode_side(data, scale_bytes, dtype))]

  def encode_side(self, x, recip=None):
    """One side of new tokens: ``x [..., D]`` (model dtype) -> (data ``[..., D]`` in the
    storage dtype, the row scale as 4 storage elements ``[..., 4]`` or None). recip: the
    per-tensor ``1 / scale`` broadcastable to x (computed outside the kernel exactly as the
    reference does), where :attr:`tensor_scaled`."""
    raise NotImplementedError

  def decode_side(self, data, scale_bytes, dtype):
    """K or V values of a tile: data ``[..., D]`` storage -> ``[..., D]`` in ``dtype``.
    scale_bytes: ``[..., 4]`` storage elements where :attr:`row_scaled` (else None);
    per-tensor scales are *not* applied here (the kernel folds them into scores / output)."""
    if np.dtype(data.dtype) == np.dtype(dtype):
      return data
    return data.astype(jnp.float32).astype(dtype)


@dataclasses.dataclass(frozen=True)
class PlainRows(Rows):
  """Values stored as they are, cast to the storage dtype."""

  def encode_side(self, x, recip=None):
    return x.astype(jnp.float32).astype(self.storage), None


@dataclasses.dataclass(frozen=True)
class Fp8Rows(Rows):
  """fp8 values of ``x / scale`` with per-tensor (or per-head) scales."""
  tensor_scaled: ClassVar[bool] = True

  def encode_side(self, x, recip=None):
    return quant.to_fp8(x.astype(jnp.float32) * recip, self.storage), None


@dataclasses.dataclass(frozen=True)
class RowScaledRows(Rows):
  """int8 / fp8 data of ``x / scale`` with ``scale = max(amax / qmax, 1e-6)`` a row, stored
  as 4 little-endian bytes after the data."""
  row_scaled: ClassVar[bool] = True

  def encode_side(self, x, recip=None):
    x = x.astype(jnp.float32)
    scale = quant.row_scale(quant.abs_max(x, axis=-1, keepdims=True), self.qmax)
    data = quant.quantize_scaled(x * (1.0 / scale), self.quant, self.qmax)
    return quant.from_bits(data, self.storage), self._scale_bytes(scale)

  def _scale_bytes(self, scale):
    """float32 ``[..., 1]`` -> its 4 little-endian bytes ``[..., 4]`` as storage elements."""
    return quant.from_bits(f32_to_bytes(scale[..., 0]), self.storage)

  def decode_side(self, data, scale_bytes, dtype):
    if self.quant == np.dtype(np.int8):
      vals = data.astype(jnp.float32)
    else:
      vals = jax.lax.bitcast_convert_type(data, self.quant).astype(jnp.float32)
    return (vals * self._scale_from_bytes(scale_bytes)).astype(dtype)

  @staticmethod
  def _scale_from_bytes(raw):
    """``[..., 4]`` 8-bit storage elements (little endian) -> float32 ``[..., 1]``."""
    b = quant.to_bits(raw)
    return f32_from_bytes(lambda i: b[..., i:i + 1])


@dataclasses.dataclass(frozen=True)
class Int4Rows(RowScaledRows):
  """int4 codes ``clamp(round(x / scale + zp), 0, 15)``, two a byte (low nibble: first half of
  the ``[even | odd]`` head dims), then the float32 scale with the zero point in its low 4
  mantissa bits (:func:`kvjax.quant.int4_pack_scale`)."""
  split_halves: ClassVar[bool] = True

  @property
  def data_width(self) -> int:
    return self.head_size // 2

  def encode_side(self, x, recip=None):
    x = x.astype(jnp.float32)                    # [..., D] as [even | odd]
    lo, hi = jnp.min(x, -1, keepdims=True), jnp.max(x, -1, keepdims=True)
    scale = quant.int4_scale(lo, hi)
    r = 1.0 / scale
    zp = quant.int4_zero_point(lo, r)
    codes = quant.int4_codes(x, r, zp)
    half = self.data_width
    packed = codes[..., :half] | (codes[..., half:] << jnp.uint8(4))
    return packed, self._scale_bytes(quant.int4_pack_scale(scale, zp))

  def decode_parts(self, data, scale_bytes, dtype):
    scale, zp = quant.int4_unpack_scale(self._scale_from_bytes(scale_bytes))
    return [(i * self.data_width, ((q.astype(jnp.float32) - zp) * scale).astype(dtype))
            for i, q in enumerate(quant.nibbles(data))]

  def decode_side(self, data, scale_bytes, dtype):
    return jnp.concatenate([v for _, v in self.decode_parts(data, scale_bytes, dtype)], -1)


def halves_order(head_size: int) -> np.ndarray:
  """The head-dim permutation ``[0, 2, 4, ..., 1, 3, 5, ...]`` (even dims, then odd)."""
  return np.r_[np.arange(0, head_size, 2), np.arange(1, head_size, 2)]
