"""int4 per-token-head caches (asymmetric): two values a byte and a float32 scale per row.

``scale = max((max - min) / 15, 1e-6)``, ``zp = clamp(round(-min / scale), 0, 15)``,
``q = clamp(round(x / scale + zp), 0, 15)``; the 4-bit zero point sits in the low 4 mantissa
bits of the stored scale. Read = (q - zp) * scale. Kernels keep even and odd head dims apart.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax import quant
from kvjax.codecs.per_token_head import PerTokenHeadCodec


@dataclasses.dataclass(frozen=True)
class Int4PerTokenHeadCodec(PerTokenHeadCodec):
  """Packed uint8 data ``[D/2]`` (low nibble = even element), stored scale with its zp.

  Its kind stays "per_token_head" (a per-token-head format with int4 values)."""
  triton = "pallas_kernels.triton.formats:Int4Format"

  def check_head_size(self, head_size: int):
    if head_size % 4:
      raise ValueError(f"head_size={head_size} must be a multiple of 4 for int4_per_token_head")

  def data_dim(self, head_size: int) -> int:
    return head_size // 2

  def encode_side(self, x, global_scale, spec):
    del global_scale
    packed, stored = quant.quantize_int4(x.astype(jnp.float32))
    return jnp.concatenate([packed, quant.scale_to_storage(stored, spec.storage_dtype)], axis=-1)

  def decode_side(self, rows, global_scale, spec):
    del global_scale
    return quant.dequantize_int4(rows[..., :spec.data_dim], self.row_scales(rows, spec))
