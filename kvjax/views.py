"""Functional views of a physical cache array: K/V data, scales, nvfp4 data/scale split.

All functions take the *physical* array (see :class:`kvjax.KVCacheSpec`) with
any number of leading page dims ``P...`` in place of B, and return jnp arrays.
Token-major results use ``[P..., N, H, X]`` whatever the layout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import formats as F
from kvjax import quant
from kvjax.spec import KVCacheSpec


def token_major(pages, spec: KVCacheSpec):
  """``[P..., N, H, C]`` view of NHD or HND pages (a transpose for HND)."""
  if spec.layout == "HND":
    return jnp.swapaxes(pages, -3, -2)
  return pages


def kv_views(pages, spec: KVCacheSpec):
  """(K, V) storage data ``[P..., N, H, data_dim]`` (no scale bytes).

  Plain and fp8 per-tensor: the two halves of the content dim. Per-token-head:
  the data part of each side row. nvfp4: use :func:`nvfp4_sides` instead.
  """
  if spec.format.kind == F.NVFP4:
    raise ValueError("nvfp4 K/V are head groups: use nvfp4_sides / nvfp4_split_data_scale")
  rows = token_major(pages, spec)
  w, dd = spec.padded_head_size, spec.data_dim
  return rows[..., :dd], rows[..., w:w + dd]


def kv_scale_views(pages, spec: KVCacheSpec):
  """(K-scale, V-scale) float32 ``[P..., N, H]`` of a per-token-head cache."""
  if spec.format.kind != F.PER_TOKEN_HEAD:
    raise ValueError(f"cache_dtype={spec.cache_dtype!r} has no per-token-head scales")
  rows = token_major(pages, spec)
  w, dd = spec.padded_head_size, spec.data_dim
  return (quant.scale_from_storage(rows[..., dd:w]),
          quant.scale_from_storage(rows[..., w + dd:]))


def nvfp4_sides(pages, spec: KVCacheSpec):
  """(K side, V side) of nvfp4 HND pages, each uint8 ``[P..., H, N, F]``."""
  if spec.format.kind != F.NVFP4:
    raise ValueError(f"cache_dtype={spec.cache_dtype!r} is not nvfp4")
  h = spec.num_kv_heads
  return pages[..., :h, :, :], pages[..., h:, :, :]


def nvfp4_split_data_scale(side):
  """Split one nvfp4 side ``[P..., d1, d2, F]`` (contiguous (d1, d2, F) per page).

  Returns (data uint8 ``[P..., d1, d2, F*8//9]``, scales e4m3 ``[P..., d1, d2, F - F*8//9]``):
  per page the bytes are all data rows, then all scale rows (spec §5).
  """
  *lead, d1, d2, f = side.shape
  data_dim = f * 8 // 9
  flat = side.reshape(tuple(lead) + (d1 * d2 * f,))
  data = flat[..., :d1 * d2 * data_dim].reshape(tuple(lead) + (d1, d2, data_dim))
  scale = flat[..., d1 * d2 * data_dim:].reshape(tuple(lead) + (d1, d2, f - data_dim))
  return data, jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)


def nvfp4_logical_scales(scales, spec: KVCacheSpec, side: str):
  """Stored scales ``[P..., H, N, S]`` -> logical per-(token, s) order (undo V's swizzle)."""
  n, s = spec.block_size, spec.num_scales_per_row
  if side == "k" or not quant.nvfp4_v_scales_swizzled(n, s):
    return scales
  idx = quant.nvfp4_v_swizzle_index(n, s)
  flat = scales.reshape(scales.shape[:-2] + (n * s,))
  return flat[..., idx]


def dequantize_pages(pages, spec: KVCacheSpec, k_scale=None, v_scale=None):
  """Dequantized (K, V), float32 ``[P..., N, H, D]``, of physical pages of any cache dtype."""
  fmt = spec.format
  if fmt.kind == F.NVFP4:
    out = []
    for name, side, gscale in zip("kv", nvfp4_sides(pages, spec), (k_scale, v_scale)):
      data, sf = nvfp4_split_data_scale(side)
      sf = nvfp4_logical_scales(sf, spec, name)
      x = quant.dequantize_nvfp4(data, sf, gscale)  # [P..., H, N, D]
      out.append(jnp.swapaxes(x, -3, -2))
    return tuple(out)
  k, v = kv_views(pages, spec)
  if fmt.kind == F.PLAIN:
    return k.astype(jnp.float32), v.astype(jnp.float32)
  if fmt.kind == F.FP8_PER_TENSOR:
    return (quant.dequantize_fp8_per_tensor(k, k_scale),
            quant.dequantize_fp8_per_tensor(v, v_scale))
  ks, vs = kv_scale_views(pages, spec)
  return (quant.dequantize_per_token_head(k, ks, fmt),
          quant.dequantize_per_token_head(v, vs, fmt))
