"""The geometry and in-kernel helpers every Triton format hook shares (:class:`TileFormat`)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton

from kvjax.codecs import Codec, RowAddress
from pallas_kernels.common import as_operand, f32_from_bytes

_I32 = jnp.int32


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
    compute_dtype: dtype the dots run in (:func:`pallas_kernels.common.compute_dtype`).
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
  def address(spec) -> RowAddress:
    """The rows of a page these hooks address (built by
    :func:`pallas_kernels.triton.adapters.tile_format`)."""
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
    """Dot precision, with :func:`~pallas_kernels.common.compute_dtype` the one rule for every
    kernel: None, so float32 dots follow JAX's matmul-precision setting
    (``jax.default_matmul_precision``; the torch facade maps torch's float32 matmul precision
    onto it)."""
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
