"""Row formats' Triton hooks: plain, fp8 per tensor, int8 / fp8 per token-head.

:class:`RowFormat` reads (token, head) rows ``[K data | K scale | V data | V scale]`` and
writes them; :class:`PairFormat` reads the rows of one-byte codes as uint16 words of two
codes (the decode kernel's reads), through :class:`WordRows`, the word loads the packed
formats' word variants share.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton

from kvjax import quant
from pallas_kernels.common import f32_to_bytes, next_pow2, pack_words
from pallas_kernels.triton import pairs
from pallas_kernels.triton.formats.tile import TileFormat
from pallas_kernels.triton.ieee import Divider

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class RowFormat(TileFormat):
  """Row formats: plain, fp8 per tensor, int8 / fp8 per token-head (the codec's facts say
  which scales apply: ``has_tensor_scales`` multiplies scores by k_scale and outputs by
  v_scale; ``has_row_scales`` reads a float32 after each side's data)."""
  row_table: ClassVar[bool] = True

  @property
  def tensor_scaled(self) -> bool:
    return self.codec.has_tensor_scales

  @property
  def row_scaled(self) -> bool:
    return self.codec.has_row_scales

  def to_compute(self, x):
    """Stored data tile (or a q tile) -> compute dtype (up to its scale): fp8 stored as
    bytes is read as its fp8 type first; int8 becomes float16 from its bits
    (:attr:`fast_f16`)."""
    if x.dtype == np.dtype(np.uint8) and self.codec.quant is not None:
      x = quant.from_bits(x, self.codec.quant)
    if x.dtype == np.dtype(np.int8) and self.fast_f16:
      return quant.int8_to_f16(x)
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 2:
      return self.q_operand(x)
    return x.astype(self.compute_dtype)

  def load_kv(self, pages_ref, blk, tok, head, valid, views=()):
    """``views``: (the same pages as float32 words ``[B, page_elems / 4]``,) or () (row
    scales of one-byte formats sit at multiples of 4 bytes: one load each instead of four)."""
    cols, cmask = self._cols()
    mask = valid[:, None] & cmask[None, :]
    base = self.addr.offset(tok, head)
    k = self.gather(pages_ref, blk, base[:, None] + cols[None, :], mask)
    v = self.gather(pages_ref, blk, base[:, None] + (cols + self.v_offset)[None, :], mask)
    if not self.row_scaled:
      return (k, v)
    offs = (base + self.data_dim, base + self.v_offset + self.data_dim)
    return (k, v, *self._row_scales(pages_ref, views[-1] if views else None, blk, offs, valid))

  def _row_scales(self, pages_ref, words_ref, blk, offs, valid):
    """The float32 row scales at byte offsets ``offs`` (K's, V's) of each key: one load each
    from the float32 words ``words_ref``, else four byte loads."""
    if words_ref is not None:
      return tuple(pltriton.load(words_ref.at[(blk, lax.div(o, 4))], mask=valid, other=0.0)
                   for o in offs)
    return tuple(self.gather_f32(pages_ref, blk, o, valid) for o in offs)

  @property
  def scale_words(self) -> bool:
    """Whether the row scales can be read as float32 words of the pages (one-byte storage)."""
    return self.row_scaled and self.storage.itemsize == 1

  def paired(self, ptx: bool) -> TileFormat:
    if (self.storage.itemsize != 1 or self.head_size % 2 or
        pairs.codes_per_word(self.codec.quant) != 2):
      return self
    return self._as(PairFormat, ptx=ptx)

  def _qk(self, q_parts, k):
    """float32 ``[Gp, T]`` dot of the q parts with a K data tile (before its scales)."""
    return self.dot(q_parts[0], self.to_compute(k), trans_b=True)

  def _pv(self, p, v):
    """float32 accumulator parts of ``p @ v`` for a V data tile (before its scales)."""
    return (self.dot(p, self.to_compute(v)),)

  def scores(self, q_parts, qsum, tiles, k_scale):
    s = self._qk(q_parts, tiles[0])
    if self.row_scaled:
      return s * tiles[2][None, :]
    return s * k_scale if self.tensor_scaled else s

  def values(self, p, tiles, v_scale):
    if self.row_scaled:
      return self._pv(p * tiles[3][None, :], tiles[1])
    parts = self._pv(p, tiles[1])
    return tuple(o * v_scale for o in parts) if self.tensor_scaled else parts

  def dequant(self, tiles, k_scale, v_scale):
    out = []
    for j, s in ((0, k_scale), (1, v_scale)):
      x = tiles[j]
      if x.dtype == np.dtype(np.uint8) and self.codec.quant is not None:
        x = quant.from_bits(x, self.codec.quant)
      x = x.astype(jnp.float32)
      if self.row_scaled:
        x = x * tiles[2 + j][:, None]
      elif self.tensor_scaled:
        x = x * s
      out.append((x,))
    return tuple(out)

  # -- write: one (token, head) row per kernel row --------------------------------------------
  @property
  def write_words(self) -> bool:
    """Per-token-head one-byte formats store words: 4 codes a word, the scale one word."""
    return self.row_scaled and self.storage.itemsize == 1 and self.head_size % 4 == 0

  def write_sources(self, io, side: int, head) -> tuple:
    """One side's loads (source rows, the tensor scale) for :meth:`encode_side`; the write
    kernel issues both sides' before it encodes either."""
    d = self.head_size
    if self.write_words:
      return (io.groups(side, next_pow2(d // 4), 4, d),)                   # [rows, w, 4]
    _, col_ld, _ = io.cols(next_pow2(d), d)
    if not (self.tensor_scaled or self.row_scaled):
      return (io.rows(side, col_ld, self.storage),)
    if self.tensor_scaled:
      return (io.rows(side, col_ld), io.tensor_scale(side, head))
    return (io.rows(side, col_ld),)

  def encode_side(self, div: Divider, io, sources: tuple):
    """Quantize one side of the kernel's rows (``sources``: its :meth:`write_sources`)
    -> [(column offset, cols, mask, values)] (offsets and columns in the write table's
    units, values in its dtype)."""
    if self.write_words:
      return self._encode_words(div, io, *sources)
    d = self.head_size
    col, _, cmask = io.cols(next_pow2(d), d)
    if not (self.tensor_scaled or self.row_scaled):
      return [(0, col, cmask, sources[0])]
    x = sources[0]
    if self.tensor_scaled:
      y = quant.to_fp8(x * div.recip(sources[1])[:, None], self.storage, div.compiled)
      return [(0, col, cmask, y)]
    scale = quant.row_scale(quant.abs_max(x, axis=1), self.codec.qmax)
    data = quant.quantize_scaled(x * div.recip(scale)[:, None], self.codec.quant, self.codec.qmax,
                                 div.compiled)
    sbytes = quant.from_bits(f32_to_bytes(scale), self.storage)
    return [(0, col, cmask, quant.from_bits(data, self.storage)),
            (self.data_dim, jnp.arange(4, dtype=_I32), None, sbytes)]

  def _encode_words(self, div: Divider, io, x):
    """:meth:`encode_side` as words: ``[D/4]`` words of 4 codes, then the scale's word
    (``x``: the side's values ``[rows, w, 4]``)."""
    w = self.head_size // 4
    col, _, cmask = io.cols(next_pow2(w), w)
    scale = quant.row_scale(quant.abs_max(x, axis=(1, 2)), self.codec.qmax)
    data = quant.quantize_scaled(x * div.recip(scale)[:, None, None], self.codec.quant,
                                 self.codec.qmax, div.compiled)
    words = pack_words(quant.to_bits(quant.from_bits(data, self.storage)), 8)
    return [(0, col, cmask, words),
            (w, jnp.arange(1, dtype=_I32), None, quant.to_bits(scale)[:, None])]

  def write_tokens(self, p, io, slot, head, valid):
    """Store the kernel rows' encoded (token, head) rows ``[K | V]`` at their slots."""
    div = Divider(p.compiled)
    row = jnp.where(valid, self.addr.row_of_slot(slot, head), p.num_rows)  # OOB when skipped
    dtype = jnp.uint32 if self.write_words else self.storage
    # both sides loaded, then encoded, then stored: a store (or a barrier of a cross-warp
    # reduction or layout change) between them would keep V's loads behind K's work, two
    # memory round trips a program instead of one
    sources = [self.write_sources(io, side, head) for side in range(2)]
    encoded = [self.encode_side(div, io, src) for src in sources]
    for side, segments in enumerate(encoded):
      base = self.write_offset(side * self.v_offset)
      for off, col, cmask, val in segments:
        io.store_rows(row, base + off + col, val.astype(dtype), valid, cmask)


class WordRows:
  """Row loads through a uint16 view of the pages (a mixin of the row formats' word hooks):
  each side's data as ``[T, part_width]`` words (``data_dim / 2`` of them real), the float32
  row scales as :class:`RowFormat` reads them. The class sets ``ptx`` (convert with PTX,
  compiled for CUDA, else with the element formulas)."""

  @property
  def part_width(self) -> int:
    """The words of a side's data, at least 16 (the smallest dot)."""
    return max(16, self.data_pad // 2)

  def view_dtypes(self, scale_words: bool = True) -> tuple:
    """uint16 words, then the float32 words of the row scales where :class:`RowFormat`
    reads them."""
    return (np.dtype(np.uint16), *super().view_dtypes(scale_words))

  def paired(self, ptx: bool) -> TileFormat:
    return dataclasses.replace(self, ptx=ptx)

  def load_kv(self, pages_ref, blk, tok, head, valid, views=()):
    """``views``: (the pages as uint16 words ``[B, page_elems / 2]``, [float32 words]) as
    :meth:`view_dtypes` lists them."""
    words_ref = views[0]
    cols = jnp.arange(self.part_width, dtype=_I32)
    mask = valid[:, None] & (cols < self.data_dim // 2)[None, :]
    base = self.addr.offset(tok, head)                                # in bytes
    half = lax.div(base, 2)                                           # in words
    k = self.gather(words_ref, blk, half[:, None] + cols[None, :], mask)
    v = self.gather(words_ref, blk, half[:, None] + (cols + self.v_offset // 2)[None, :], mask)
    if not self.row_scaled:
      return (k, v)
    offs = (base + self.data_dim, base + self.v_offset + self.data_dim)
    scales_ref = views[1] if len(views) > 1 else None
    return (k, v, *self._row_scales(pages_ref, scales_ref, blk, offs, valid))


@dataclasses.dataclass(frozen=True)
class PairFormat(WordRows, RowFormat):
  """A row format of one-byte codes (fp8 per tensor, int8 / fp8 per token-head) read as
  uint16 words of two codes through a uint16 view of the pages, its dots split over even and
  odd head dims (:mod:`pallas_kernels.triton.pairs` says why). Same values as
  :class:`RowFormat`; the decode kernel's hooks (``DecodeConfig.pair_codes``).

  ptx: convert the pairs with PTX (compiled for CUDA), else with the element formulas.
  """
  num_parts: ClassVar[int] = 2
  row_table: ClassVar[bool] = False
  ptx: bool = False

  def _qk(self, q_parts, k):
    even, odd = pairs.pair_to_f16(k, self.codec.quant, self.ptx)
    return (self.dot(q_parts[0], even, trans_b=True) +
            self.dot(q_parts[1], odd, trans_b=True))

  def _pv(self, p, v):
    return tuple(self.dot(p, x) for x in pairs.pair_to_f16(v, self.codec.quant, self.ptx))
