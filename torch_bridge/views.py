"""torch strided views of a cache tensor: K/V data, per-token-head scales, nvfp4 sides.

Every view shares the cache's storage (``torch.as_strided``); the geometry comes
from :class:`kvjax.KVCacheSpec` (``kv_view_geometry``, ``scale_view_geometry``,
``nvfp4_split_geometry``) with offsets added to the tensor's own storage offset.
The results equal vLLM's formulas: ``logical.transpose(1, 2).split(D, -1)`` for
plain and fp8 caches (split at ``padded_hs`` for per-token-head caches).
"""
from __future__ import annotations

import torch

from kvjax import spec as S
from kvjax.spec import KVCacheSpec
from torch_bridge import layout as L


def _logical_4d(tensor, spec: KVCacheSpec) -> torch.Tensor:
  logical = L.logical_view(tensor, spec)
  if logical.ndim != 4:
    raise ValueError("views take one layer's 4-D cache; index the layers dim first")
  return logical


def _strided(base: torch.Tensor, geom: S.ViewGeometry, base_offset: int) -> torch.Tensor:
  return torch.as_strided(base, geom.shape, geom.strides, base_offset + geom.offset)


def kv_views(tensor, spec: KVCacheSpec):
  """(K, V) ``(B, N, H, W)`` views in the cache's torch dtype.

  W = D for plain / fp8 per-tensor caches; W = padded_hs for per-token-head caches
  (the first ``spec.data_dim`` elements are data, then the 4-byte scale slot).
  Same shape, strides and storage offset as vLLM's
  ``logical.transpose(1, 2).split(W, -1)``. nvfp4: use :func:`nvfp4_views`.
  """
  logical = _logical_4d(tensor, spec)
  k, v = spec.kv_view_geometry(logical.shape[0])
  off = logical.storage_offset()
  return _strided(logical, k, off), _strided(logical, v, off)


def kv_scale_views(tensor, spec: KVCacheSpec):
  """(K-scale, V-scale) float32 ``(B, N, H)`` views of a per-token-head cache.

  Strides are the logical ``(s0, s2, s1) * itemsize / 4``; offsets
  ``data_dim * itemsize / 4`` (K) and ``(padded_hs + data_dim) * itemsize / 4`` (V)
  float32 elements past the cache's start (docs/layout.md §3). For int4 the low 4 mantissa
  bits hold the zero point.
  """
  logical = _logical_4d(tensor, spec)
  k, v = spec.scale_view_geometry(logical.shape[0])
  flat = L.physical_tensor(logical, spec).reshape(-1)   # contiguous, a view
  byte_offset = flat.storage_offset() * flat.element_size()
  if byte_offset % 4:
    raise ValueError(f"cache starts {byte_offset} bytes into its storage, not a multiple of 4: "
                     "no float32 view")
  f32 = flat.view(torch.float32)
  return _strided(f32, k, f32.storage_offset()), _strided(f32, v, f32.storage_offset())


def nvfp4_split_data_scale(side: torch.Tensor):
  """Split one nvfp4 side, a uint8 ``(P, d1, d2, F)`` view, into data and scales (docs/layout.md §5).

  data_dim = F*8//9 (= D/2), scale_dim = F - data_dim (= D/16). Data strides are
  ``(s0, s1*data_dim/F, s2*data_dim/F, 1)`` at the side's offset; scales
  ``(s0, s1*scale_dim/F, s2*scale_dim/F, 1)`` at ``offset + d1*d2*data_dim``, as e4m3.
  Exact only when each page's (d1, d2, F) block is contiguous (HND).
  Returns (data uint8 ``(P, d1, d2, D/2)``, scales float8_e4m3fn ``(P, d1, d2, D/16)``).
  """
  if not isinstance(side, torch.Tensor):
    raise TypeError(f"side must be a torch.Tensor, got {type(side).__name__}")
  if side.ndim != 4 or side.dtype != torch.uint8:
    raise ValueError(f"side must be a 4-D uint8 (P, d1, d2, F) view, got {tuple(side.shape)} "
                     f"{side.dtype}")
  _, d1, d2, f = side.shape
  s = side.stride()
  if s[3] != 1 or (d2 > 1 and s[2] != f) or (d1 > 1 and s[1] != d2 * f):
    raise ValueError(f"side strides {s} are not a contiguous (d1, d2, F) block per page: the "
                     "data/scale split is exact only for HND nvfp4 caches")
  if f % 9:
    raise ValueError(f"side content dim {f} is not D/2 + D/16 for any D")
  data, scale = S.nvfp4_split_strided(tuple(side.shape), s, side.storage_offset())
  return _strided(side, data, 0), _strided(side, scale, 0).view(torch.float8_e4m3fn)


def nvfp4_sides(tensor, spec: KVCacheSpec):
  """(K side, V side) uint8 ``(B, H, N, D/2 + D/16)`` views: head slots ``[:H]`` and ``[H:]``."""
  logical = _logical_4d(tensor, spec)
  if spec.codec.content_halves:
    raise ValueError(f"cache_dtype={spec.cache_dtype!r} keeps K and V in content halves, not "
                     "head groups (nvfp4): use kv_views")
  h = spec.num_kv_heads
  return logical[:, :h], logical[:, h:]


def nvfp4_views(tensor, spec: KVCacheSpec):
  """(K data, K scales, V data, V scales) of an nvfp4 HND cache tensor.

  Geometry from ``spec.nvfp4_split_geometry``: data uint8 ``(B, H, N, D/2)``,
  scales float8_e4m3fn ``(B, H, N, D/16)`` (V scales stored 4x4-swizzled).
  """
  logical = _logical_4d(tensor, spec)
  b, off = logical.shape[0], logical.storage_offset()
  out = []
  for side in ("k", "v"):
    data, scale = spec.nvfp4_split_geometry(b, side)
    out += [_strided(logical, data, off), _strided(logical, scale, off).view(torch.float8_e4m3fn)]
  return tuple(out)
