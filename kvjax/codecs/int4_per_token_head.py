"""int4 per-token-head caches (asymmetric), vLLM 0.28's int4: rotated rows, two values a byte.

Every K and V row is stored rotated by vLLM's randomized Hadamard transform
(:data:`kvjax.rotation.HADAMARD`, applied by the public ops: the rotated row is rounded to the
model dtype), then quantized: ``scale = max((max - min) / 15, 1e-6)``, ``r = 1 / scale``,
``zp = clamp(round(-min * r), 0, 15)``, ``q = clamp(round(x * r + zp), 0, 15)``, rounding
half away from zero (:mod:`kvjax.quant`); the 4-bit zero point sits in the low 4 mantissa bits
of the stored scale. Read = (q - zp) * scale, in the rotated frame. Kernels keep even and odd
head dims apart.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax import quant
from kvjax.codecs.per_token_head import PerTokenHeadCodec
from kvjax.rotation import HADAMARD, MAX_HEAD_SIZE


@dataclasses.dataclass(frozen=True)
class Int4PerTokenHeadCodec(PerTokenHeadCodec):
  """Packed uint8 data ``[D/2]`` (low nibble = even element), stored scale with its zp.

  Its kind stays "per_token_head" (a per-token-head format with int4 values)."""
  rotation = HADAMARD

  def check_head_size(self, head_size: int):
    d = int(head_size)
    if d < 4 or d > MAX_HEAD_SIZE or d & (d - 1):
      raise ValueError(
          f"head_size={head_size} must be a power of two in [4, {MAX_HEAD_SIZE}] for "
          "int4_per_token_head (its rows are stored Hadamard-rotated, as vLLM's)")

  def data_dim(self, head_size: int) -> int:
    return head_size // 2

  def encode_side(self, x, global_scale, spec):
    del global_scale
    packed, stored = quant.quantize_int4(x.astype(jnp.float32))
    return jnp.concatenate([packed, quant.scale_to_storage(stored, spec.storage_dtype)], axis=-1)

  def decode_side(self, rows, global_scale, spec):
    del global_scale
    return quant.dequantize_int4(rows[..., :spec.data_dim], self.row_scales(rows, spec))
