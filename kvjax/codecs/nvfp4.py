"""nvfp4 caches: e2m1 values two a byte, one e4m3 scale per 16 values, HND only.

The logical head axis has 2H slots: K heads then V heads ("separate head groups"). Per page,
each side (K, then V) is ``[data (H, N, D/2) | scales (H, N, D/16)]``: all data rows, then all
scale rows. K scales are stored linearly per (head, token); V scales of each (block, head)
``N x S`` tile are 4x4-swizzled (:func:`kvjax.quant.nvfp4_v_scale_position`). The split is
exact only when a side's (heads, tokens) block is contiguous, hence HND.

With global scale ``gs = 1 / k_scale``: ``SF = e4m3(gs * amax(group) / 6)``,
``q = e2m1(x * gs / SF)`` (0 where SF == 0); read = ``e2m1(q) * SF * k_scale``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import quant
from kvjax.codecs.address import RowAddress, ViewGeometry
from kvjax.codecs.base import Codec

SIDES = ("k", "v")


@dataclasses.dataclass(frozen=True)
class SideLayout:
  """Element layout of one page side ``[data (H, N, D/2) | scales (H, N, S)]``.

  ``data`` addresses the (token, head) data rows (head-major, rows of D/2 bytes); scales
  start at ``scale_base``; ``side_elems`` is the side's size (the V side starts there).
  """
  data: RowAddress
  num_scales: int            # S = D/16 per (token, head)
  swizzled_v: bool

  @classmethod
  def of(cls, spec) -> "SideLayout":
    s = spec.head_size // 16
    return cls(RowAddress.of(spec, row_elems=spec.head_size // 2), s,
               quant.nvfp4_v_scales_swizzled(spec.block_size, s))

  @property
  def scale_base(self) -> int:
    return self.data.page_elems

  @property
  def side_elems(self) -> int:
    return self.data.page_elems + self.data.num_heads * self.data.block_size * self.num_scales

  def scale_offset(self, side: int, token, head, group):
    """Element offset (within the side) of the scale of (token, head, group ``s``)."""
    tile = self.data.block_size * self.num_scales
    if side == 1:
      pos = quant.nvfp4_v_scale_position(token, group, self.num_scales)
    else:
      pos = token * self.num_scales + group
    return self.scale_base + head * tile + pos


@dataclasses.dataclass(frozen=True)
class Nvfp4Codec(Codec):
  """e2m1 data ``[D/2]`` and e4m3 group scales ``[D/16]`` per (token, head), per side."""
  kind = "nvfp4"
  layouts = ("HND",)
  has_tensor_scales = True
  content_halves = False
  no_layered_reason = ("each side's [data | scales] split spans a page's whole (heads, tokens) "
                       "block, which a layered array interleaves with the other layers")

  def check_head_size(self, head_size: int):
    if head_size % 16:
      raise ValueError(f"head_size={head_size} must be a multiple of 16 for nvfp4")

  def data_dim(self, head_size: int) -> int:
    return head_size // 2

  def padded_dim(self, head_size: int, itemsize: int) -> int:
    return head_size // 2 + head_size // 16

  def logical_shape(self, num_blocks, num_kv_heads, block_size, head_size, itemsize):
    return (num_blocks, 2 * num_kv_heads, block_size, self.padded_dim(head_size, itemsize))

  def head_segments(self, spec):
    """K data, K scales, V data, V scales: each side is all heads' data rows, then all heads'
    scale rows (bytes: N * D/2 and N * D/16 a head)."""
    n = spec.block_size
    data, scales = n * spec.head_size // 2, n * spec.num_scales_per_row
    return (data, scales, data, scales)

  # -- reference -----------------------------------------------------------------------------------
  def encode(self, key, value, spec, k_scale=None, v_scale=None):
    """((k_data ``[T, H, D/2]``, k_sf ``[T, H, D/16]``), (v_data, v_sf)), scales in logical
    (unswizzled) order."""
    return quant.quantize_nvfp4(key, k_scale), quant.quantize_nvfp4(value, v_scale)

  def scatter(self, cache, encoded, block, token, spec):
    b, h, n = cache.shape[0], spec.num_kv_heads, spec.block_size
    lay = SideLayout.of(spec)
    heads = jnp.arange(h)[None, :, None]
    groups = jnp.arange(lay.num_scales)[None, None, :]
    tok = token[:, None, None]
    flat = cache.reshape(b, 2, lay.side_elems)
    for side, (data, sf) in enumerate(encoded):
      cols = lay.data.offset(tok, heads) + jnp.arange(lay.data.row_elems)[None, None, :]
      flat = flat.at[block[:, None, None], side, cols].set(data, mode="drop")
      cols = lay.scale_offset(side, tok, heads, groups)
      flat = flat.at[block[:, None, None], side, cols].set(
          jax.lax.bitcast_convert_type(sf, jnp.uint8), mode="drop")
    return flat.reshape(cache.shape)

  def dequantize(self, pages, spec, k_scale=None, v_scale=None):
    out = []
    for name, side, gscale in zip(SIDES, self.head_groups(pages, spec), (k_scale, v_scale)):
      data, sf = split_data_scale(side)
      x = quant.dequantize_nvfp4(data, self.logical_scales(sf, spec, name), gscale)
      out.append(jnp.swapaxes(x, -3, -2))                  # [P..., H, N, D] -> [P..., N, H, D]
    return tuple(out)

  # -- views ---------------------------------------------------------------------------------------
  def head_groups(self, pages, spec):
    """(K side, V side) of HND pages, each uint8 ``[P..., H, N, F]``."""
    h = spec.num_kv_heads
    return pages[..., :h, :, :], pages[..., h:, :, :]

  def logical_scales(self, scales, spec, side: str):
    """Stored scales ``[P..., H, N, S]`` -> logical per-(token, s) order (undo V's swizzle)."""
    lay = SideLayout.of(spec)
    if side == "k" or not lay.swizzled_v:
      return scales
    idx = quant.nvfp4_v_swizzle_index(spec.block_size, lay.num_scales)
    flat = scales.reshape(scales.shape[:-2] + (idx.size,))
    return flat[..., idx]

  def split_geometry(self, spec, num_blocks: int, side: str):
    """(data, scale) :class:`kvjax.ViewGeometry` of one side ("k" or "v")."""
    if side not in SIDES:
      raise ValueError(f"side={side!r} must be 'k' or 'v'")
    s0, s1, s2, _ = spec.logical_strides(num_blocks)
    h, n, f = spec.num_kv_heads, spec.block_size, spec.padded_head_size
    side_off = 0 if side == "k" else h * s1
    return split_strided((num_blocks, h, n, f), (s0, s1, s2, 1), side_off)


def split_dims(f: int):
  """(data elements, scale elements) of an nvfp4 row of ``F = D/2 + D/16`` bytes."""
  data_dim = f * 8 // 9
  return data_dim, f - data_dim


def split_data_scale(side):
  """Split one side ``[P..., d1, d2, F]`` (contiguous (d1, d2, F) per page).

  Returns (data uint8 ``[P..., d1, d2, D/2]``, scales e4m3 ``[P..., d1, d2, D/16]``): per
  page the bytes are all data rows, then all scale rows.
  """
  *lead, d1, d2, f = side.shape
  dd, sd = split_dims(f)
  flat = side.reshape(tuple(lead) + (d1 * d2 * f,))
  data = flat[..., :d1 * d2 * dd].reshape(tuple(lead) + (d1, d2, dd))
  scale = flat[..., d1 * d2 * dd:].reshape(tuple(lead) + (d1, d2, sd))
  return data, jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)


def split_strided(shape, strides, offset):
  """Data and scale geometry of one side given as a ``(P, d1, d2, F)`` uint8 view: data
  strides scale s1, s2 by D/2 / F at ``offset``; scales start at ``offset + d1*d2*D/2``."""
  p, d1, d2, f = shape
  s0, s1, s2, _ = strides
  dd, sd = split_dims(f)
  data = ViewGeometry((p, d1, d2, dd), (s0, s1 * dd // f, s2 * dd // f, 1), offset,
                      np.dtype(np.uint8))
  scale = ViewGeometry((p, d1, d2, sd), (s0, s1 * sd // f, s2 * sd // f, 1),
                       offset + d1 * d2 * dd, np.dtype(jnp.float8_e4m3fn))
  return data, scale
