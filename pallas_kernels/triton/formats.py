"""The Triton kernels' per-format hooks: tile loads, dequantization and quantize-on-write.

Each codec names its hook class here (``Codec.triton``): :class:`RowFormat` for every format
whose (token, head) rows hold ``[K data | K scale | V data | V scale]`` (plain, fp8 per
tensor, int8 / fp8 per token-head, and any new row format described by its codec's facts),
:class:`Int4Format` and :class:`Nvfp4Format` for the packed formats whose kernels keep even
and odd head dims apart. The kernels (decode, ragged, write, dequantize) are format-blind:
they call these hooks.

The kernels see the cache as flat pages ``[B, page_elems]`` (a free reshape of the physical
array; the ragged kernel's row formats as rows ``[B*N*H, C]``). Row addresses come from
:class:`kvjax.codecs.RowAddress`, number formats from :mod:`kvjax.quant`.

A hook object is static (frozen, hashable). Its in-kernel methods:

- ``load_kv(pages_ref, blk, tok, head, valid, views)`` -> the raw K/V tiles of ``T`` keys
  (``views``: the pages viewed as each of :meth:`TileFormat.view_dtypes`);
- ``scores(q_parts, qsum, tiles, k_scale)`` -> float32 ``[Gp, T]`` of ``q . k``;
- ``values(p, tiles, v_scale)`` -> float32 accumulator parts of ``p @ v``;
- ``dequant(tiles, k_scale, v_scale)`` -> float32 (K parts, V parts) ``[T, part_width]``;
- ``write_tokens(p, io, slot, head, valid)`` -> stores the rows of a program's tokens: loads
  both sides (K, V), then encodes them, then stores (row formats through ``write_sources`` /
  ``encode_side``), so a program waits on memory once.

Split formats (``num_parts > 1``) handle q, accumulators and dequantized parts as
``num_parts`` parts, part ``j`` holding head dims ``num_parts * i + j`` (even / odd for two
parts); the kernels interleave them.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton

from kvjax import quant
from kvjax.codecs import Codec, RowAddress
from kvjax.codecs.nvfp4 import SideLayout
from pallas_kernels.common import (as_operand, compute_dtype, f32_from_bytes, f32_to_bytes,
                                    next_pow2, pack_words)
from pallas_kernels.triton import pairs
from pallas_kernels.triton.ieee import Divider

_I32 = jnp.int32


def hooks_class(codec: Codec):
  """The hook class a codec names, or None when it has no Triton hooks."""
  return codec.hooks("triton")


def hooks_reason(spec):
  """Registry supports-hook: None when the Triton kernels can run ``spec``'s format."""
  if hooks_class(spec.codec) is None:
    return f"cache_dtype={spec.cache_dtype!r} has no Triton hooks (its codec's triton is None)"
  return None


@dataclasses.dataclass(frozen=True)
class TileFormat:
  """Static geometry of one cache format for the Triton kernels (base of the hook classes).

  Attributes:
    codec: the format's codec.
    storage: the cache array's dtype.
    num_heads, block_size, head_size: H, N, D.
    addr: the rows of a page (content rows; nvfp4: one side's data rows).
    v_offset: element offset of V's data from K's data in a (token, head) row.
    data_dim: stored elements of data per side row (D, or D/2).
    data_pad: data_dim padded to a power of two (>= 16).
    page_elems: elements of one page.
    compute_dtype: dtype the dots run in (:func:`compute_dtype`).
    fast_decode: build float16 operands from the stored bits with integer ops
      (:func:`kvjax.quant.int8_to_f16`, ``nibbles_to_f16``, ``e2m1_pair_to_f16``) instead of
      converting element by element (False: the plain conversions; same values).
  """
  codec: Codec
  storage: np.dtype
  num_heads: int
  block_size: int
  head_size: int
  addr: RowAddress
  v_offset: int
  data_dim: int
  data_pad: int
  page_elems: int
  compute_dtype: np.dtype
  fast_decode: bool = True

  #: Parts q, accumulators and outputs are kept in: part ``j`` holds head dims
  #: ``num_parts * i + j`` (2: even and odd head dims apart).
  num_parts: ClassVar[int] = 1
  #: The ragged kernel may read this format as rows ``[B*N*H, C]`` (row tiles).
  row_table: ClassVar[bool] = False

  @staticmethod
  def of(spec, q_dtype=None) -> "TileFormat":
    """The hooks of ``spec``'s format for queries of ``q_dtype`` (None: float32 dots)."""
    cls = hooks_class(spec.codec)
    if cls is None:
      raise ValueError(f"cache_dtype={spec.cache_dtype!r} has no Triton hooks")
    cdt = compute_dtype(spec.codec, spec.storage_dtype,
                        np.float32 if q_dtype is None else q_dtype)
    return cls(codec=spec.codec, storage=spec.storage_dtype, num_heads=spec.num_kv_heads,
               block_size=spec.block_size, head_size=spec.head_size,
               addr=cls.address(spec), v_offset=spec.padded_head_size,
               data_dim=spec.data_dim, data_pad=max(16, next_pow2(spec.data_dim)),
               page_elems=int(np.prod(spec.physical_shape(1)[1:])), compute_dtype=cdt)

  @staticmethod
  def address(spec) -> RowAddress:
    return RowAddress.of(spec)

  # -- static facts -------------------------------------------------------------------------
  @property
  def split(self) -> bool:
    """Whether head dims are kept in several parts."""
    return self.num_parts > 1

  @property
  def part_width(self) -> int:
    """Width of one q / accumulator part: data_pad (split halves are D/2 wide)."""
    return self.data_pad

  @property
  def precision(self):
    """Dot precision, with :func:`compute_dtype` the one rule for every kernel: None, so
    float32 dots follow JAX's matmul-precision setting (``jax.default_matmul_precision``;
    the torch facade maps torch's float32 matmul precision onto it)."""
    return None

  def part_cols(self, part: int):
    """Head-dim columns that part ``part`` holds (``[part_width]``) and which are real."""
    i = jnp.arange(self.part_width, dtype=_I32)
    return self.num_parts * i + part, i < self.head_size // self.num_parts

  # -- in-kernel helpers --------------------------------------------------------------------
  def dot(self, a, b, trans_b=False):
    """float32 ``a @ b`` (``a @ b.T`` with trans_b) in the compute dtype.

    lax.dot_general, not ``pl.dot``: that raises AttributeError on jax 0.11.2.
    """
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a.astype(self.compute_dtype), b.astype(self.compute_dtype), dims,
                           precision=self.precision, preferred_element_type=jnp.float32)

  @property
  def scale_words(self) -> bool:
    """Whether :meth:`load_kv` can read scales from a float32 view of the pages."""
    return False

  def view_dtypes(self, scale_words: bool = True) -> tuple:
    """dtypes of the views of the pages :meth:`load_kv` reads (its ``views``): float32 words
    for row scales (:attr:`scale_words`, when ``scale_words`` allows it)."""
    return (np.dtype(np.float32),) if scale_words and self.scale_words else ()

  @property
  def decode_defaults(self) -> dict:
    """:class:`~pallas_kernels.triton.decode_config.DecodeConfig` fields this format's decode
    sets over the defaults of its item size (measured, benchmarks/RESULTS.md)."""
    return {}

  def paired(self, ptx: bool) -> "TileFormat":
    """These hooks reading the codes as uint16 words (:class:`PairFormat`,
    :class:`Int4WordFormat`, :class:`Nvfp4WordFormat`) where the format has a word
    conversion, else ``self``. ``ptx``: convert with PTX (:mod:`pallas_kernels.triton.pairs`)."""
    return self

  def _as(self, cls, **extra) -> "TileFormat":
    """These hooks' fields as hooks of class ``cls`` (a subclass), with ``extra`` fields."""
    return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **extra)

  @property
  def fast_f16(self) -> bool:
    """Whether float16 operands are built from bits (:attr:`fast_decode` and f16 dots)."""
    return self.fast_decode and self.compute_dtype == np.dtype(np.float16)

  def q_operand(self, q):
    """A q tile as a dot operand (:func:`pallas_kernels.common.as_operand`)."""
    return as_operand(q, self.compute_dtype)

  def _cols(self):
    cols = jnp.arange(self.data_pad, dtype=_I32)
    return cols, cols < self.data_dim

  @staticmethod
  def gather(ref, blk, offs, mask, other=0):
    """ref[blk[t], offs[t, x]] for ``blk [T]``, ``offs [T, X]`` -> ``[T, X]`` (masked)."""
    idx = (jnp.broadcast_to(blk[:, None], offs.shape), offs)
    if jnp.issubdtype(ref.dtype, jnp.floating):
      other = float(other)  # Triton casts float fills to fp8, not int ones
    return pltriton.load(ref.at[idx], mask=mask, other=other)

  @staticmethod
  def gather_f32(ref, blk, offs, mask):
    """The float32 held little-endian in 4 one-byte elements at ``offs [T]`` -> ``[T]``."""
    return f32_from_bytes(lambda i: pltriton.load(ref.at[(blk, offs + i)], mask=mask, other=0))

  # -- write ----------------------------------------------------------------------------------
  #: Write kernel defaults measured on the H200 (8192 tokens, H=8, D=128):
  #: (tokens per program, contiguous pair loads).
  write_defaults: ClassVar[tuple] = (1, True)

  def tensor_scales(self, k_scale, v_scale):
    """float32 ``[2, H]``: :meth:`kvjax.codecs.Codec.tensor_scales`."""
    return self.codec.tensor_scales(k_scale, v_scale, self.num_heads)

  def write_scales(self, k_scale, v_scale):
    """float32 ``[2H]``: :meth:`tensor_scales` as the write kernel reads them."""
    return self.tensor_scales(k_scale, v_scale).reshape(-1)

  #: Whether the write kernel stores this format as uint32 words (``write_table`` counts
  #: words then): one-byte formats whose row segments all start at multiples of 4 bytes.
  write_words: ClassVar[bool] = False

  def write_table(self, num_blocks: int):
    """(rows, columns a row) of the table the write kernel stores into: storage elements,
    or uint32 words with :attr:`write_words`."""
    cols = self.addr.row_elems
    return num_blocks * self.block_size * self.num_heads, cols // 4 if self.write_words else cols

  def write_offset(self, elems: int) -> int:
    """A row offset of ``elems`` storage elements in the write table's columns."""
    return elems // 4 if self.write_words else elems


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

  @property
  def write_defaults(self):
    # plain / fp8 rows: 8 tokens a program; quantize-heavy formats 1 token, pair loads
    return (1, True) if self.row_scaled else (8, False)

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

  @property
  def decode_defaults(self) -> dict:
    """Without row scales (fp8 per tensor) 128 keys a step in 5 stages: more than the one
    32 KiB step of keys a block that 2 stages kept in flight, which left fp8 waiting on memory
    (DRAM 73 %, ncu 2026-12-03). H200, 2026-12-04: 3-12 % faster than 2 stages at 64 x 4096 and
    8 x 32768 (3, 4 and 6 stages measured too); 128 keys were 0-11 % faster than 64 keys.
    The row-scaled formats keep 64 keys (15-30 % slower with 128)."""
    return {} if self.row_scaled else {"tokens_per_step": 128, "num_stages": 5}

  def _qk(self, q_parts, k):
    even, odd = pairs.pair_to_f16(k, self.codec.quant, self.ptx)
    return (self.dot(q_parts[0], even, trans_b=True) +
            self.dot(q_parts[1], odd, trans_b=True))

  def _pv(self, p, v):
    return tuple(self.dot(p, x) for x in pairs.pair_to_f16(v, self.codec.quant, self.ptx))


@dataclasses.dataclass(frozen=True)
class Int4Format(RowFormat):
  """int4 per token-head: packed nibbles (low = even element) and a float32 scale carrying
  the zero point in its low 4 bits."""
  num_parts: ClassVar[int] = 2
  row_table: ClassVar[bool] = False
  write_defaults: ClassVar[tuple] = (1, True)

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


@dataclasses.dataclass(frozen=True)
class Nvfp4Format(TileFormat):
  """nvfp4 (HND): per page side ``[data (H, N, D/2) | scales (H, N, D/16)]``, K side first;
  V scales 4x4-swizzled (:class:`kvjax.codecs.nvfp4.SideLayout`)."""
  num_parts: ClassVar[int] = 2
  write_defaults: ClassVar[tuple] = (1, True)

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
