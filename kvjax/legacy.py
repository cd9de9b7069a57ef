"""Conversion between the legacy 5-D ``(B, 2, N, H, D)`` cache and the packed layout."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax import formats as F
from kvjax.spec import KVCacheSpec


def _check_unpacked_format(spec: KVCacheSpec):
  if spec.format.kind not in (F.PLAIN, F.FP8_PER_TENSOR):
    raise ValueError(f"the legacy 5-D layout has no place for cache_dtype={spec.cache_dtype!r} "
                     "scales; only plain and fp8 per-tensor caches convert")


def from_legacy_5d(legacy, spec: KVCacheSpec):
  """Legacy ``(B, 2, N, H, D)`` (K at [:, 0], V at [:, 1]) -> the spec's physical packed array."""
  _check_unpacked_format(spec)
  want = (2, spec.block_size, spec.num_kv_heads, spec.head_size)
  if legacy.ndim != 5 or tuple(legacy.shape[1:]) != want:
    raise ValueError(f"legacy cache must have shape (B, {', '.join(map(str, want))}), "
                     f"got {tuple(legacy.shape)}")
  if np.dtype(legacy.dtype) != spec.storage_dtype:
    raise TypeError(f"legacy cache dtype {legacy.dtype} is not {spec.storage_dtype}")
  packed = jnp.concatenate([legacy[:, 0], legacy[:, 1]], axis=-1)   # (B, N, H, 2D)
  return packed if spec.layout == "NHD" else jnp.swapaxes(packed, 1, 2)


def to_legacy_5d(cache, spec: KVCacheSpec):
  """The spec's physical packed array -> legacy ``(B, 2, N, H, D)``."""
  _check_unpacked_format(spec)
  spec.num_blocks_of(cache)
  rows = cache if spec.layout == "NHD" else jnp.swapaxes(cache, 1, 2)
  d = spec.head_size
  return jnp.stack([rows[..., :d], rows[..., d:]], axis=1)
