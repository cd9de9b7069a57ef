"""Conversion between the legacy 5-D ``(B, 2, N, H, D)`` cache and the packed layout."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.codecs.address import RowAddress
from kvjax.spec import KVCacheSpec


def _check_unpacked_format(spec: KVCacheSpec):
  codec = spec.codec
  if not codec.content_halves or codec.has_row_scales:
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
  return RowAddress.of(spec).token_major(packed)      # a swap is its own inverse


def to_legacy_5d(cache, spec: KVCacheSpec):
  """The spec's physical packed array -> legacy ``(B, 2, N, H, D)``."""
  _check_unpacked_format(spec)
  spec.num_blocks_of(cache)
  rows = RowAddress.of(spec).token_major(cache)
  d = spec.head_size
  return jnp.stack([rows[..., :d], rows[..., d:]], axis=1)
