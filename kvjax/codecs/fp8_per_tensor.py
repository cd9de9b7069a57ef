"""fp8 caches with per-tensor scales: stored = x / k_scale (saturated), read = q * k_scale."""
from __future__ import annotations

import dataclasses

from kvjax import quant
from kvjax.codecs.base import Codec


@dataclasses.dataclass(frozen=True)
class Fp8PerTensorCodec(Codec):
  """e4m3 or e5m2 values; k_scale / v_scale a scalar or one per KV head ``[H]`` (default 1)."""
  kind = "fp8_per_tensor"
  has_tensor_scales = True
  per_head_tensor_scales = True

  def encode_side(self, x, global_scale, spec):
    return quant.quantize_fp8_per_tensor(x, global_scale, spec.storage_dtype)

  def decode_side(self, rows, global_scale, spec):
    del spec
    return quant.dequantize_fp8_per_tensor(rows, global_scale)
