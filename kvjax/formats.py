"""Cache dtypes: what each ``cache_dtype`` string stores and how (spec §1, §5).

One frozen :class:`CacheFormat` per accepted string. Everything else in the
library asks the format, never the string, so a new cache dtype is one row in
:data:`CACHE_FORMATS`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

#: Kinds of cache formats.
PLAIN = "plain"                    # model dtype or a float dtype, no scales
FP8_PER_TENSOR = "fp8_per_tensor"  # fp8 values, float32 scalar (or [H]) scales
PER_TOKEN_HEAD = "per_token_head"  # data + one float32 scale per (token, head) row
NVFP4 = "nvfp4"                    # e2m1 pairs + e4m3 scales per 16 values


@dataclasses.dataclass(frozen=True)
class CacheFormat:
  """How one cache dtype stores K and V.

  Attributes:
    name: the canonical ``cache_dtype`` string.
    kind: one of PLAIN, FP8_PER_TENSOR, PER_TOKEN_HEAD, NVFP4.
    storage: numpy dtype of the cache array (None = the model dtype).
    quant: dtype values are quantized to before storing (int8, e4m3, e5m2,
      "int4", "e2m1"), None for PLAIN.
    qmax: largest magnitude the quantized values hold (per-token-head modes).
  """
  name: str
  kind: str
  storage: Optional[np.dtype]
  quant: Optional[object] = None
  qmax: Optional[float] = None

  @property
  def is_quantized(self) -> bool:
    return self.kind != PLAIN

  @property
  def has_tensor_scales(self) -> bool:
    """Whether k_scale / v_scale (global scales) take part in the format."""
    return self.kind in (FP8_PER_TENSOR, NVFP4)

  def storage_dtype(self, model_dtype) -> np.dtype:
    return np.dtype(model_dtype) if self.storage is None else self.storage


_E4M3 = np.dtype(jnp.float8_e4m3fn)
_E5M2 = np.dtype(jnp.float8_e5m2)

CACHE_FORMATS = {
    "auto": CacheFormat("auto", PLAIN, None),
    "bfloat16": CacheFormat("bfloat16", PLAIN, np.dtype(jnp.bfloat16)),
    "float16": CacheFormat("float16", PLAIN, np.dtype(np.float16)),
    "float32": CacheFormat("float32", PLAIN, np.dtype(np.float32)),
    "fp8": CacheFormat("fp8", FP8_PER_TENSOR, _E4M3, _E4M3, 448.0),
    "fp8_e4m3": CacheFormat("fp8_e4m3", FP8_PER_TENSOR, _E4M3, _E4M3, 448.0),
    "fp8_e5m2": CacheFormat("fp8_e5m2", FP8_PER_TENSOR, _E5M2, _E5M2, 57344.0),
    "int8_per_token_head": CacheFormat(
        "int8_per_token_head", PER_TOKEN_HEAD, np.dtype(np.int8), np.dtype(np.int8), 127.0),
    "fp8_per_token_head": CacheFormat(
        "fp8_per_token_head", PER_TOKEN_HEAD, np.dtype(np.uint8), _E4M3, 448.0),
    "int4_per_token_head": CacheFormat(
        "int4_per_token_head", PER_TOKEN_HEAD, np.dtype(np.uint8), "int4", 15.0),
    "nvfp4": CacheFormat("nvfp4", NVFP4, np.dtype(np.uint8), "e2m1", 6.0),
}

#: Model (K/V input) dtypes a cache accepts.
MODEL_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def get_format(cache_dtype: str) -> CacheFormat:
  """The :class:`CacheFormat` of a ``cache_dtype`` string; ValueError if unknown."""
  if not isinstance(cache_dtype, str) or cache_dtype not in CACHE_FORMATS:
    raise ValueError(
        f"cache_dtype={cache_dtype!r} is not a known cache dtype; expected one of "
        f"{sorted(CACHE_FORMATS)}")
  return CACHE_FORMATS[cache_dtype]
