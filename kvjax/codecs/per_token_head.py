"""Per-token-head caches: each (token, head) side row is ``[data | float32 scale]``.

int8 and fp8 (e4m3) data: ``scale = max(amax / QMAX, 1e-6)``, read = q * scale. The 4-byte
scale takes ``4 // itemsize`` storage elements after each side's data.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax import quant
from kvjax.codecs.base import Codec


@dataclasses.dataclass(frozen=True)
class PerTokenHeadCodec(Codec):
  """int8 / fp8 data with one float32 scale per (token, head) side row."""
  kind = "per_token_head"
  has_row_scales = True

  def check_head_size(self, head_size: int):
    if head_size % 2:
      raise ValueError(f"head_size={head_size} must be even for a per-token-head cache")

  def encode_side(self, x, global_scale, spec):
    del global_scale
    data, scale = quant.quantize_per_token_head(x, self)
    return jnp.concatenate([data, quant.scale_to_storage(scale, spec.storage_dtype)], axis=-1)

  def decode_side(self, rows, global_scale, spec):
    del global_scale
    return quant.dequantize_per_token_head(rows[..., :spec.data_dim],
                                           self.row_scales(rows, spec), self)
