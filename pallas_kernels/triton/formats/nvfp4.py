"""nvfp4's Triton hooks: per page side ``[data (H, N, D/2) | e4m3 scales (H, N, D/16)]``.

:class:`Nvfp4Format` reads and writes bytes; :class:`Nvfp4WordFormat` (the decode kernel's)
reads the data as uint16 words of four e2m1 codes.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax import quant
from kvjax.codecs import RowAddress
from kvjax.codecs.nvfp4 import SideLayout
from pallas_kernels.common import next_pow2
from pallas_kernels.triton import pairs
from pallas_kernels.triton.formats.tile import TileFormat
from pallas_kernels.triton.ieee import Divider

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class Nvfp4Format(TileFormat):
  """nvfp4 (HND): per page side ``[data (H, N, D/2) | scales (H, N, D/16)]``, K side first;
  V scales 4x4-swizzled (:class:`kvjax.codecs.nvfp4.SideLayout`)."""
  num_parts: ClassVar[int] = 2

  @staticmethod
  def address(spec) -> RowAddress:
    return SideLayout.of(spec).data

  @property
  def side(self) -> SideLayout:
    return SideLayout(self.addr, self.head_size // 16,
                      quant.nvfp4_v_scales_swizzled(self.block_size, self.head_size // 16))

  @property
  def scale_pad(self) -> int:
    """Scale bytes per (token, head) row as loaded: D/16 padded to a power of two (each
    covers 8 data bytes, so ``8 * scale_pad == data_pad``)."""
    return self.data_pad // 8

  def _load_data(self, pages_ref, views, blk, data, valid):
    """The K and V data tiles ``[T, data_pad]`` (bytes) of the rows at byte offsets ``data``."""
    del views
    cols, cmask = self._cols()
    mask = valid[:, None] & cmask[None, :]
    return tuple(self.gather(pages_ref, blk, (side + data)[:, None] + cols[None, :], mask)
                 for side in (0, self.side.side_elems))

  def load_kv(self, pages_ref, blk, tok, head, valid, views=()):
    """``views``: what :meth:`view_dtypes` lists (none here; :class:`Nvfp4WordFormat`
    reads its data from uint16 words)."""
    lay = self.side
    data = self.addr.offset(tok, head)                   # [T], in bytes
    kd, vd = self._load_data(pages_ref, views, blk, data, valid)
    if self.fast_decode:   # one scale byte per 16-value group: [T, D/16], broadcast later
      grp = jnp.arange(self.scale_pad, dtype=_I32)[None, :]
      smask = valid[:, None] & (grp < lay.num_scales)
    else:                  # the scale byte of every data byte i (group i // 8): [T, D/2]
      cols, cmask = self._cols()
      grp, smask = (cols // 8)[None, :], valid[:, None] & cmask[None, :]
    k_sc = lay.scale_offset(0, tok[:, None], head, grp)
    v_sc = lay.side_elems + lay.scale_offset(1, tok[:, None], head, grp)
    ksf = self.gather(pages_ref, blk, k_sc, smask)
    vsf = self.gather(pages_ref, blk, v_sc, smask)
    return (kd, vd, ksf, vsf)

  def _f16_codes(self, data):
    """The parts' float16 values of a data tile (bytes: even, odd)."""
    return quant.e2m1_pair_to_f16(data)

  def _values(self, data, sf_bytes, dtype=None):
    """The parts' values of a data tile ``[T, part_width]`` with its e4m3 scale bytes (one
    per group ``[T, scale_pad]`` with :attr:`fast_decode`, else one per data byte): float16
    from the bits with :attr:`fast_f16` (every product is exact in it), else float32."""
    sf = quant.from_bits(sf_bytes, jnp.float8_e4m3fn)
    if self.fast_decode:   # a group's scale over its part_width / scale_pad columns
      t, per = sf.shape[0], self.part_width // self.scale_pad
      sf = jnp.broadcast_to(sf[:, :, None], (t, self.scale_pad, per)).reshape(t,
                                                                             self.part_width)
    if self.fast_f16 and dtype is None:
      sf = sf.astype(jnp.float16)
      return tuple(x * sf for x in self._f16_codes(data))
    sf = sf.astype(jnp.float32)
    return tuple(quant.e2m1_decode(c) * sf for c in quant.nibbles(data))

  def scores(self, q_parts, qsum, tiles, k_scale):
    kd, _, ksf, _ = tiles
    s = sum(self.dot(qp, x, trans_b=True) for qp, x in zip(q_parts, self._values(kd, ksf)))
    return s * k_scale

  def values(self, p, tiles, v_scale):
    _, vd, _, vsf = tiles
    return tuple(self.dot(p, x) * v_scale for x in self._values(vd, vsf))

  def dequant(self, tiles, k_scale, v_scale):
    kd, vd, ksf, vsf = tiles
    f32 = jnp.float32
    return (tuple(x * k_scale for x in self._values(kd, ksf, f32)),
            tuple(x * v_scale for x in self._values(vd, vsf, f32)))

  def paired(self, ptx: bool) -> TileFormat:
    """:class:`Nvfp4WordFormat` where a side's data row holds at least 16 words (D >= 64)
    and the scales come one per group (:attr:`fast_decode`)."""
    if not self.fast_decode or self.data_pad // 2 < 16:
      return self
    return self._as(Nvfp4WordFormat, ptx=ptx)

  # -- write: rows of the table are page sides -----------------------------------------------
  def write_scales(self, k_scale, v_scale):
    """The kernel multiplies by ``gs = 1 / global scale``: the same op as the reference."""
    return 1.0 / super().write_scales(k_scale, v_scale)

  def write_table(self, num_blocks: int):
    return 2 * num_blocks, self.side.side_elems

  def write_tokens(self, p, io, slot, head, valid):
    lay = self.side
    n, s = self.block_size, lay.num_scales
    sp = next_pow2(s)
    rows = p.rows
    blk, off = slot // n, slot % n
    shape3 = (rows, sp, 8)
    g = jnp.arange(sp, dtype=_I32)
    k8 = jnp.arange(8, dtype=_I32)
    smask = jnp.broadcast_to(valid[:, None], (rows, sp))
    if sp != s:
      smask = smask & jnp.broadcast_to((g < s)[None, :], (rows, sp))
    dmask = jnp.broadcast_to(smask[:, :, None], shape3)
    div = Divider(p.compiled)
    data_row = self.addr.offset(off, head)            # (head, token) data row inside a side
    data_col = data_row[:, None, None] + g[None, :, None] * 8 + k8[None, None, :]
    # both sides loaded, then encoded, then stored (as RowFormat.write_tokens)
    sources = [(io.tensor_scale(side, head),                                   # (rows,)
                *(x.reshape(shape3) for x in io.pairs(side, sp * 8, self.head_size)))
               for side in range(2)]
    encoded = []
    for gs, xe, xo in sources:
      sf = quant.nvfp4_group_scale(quant.abs_max(xe, xo, axis=2), gs[:, None], div.compiled)
      r, zero = quant.nvfp4_recip(sf.astype(jnp.float32)[:, :, None], div.recip)
      encoded.append((quant.nvfp4_pack(xe, xo, gs[:, None, None], r, zero), sf))
    for side, (packed, sf) in enumerate(encoded):
      out_row = jnp.where(valid, 2 * blk + side, p.num_rows)
      io.store(jnp.broadcast_to(out_row[:, None, None], shape3),
               jnp.broadcast_to(data_col, shape3), packed, dmask)
      scale_col = lay.scale_offset(side, off[:, None], head[:, None], g[None, :])
      io.store(jnp.broadcast_to(out_row[:, None], (rows, sp)),
               jnp.broadcast_to(scale_col, (rows, sp)), quant.to_bits(sf), smask)


@dataclasses.dataclass(frozen=True)
class Nvfp4WordFormat(Nvfp4Format):
  """nvfp4 read as uint16 words of four e2m1 codes through a uint16 view of the pages, its
  dots over four parts (head dims ``4i + j``: a word's four values share a scale), each word
  split in registers (:func:`pallas_kernels.triton.pairs.nibble_words_to_f16`). Same values
  as :class:`Nvfp4Format`; the decode kernel's hooks (``DecodeConfig.pair_codes``).

  ptx: convert with PTX (compiled for CUDA), else with the element formulas.
  """
  num_parts: ClassVar[int] = 4
  ptx: bool = False

  @property
  def part_width(self) -> int:
    """The words of a side's data row (D / 4; :meth:`paired` keeps it >= 16)."""
    return self.data_pad // 2

  def view_dtypes(self, scale_words: bool = True) -> tuple:
    return (np.dtype(np.uint16),)

  def paired(self, ptx: bool) -> TileFormat:
    return dataclasses.replace(self, ptx=ptx)

  def _load_data(self, pages_ref, views, blk, data, valid):
    """``views``: (the pages as uint16 words ``[B, page_elems / 2]``,): the K and V data
    tiles ``[T, part_width]`` as words."""
    cols = jnp.arange(self.part_width, dtype=_I32)
    mask = valid[:, None] & (cols < self.data_dim // 2)[None, :]
    return tuple(self.gather(views[0], blk, lax.div(side + data, 2)[:, None] + cols[None, :],
                             mask) for side in (0, self.side.side_elems))

  def _f16_codes(self, data):
    return pairs.nibble_words_to_f16(data, "e2m1", self.ptx)
