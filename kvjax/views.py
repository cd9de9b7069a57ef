"""Functional views of a physical cache array: K/V data, scales, nvfp4 data/scale split.

All functions take the *physical* array (see :class:`kvjax.KVCacheSpec`) with
any number of leading page dims ``P...`` in place of B, and return jnp arrays.
Token-major results use ``[P..., N, H, X]`` whatever the layout. Each answer comes from the
format's codec (:mod:`kvjax.codecs`).
"""
from __future__ import annotations

from kvjax.codecs.address import RowAddress
from kvjax.codecs import nvfp4 as _nvfp4
from kvjax.spec import KVCacheSpec


def token_major(pages, spec: KVCacheSpec):
  """``[P..., N, H, C]`` view of NHD or HND pages (a transpose for HND)."""
  return RowAddress.of(spec).token_major(pages)


def kv_views(pages, spec: KVCacheSpec):
  """(K, V) storage data ``[P..., N, H, data_dim]`` (no scale bytes).

  Plain and fp8 per-tensor: the two halves of the content dim. Per-token-head:
  the data part of each side row. nvfp4: use :func:`nvfp4_sides` instead.
  """
  if not spec.codec.content_halves:
    raise ValueError(f"{spec.cache_dtype} K/V are head groups, not content halves: use "
                     "nvfp4_sides / nvfp4_split_data_scale")
  k, v = spec.codec.sides(pages, spec)
  return k[..., :spec.data_dim], v[..., :spec.data_dim]


def kv_scale_views(pages, spec: KVCacheSpec):
  """(K-scale, V-scale) float32 ``[P..., N, H]`` of a per-token-head cache."""
  codec = spec.codec
  if not codec.has_row_scales:
    raise ValueError(f"cache_dtype={spec.cache_dtype!r} has no per-token-head scales")
  return tuple(codec.row_scales(side, spec) for side in codec.sides(pages, spec))


def _nvfp4_codec(spec: KVCacheSpec):
  if spec.codec.content_halves:
    raise ValueError(f"cache_dtype={spec.cache_dtype!r} is not nvfp4 (its K/V are content "
                     "halves, not head groups): use kv_views")
  return spec.codec


def nvfp4_sides(pages, spec: KVCacheSpec):
  """(K side, V side) of nvfp4 HND pages, each uint8 ``[P..., H, N, F]``."""
  return _nvfp4_codec(spec).head_groups(pages, spec)


def nvfp4_split_data_scale(side):
  """Split one nvfp4 side ``[P..., d1, d2, F]`` (contiguous (d1, d2, F) per page).

  Returns (data uint8 ``[P..., d1, d2, F*8//9]``, scales e4m3 ``[P..., d1, d2, F - F*8//9]``):
  per page the bytes are all data rows, then all scale rows.
  """
  return _nvfp4.split_data_scale(side)


def nvfp4_logical_scales(scales, spec: KVCacheSpec, side: str):
  """Stored scales ``[P..., H, N, S]`` -> logical per-(token, s) order (undo V's swizzle)."""
  return _nvfp4_codec(spec).logical_scales(scales, spec, side)


def dequantize_stored(pages, spec: KVCacheSpec, k_scale=None, v_scale=None):
  """Dequantized stored (K, V), float32 ``[P..., N, H, D]``, of physical pages of any cache
  dtype, in the frame the cache stores them (rotated for int4 per token-head).

  The reference implementation of the read op (``kvjax.registry.READ``)."""
  return spec.codec.dequantize(pages, spec, k_scale, v_scale)


def dequantize_pages(pages, spec: KVCacheSpec, k_scale=None, v_scale=None):
  """Dequantized (K, V), float32 ``[P..., N, H, D]``, of physical pages of any cache dtype:
  :func:`dequantize_stored` un-rotated (``spec.codec.rotation``), the values as written."""
  unrotate = spec.codec.rotation.unrotate
  return tuple(unrotate(x) for x in dequantize_stored(pages, spec, k_scale, v_scale))
