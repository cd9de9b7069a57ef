"""Which torch dtype holds each storage dtype of a :class:`kvjax.KVCacheSpec`.

vLLM stores fp8 per-tensor caches as ``torch.uint8``; every other storage dtype
has a torch dtype of the same name. Both sides of the bridge ask this module.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from kvjax import adapters
from kvjax.spec import KVCacheSpec

_TORCH_OF_NUMPY = {
    np.dtype(jnp.bfloat16): torch.bfloat16,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.bool_): torch.bool,
    np.dtype(jnp.float8_e4m3fn): torch.float8_e4m3fn,
    np.dtype(jnp.float8_e5m2): torch.float8_e5m2,
}
_NUMPY_OF_TORCH = {v: k for k, v in _TORCH_OF_NUMPY.items()}


def torch_dtype(dtype) -> torch.dtype:
  """The torch dtype of a numpy / JAX dtype (TypeError if the bridge has none)."""
  if isinstance(dtype, torch.dtype):
    return dtype
  try:
    return _TORCH_OF_NUMPY[np.dtype(dtype)]
  except (KeyError, TypeError) as e:
    raise TypeError(f"dtype {dtype!r} has no torch counterpart in the bridge") from e


def numpy_dtype(dtype) -> np.dtype:
  """The numpy dtype of a torch dtype (or a numpy / JAX dtype, passed through)."""
  if isinstance(dtype, torch.dtype):
    try:
      return _NUMPY_OF_TORCH[dtype]
    except KeyError as e:
      raise TypeError(f"torch dtype {dtype} has no JAX counterpart in the bridge") from e
  return np.dtype(dtype)


def stores_fp8(spec: KVCacheSpec) -> bool:
  """Whether the cache stores fp8 elements (vLLM holds such a cache as uint8)."""
  return adapters.stores_fp8(spec.codec)


def cache_torch_dtype(spec: KVCacheSpec, as_uint8: bool = True) -> torch.dtype:
  """torch dtype of the cache tensor: fp8 per-tensor as uint8 (vLLM's choice) unless asked."""
  if stores_fp8(spec) and as_uint8:
    return torch.uint8
  return torch_dtype(spec.storage_dtype)


def accepted_cache_dtypes(spec: KVCacheSpec):
  """torch dtypes a cache tensor of ``spec`` may have: the storage dtype, plus uint8 for fp8."""
  own = torch_dtype(spec.storage_dtype)
  return (own, torch.uint8) if stores_fp8(spec) else (own,)
