"""Which cache formats the Mosaic TPU kernels handle, and each format's row, in-kernel.

A row is one (token, head) of the packed cache: ``C`` storage elements laid out
``[K data | K scale | V data | V scale]`` (the scale slots exist only for per-token-head
formats: 4 bytes holding a float32). The write kernel *encodes* rows, the attention kernel
*decodes* the K or V part of a page tile. Everything here runs inside a Mosaic TPU kernel
body (or its interpret-mode simulation): elementwise ops, lane slices, casts through
float32, same-width bitcasts and integer shifts only.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import formats as F
from kvjax import quant
from kvjax.spec import KVCacheSpec
from pallas_kernels.common import f32_from_bytes, f32_to_bytes

#: Cache dtypes both kernels handle.
SUPPORTED_CACHE_DTYPES = tuple(name for name, fmt in F.CACHE_FORMATS.items()
                               if fmt.kind in (F.PLAIN, F.FP8_PER_TENSOR)
                               or (fmt.kind == F.PER_TOKEN_HEAD and fmt.quant != "int4"))
#: Query (model) dtypes the attention kernel takes.
SUPPORTED_Q_DTYPES = F.MODEL_DTYPES


def unsupported_reason(spec) -> str | None:
  """None when the kernels handle ``spec``, else a one-line reason."""
  if not isinstance(spec, KVCacheSpec):
    return f"{type(spec).__name__}: the Mosaic TPU kernels take a KVCacheSpec"
  if spec.cache_dtype not in SUPPORTED_CACHE_DTYPES:
    return f"{spec.cache_dtype}: no Mosaic TPU codec yet"
  return None


@dataclasses.dataclass(frozen=True)
class RowCodec:
  """Static geometry and arithmetic of one supported format's rows.

  Attributes:
    kind: ``kvjax.formats`` kind (PLAIN, FP8_PER_TENSOR or PER_TOKEN_HEAD).
    head_size: D. side: storage elements per side (D, or D + 4 bytes of scale).
    storage: the cache array's dtype. quant: the quantized dtype (per-token-head: int8 or
      e4m3 stored as uint8). qmax: its largest magnitude.
  """
  kind: str
  head_size: int
  side: int
  storage: np.dtype
  quant: object
  qmax: float

  @classmethod
  def of(cls, spec: KVCacheSpec) -> "RowCodec":
    fmt = spec.format
    return cls(fmt.kind, spec.head_size, spec.padded_head_size, spec.storage_dtype, fmt.quant,
               fmt.qmax)

  @property
  def width(self) -> int:
    """C: storage elements of a whole row."""
    return 2 * self.side

  @property
  def per_token_head(self) -> bool:
    return self.kind == F.PER_TOKEN_HEAD

  def data_start(self, side: int) -> int:
    """First lane of side ``side``'s data (0 = K, 1 = V)."""
    return side * self.side

  # -- write: float values -> storage elements -------------------------------------------
  def encode_side(self, x, recip=None):
    """One side of new tokens: ``x [..., D]`` (model dtype) -> (data, scale bytes or None).

    data: ``[..., D]`` in the storage dtype. recip: fp8 per-tensor ``1 / scale``,
    broadcastable to x (computed outside the kernel exactly as the reference does).
    Per-token-head also returns the row scale as 4 storage elements ``[..., 4]``.
    The formulas of :mod:`kvjax.quant` themselves (the reference's), bit for bit.
    """
    x = x.astype(jnp.float32)
    if self.kind == F.PLAIN:
      return x.astype(self.storage), None
    if self.kind == F.FP8_PER_TENSOR:
      return quant.to_fp8(x * recip, self.storage), None
    scale = quant.row_scale(quant.abs_max(x, axis=-1, keepdims=True), self.qmax)
    data = quant.quantize_scaled(x * (1.0 / scale), self.quant, self.qmax)
    return quant.from_bits(data, self.storage), self._scale_bytes(scale)

  def _scale_bytes(self, scale):
    """float32 ``[..., 1]`` -> its 4 little-endian bytes ``[..., 4]`` as storage elements."""
    return quant.from_bits(f32_to_bytes(scale[..., 0]), self.storage)

  # -- attention: storage elements -> values the MXU takes --------------------------------
  def decode_side(self, data, scale_bytes, dtype):
    """K or V values of a tile: data ``[..., D]`` storage -> ``[..., D]`` in ``dtype``.

    scale_bytes: per-token-head ``[..., 4]`` storage elements (else None). fp8 per-tensor
    scales are *not* applied here: the kernel folds them into the scores / output.
    """
    if self.per_token_head:
      if self.quant == np.dtype(np.int8):
        vals = data.astype(jnp.float32)
      else:
        vals = jax.lax.bitcast_convert_type(data, self.quant).astype(jnp.float32)
      return (vals * self._scale_from_bytes(scale_bytes)).astype(dtype)
    if np.dtype(data.dtype) == np.dtype(dtype):
      return data
    return data.astype(jnp.float32).astype(dtype)

  @staticmethod
  def _scale_from_bytes(raw):
    """``[..., 4]`` 8-bit storage elements (little endian) -> float32 ``[..., 1]``."""
    b = quant.to_bits(raw)
    return f32_from_bytes(lambda i: b[..., i:i + 1])
