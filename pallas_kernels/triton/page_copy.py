"""Whole pages stored into a cache by block id, in place (Triton): a transfer's receive.

Entry point :func:`store_pages` (the "pallas" implementation of ``kvjax.registry.PAGES``,
called by :func:`kvjax.pages.store_pages`). Format-blind: both the cache's page rows and the
incoming rows are seen as unsigned words (uint32 where the page's bytes allow, a free bitcast
of any storage dtype), and each program copies one chunk of one page: it loads the page's
block id, then moves ``chunk`` words from the rows to the block's row (a negative id: none).
The cache is handed to the kernel whole (``BlockSpec(memory_space=pl.ANY)``) and aliased to
the output, so under a ``jit`` that donates it the store is in place; no other cache word is
read or written.
Blocks have power-of-2 sizes: a page row whose word count has no large power-of-2 divisor
gets a masked last chunk.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvjax import quant
from pallas_kernels.common import cdiv, next_pow2

_WORDS = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}


@dataclasses.dataclass(frozen=True)
class PageCopyConfig:
  """Launch parameters: words per program (a power of two) and warps (GPU only)."""
  chunk: int = 4096
  num_warps: int = 4

  def __post_init__(self):
    if self.chunk < 1 or self.chunk & (self.chunk - 1):
      raise ValueError(f"chunk={self.chunk} must be a power of two")


def supports_pages(dtype, width: int):
  """Registry hook: every storage dtype of 1, 2 or 4 bytes (any page width)."""
  del width
  if jnp.dtype(dtype).itemsize not in _WORDS:
    return f"{jnp.dtype(dtype)} is not a 1-, 2- or 4-byte storage dtype"
  return None


def word_bytes(itemsize: int, *byte_counts: int) -> int:
  """The widest word (4, 2 or 1 bytes, at least ``itemsize``) that divides every count."""
  return next(w for w in (4, 2, 1)
              if w == itemsize or (w > itemsize and all(b % w == 0 for b in byte_counts)))


def _as_words(x, word: int):
  """``x [r, c]`` (any 1/2/4-byte dtype) -> its unsigned words ``[r, c * itemsize / word]``
  (a bitcast: no copy)."""
  bits = quant.to_bits(x)
  k = word // x.dtype.itemsize
  if k == 1:
    return bits
  return jax.lax.bitcast_convert_type(bits.reshape(x.shape[0], -1, k), _WORDS[word])


def _from_words(w, dtype, shape):
  """Inverse of :func:`_as_words`: words ``[r, c']`` -> ``dtype`` ``shape``."""
  bits = jax.lax.bitcast_convert_type(w, quant.bits_dtype(dtype)).reshape(shape)
  return quant.from_bits(bits, dtype)


def _kernel(chunk: int, width: int, column: int, ids_ref, rows_ref, table_in, table_ref):
  del table_in  # aliased: table_ref is the same buffer
  i, c = pl.program_id(0), pl.program_id(1)
  block = pltriton.load(ids_ref.at[i])
  cols = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
  # masked lanes are not accessed on a GPU; in interpret mode they point past the row's end
  # and are dropped (clamped, they would store over the last word)
  mask = block >= 0                          # a negative id skips the row: nothing is read
  if width % chunk:
    mask = mask & (cols < width)
  else:
    mask = jnp.broadcast_to(mask, cols.shape)
  x = pltriton.load(rows_ref.at[i, cols + column], mask=mask)
  pltriton.store(table_ref.at[jnp.maximum(block, 0), cols], x, mask=mask)


def store_pages(table, rows, block_ids, *, column: int = 0, interpret: bool = False,
                config: PageCopyConfig | None = None):
  """``table[block_ids[i], :] = rows[i, column:column + W]`` for every i; returns the table.

  Args:
    table: ``[B, W]`` any 1/2/4-byte storage dtype (a cache's pages as rows: a free reshape).
    rows: ``[n, R]`` of the table's dtype, or uint8 (its bytes); at least ``column + W`` of
      the table's elements a row.
    block_ids: int32 ``[n]``: negative skips the row; the others distinct, in ``[0, B)`` (the
      caller checks).
    column: the first column of ``rows`` stored (in the table's elements; static).
    interpret: Pallas interpret mode (CPU); config: :class:`PageCopyConfig`.
  In place when the caller's ``jit`` donates ``table``.
  """
  config = config or PageCopyConfig()
  n = int(block_ids.shape[0])
  if n == 0:
    return table
  isz = table.dtype.itemsize
  word = word_bytes(isz, table.shape[1] * isz, column * isz,
                    rows.shape[1] * rows.dtype.itemsize)
  t = _as_words(table, word)
  r = _as_words(rows, word)
  width, col = t.shape[1], column * isz // word
  chunk = min(config.chunk, next_pow2(width))
  extra = {} if interpret else {
      "compiler_params": pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1)}
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  out = pl.pallas_call(
      functools.partial(_kernel, chunk, width, col),
      out_shape=jax.ShapeDtypeStruct(t.shape, t.dtype),
      grid=(n, cdiv(width, chunk)),
      in_specs=[any_spec] * 3,
      out_specs=any_spec,
      input_output_aliases={2: 0},
      interpret=interpret,
      name="store_pages",
      **extra,
  )(jnp.asarray(block_ids, jnp.int32), r, t)
  return _from_words(out, table.dtype, table.shape)


__all__ = ["PageCopyConfig", "supports_pages", "word_bytes", "store_pages"]
