"""The Triton kernels' per-format hooks: tile loads, dequantization and quantize-on-write.

The Triton adapter table (:mod:`pallas_kernels.triton.adapters`) gives each codec its hook
class from the codec's facts: :class:`RowFormat` for every format whose (token, head) rows
hold ``[K data | K scale | V data | V scale]`` (plain, fp8 per tensor, int8 / fp8 per
token-head, and any new row format described by its codec's facts), :class:`Int4Format` and
:class:`Nvfp4Format` for the packed formats whose kernels keep even and odd head dims apart.
The kernels (decode, ragged, write, dequantize) are format-blind: they call these hooks.

One module a concern: :mod:`.tile` the geometry and helpers every format shares,
:mod:`.rows` the row formats (and the word reads of one-byte rows), :mod:`.int4` and
:mod:`.nvfp4` the packed formats, each with its word variant (the decode kernel's reads of
codes as uint16 words).

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
from pallas_kernels.triton.formats.int4 import Int4Format, Int4WordFormat
from pallas_kernels.triton.formats.nvfp4 import Nvfp4Format, Nvfp4WordFormat
from pallas_kernels.triton.formats.rows import PairFormat, RowFormat, WordRows
from pallas_kernels.triton.formats.tile import TileFormat

__all__ = ["TileFormat", "RowFormat", "WordRows", "PairFormat", "Int4Format", "Int4WordFormat",
           "Nvfp4Format", "Nvfp4WordFormat"]
