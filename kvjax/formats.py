"""Cache dtypes: what each ``cache_dtype`` string stores, as one row pointing at a codec.

One frozen :class:`CacheFormat` per accepted string. Everything else in the library asks
the format's codec (:mod:`kvjax.codecs`), never the string or the kind: a new cache dtype of
an existing kind is one row in :data:`CACHE_FORMATS`; a new kind is one codec plus one row.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import jax.numpy as jnp
import numpy as np

from kvjax.codecs import (Codec, Fp8PerTensorCodec, Int4PerTokenHeadCodec, Nvfp4Codec,
                          PerTokenHeadCodec, PlainCodec)

#: Kinds of the built-in codecs (``CacheFormat.kind``).
PLAIN = PlainCodec.kind                      # model dtype or a float dtype, no scales
FP8_PER_TENSOR = Fp8PerTensorCodec.kind      # fp8 values, float32 scalar (or [H]) scales
PER_TOKEN_HEAD = PerTokenHeadCodec.kind      # int8 / fp8 / int4 data + a float32 scale a row
NVFP4 = Nvfp4Codec.kind                      # e2m1 pairs + e4m3 scales per 16 values


@dataclasses.dataclass(frozen=True)
class CacheFormat:
  """How one cache dtype stores K and V: its name and its codec.

  Attributes:
    name: the canonical ``cache_dtype`` string.
    codec: the :class:`kvjax.codecs.Codec` (kind and parameters) that stores it.
  """
  name: str
  codec: Codec

  @property
  def kind(self) -> str:
    return self.codec.kind

  @property
  def storage(self) -> Optional[np.dtype]:
    """numpy dtype of the cache array (None = the model dtype)."""
    return self.codec.storage

  @property
  def quant(self):
    """What values are quantized to (int8, e4m3, e5m2, "int4", "e2m1"), None when not."""
    return self.codec.quant

  @property
  def qmax(self) -> Optional[float]:
    return self.codec.qmax

  @property
  def is_quantized(self) -> bool:
    return self.codec.is_quantized

  @property
  def has_tensor_scales(self) -> bool:
    """Whether k_scale / v_scale (global scales) take part in the format."""
    return self.codec.has_tensor_scales

  def storage_dtype(self, model_dtype) -> np.dtype:
    return self.codec.storage_dtype(model_dtype)


_E4M3 = np.dtype(jnp.float8_e4m3fn)
_E5M2 = np.dtype(jnp.float8_e5m2)
_U8, _I8 = np.dtype(np.uint8), np.dtype(np.int8)

CACHE_FORMATS: Dict[str, CacheFormat] = {f.name: f for f in (
    CacheFormat("auto", PlainCodec()),
    CacheFormat("bfloat16", PlainCodec(np.dtype(jnp.bfloat16))),
    CacheFormat("float16", PlainCodec(np.dtype(np.float16))),
    CacheFormat("float32", PlainCodec(np.dtype(np.float32))),
    CacheFormat("fp8", Fp8PerTensorCodec(_E4M3, _E4M3, 448.0)),
    CacheFormat("fp8_e4m3", Fp8PerTensorCodec(_E4M3, _E4M3, 448.0)),
    CacheFormat("fp8_e5m2", Fp8PerTensorCodec(_E5M2, _E5M2, 57344.0)),
    CacheFormat("int8_per_token_head", PerTokenHeadCodec(_I8, _I8, 127.0)),
    CacheFormat("fp8_per_token_head", PerTokenHeadCodec(_U8, _E4M3, 448.0)),
    CacheFormat("int4_per_token_head", Int4PerTokenHeadCodec(_U8, "int4", 15.0)),
    CacheFormat("nvfp4", Nvfp4Codec(_U8, "e2m1", 6.0)),
)}

#: Model (K/V input) dtypes a cache accepts.
MODEL_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def get_format(cache_dtype: str) -> CacheFormat:
  """The :class:`CacheFormat` of a ``cache_dtype`` string; ValueError if unknown."""
  if not isinstance(cache_dtype, str) or cache_dtype not in CACHE_FORMATS:
    raise ValueError(
        f"cache_dtype={cache_dtype!r} is not a known cache dtype; expected one of "
        f"{sorted(CACHE_FORMATS)}")
  return CACHE_FORMATS[cache_dtype]
