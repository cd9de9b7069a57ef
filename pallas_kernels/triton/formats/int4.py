"""int4 per token-head's Triton hooks: packed nibbles and a float32 scale with its zero point.

:class:`Int4Format` reads bytes of two codes; :class:`Int4WordFormat` (the decode kernel's)
reads uint16 words of four.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax import quant
from pallas_kernels.common import f32_to_bytes, next_pow2, pack_words
from pallas_kernels.triton import pairs
from pallas_kernels.triton.formats.rows import RowFormat, WordRows
from pallas_kernels.triton.formats.tile import TileFormat
from pallas_kernels.triton.ieee import Divider

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class Int4Format(RowFormat):
  """int4 per token-head: packed nibbles (low = even element) and a float32 scale carrying
  the zero point in its low 4 bits."""
  num_parts: ClassVar[int] = 2
  row_table: ClassVar[bool] = False

  def _f16_codes(self, x):
    """A data tile (bytes) -> (float16 codes of each part, the factor each carries)."""
    return quant.nibbles_to_f16(x), (1.0, 16.0)

  def _codes(self, x):
    """A data tile -> its parts' codes, each with the factor its values carry: float16 from
    the bits (:attr:`fast_f16`; the high nibbles 16 x), else float32 (factor 1). Dots over
    a part are divided by its factor."""
    if self.fast_f16:
      return tuple(zip(*self._f16_codes(x)))
    return tuple((c.astype(jnp.float32), 1.0) for c in quant.nibbles(x))

  def scores(self, q_parts, qsum, tiles, k_scale):
    k, _, ks, _ = tiles
    scale, zp = quant.int4_unpack_scale(ks)
    by_factor = {}       # dots of parts with equal factors added before one division
    for qp, (c, f) in zip(q_parts, self._codes(k)):
      d = self.dot(qp, c, trans_b=True)
      by_factor[f] = d if f not in by_factor else by_factor[f] + d
    s = sum(d * (1.0 / f) if f != 1.0 else d for f, d in by_factor.items())
    return (s - qsum[:, None] * zp[None, :]) * scale[None, :]

  def values(self, p, tiles, v_scale):
    _, v, _, vs = tiles
    scale, zp = quant.int4_unpack_scale(vs)
    w = (p * scale[None, :]).astype(self.compute_dtype).astype(jnp.float32)
    corr = jnp.sum(w * zp[None, :], axis=1)[:, None]
    return tuple((self.dot(w, c) * (1.0 / f) if f != 1.0 else self.dot(w, c)) - corr
                 for c, f in self._codes(v))

  def dequant(self, tiles, k_scale, v_scale):
    out = []
    for x, stored in ((tiles[0], tiles[2]), (tiles[1], tiles[3])):
      scale, zp = quant.int4_unpack_scale(stored)
      out.append(tuple((c.astype(jnp.float32) - zp[:, None]) * scale[:, None]
                       for c in quant.nibbles(x)))
    return tuple(out)

  def paired(self, ptx: bool) -> TileFormat:
    """:class:`Int4WordFormat`: four codes a uint16 word (head sizes divisible by 4)."""
    return self if self.head_size % 4 else self._as(Int4WordFormat, ptx=ptx)

  @property
  def write_words(self) -> bool:
    """Words of 8 codes (D a multiple of 8), the packed scale one word."""
    return self.head_size % 8 == 0

  def write_sources(self, io, side: int, head) -> tuple:
    d = self.head_size
    if self.write_words:
      return (io.groups(side, d // 8, 8, d),)          # [rows, w, 8]; D/8 a power of two
    return io.pairs(side, next_pow2(self.data_dim), d)  # even, odd [rows, D/2 padded]

  def _encode_words(self, div: Divider, io, x):
    w = self.head_size // 8
    lo = jnp.min(jnp.min(x, axis=2), axis=1)
    hi = jnp.max(jnp.max(x, axis=2), axis=1)
    scale = quant.int4_scale(lo, hi)
    r = div.recip(scale)
    zp = quant.int4_zero_point(lo, r)
    codes = quant.int4_codes(x, r[:, None, None], zp[:, None, None], jnp.uint32, div.trunc_u32)
    packed = quant.to_bits(quant.int4_pack_scale(scale, zp))
    return [(0, jnp.arange(w, dtype=_I32), None, pack_words(codes, 4)),
            (w, jnp.arange(1, dtype=_I32), None, packed[:, None])]

  def encode_side(self, div: Divider, io, sources: tuple):
    if self.write_words:
      return self._encode_words(div, io, *sources)
    dh = self.data_dim                          # D/2 packed bytes
    jcol, _, jmask = io.cols(next_pow2(dh), dh)
    xe, xo = sources
    lo = jnp.min(jnp.minimum(xe, xo), axis=1)     # one reduction each, not two
    hi = jnp.max(jnp.maximum(xe, xo), axis=1)
    scale = quant.int4_scale(lo, hi)
    r = div.recip(scale)
    zp = quant.int4_zero_point(lo, r)

    def q(v):   # x * (1/scale) + zp: contracted into an fma, as XLA does under jit
      return quant.int4_codes(v, r[:, None], zp[:, None])

    packed = q(xe) | (q(xo) << jnp.uint8(4))
    sbytes = f32_to_bytes(quant.int4_pack_scale(scale, zp))
    return [(0, jcol, jmask, packed), (dh, jnp.arange(4, dtype=_I32), None, sbytes)]


@dataclasses.dataclass(frozen=True)
class Int4WordFormat(WordRows, Int4Format):
  """int4 per token-head read as uint16 words of four codes through a uint16 view of the
  pages, its dots over four parts (head dims ``4i + j``), each word split in registers
  (:func:`pallas_kernels.triton.pairs.nibble_words_to_f16`). Same values as
  :class:`Int4Format`; the decode kernel's hooks (``DecodeConfig.pair_codes``)."""
  num_parts: ClassVar[int] = 4
  ptx: bool = False

  def _f16_codes(self, x):
    return pairs.nibble_words_to_f16(x, "int4", self.ptx), pairs.NIBBLE_FACTORS["int4"]
