"""Whole pages stored into a cache by block id: the receive of a transfer.

A cache of B blocks is, for this op, a table ``[B, W]``: row b is block b's page (every layer
of it, for an NHD layered cache), a free reshape of the contiguous array. :func:`store_pages`
writes n incoming page rows over the rows named by n distinct block ids, bit for bit, and
touches nothing else; a negative id skips its row, so that callers can pad n to a few sizes
(one compiled program each). Implementations (``kvjax.registry.PAGES``): "pallas" (a Triton
page-copy kernel, GPU) and "reference" (an XLA scatter of the rows' bits, every platform).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import quant
from kvjax import registry


def store_pages(table, rows, block_ids, *, column: int = 0, impl: str = "auto", interpret=None):
  """``table[block_ids[i], :] = rows[i, column:column + W]`` for every i; returns the table.

  Args:
    table: ``[B, W]``, a cache's pages as rows (1-, 2- or 4-byte storage dtype).
    rows: ``[n, R]`` in the table's dtype (or any dtype as wide: its bits), or uint8 holding
      its bytes; at least ``column + W`` of the table's elements a row.
    block_ids: int32 ``[n]``: a negative id skips its row (padding to a fixed size); the
      others distinct and in ``[0, B)`` (callers check: the writes are told so).
    column: the first column of ``rows`` stored, in the table's elements (static).
    impl, interpret: as :func:`kvjax.write_kv` (``kvjax.explain("pages", spec)``).
  Pure: in place under a ``jit`` that donates ``table``.
  """
  routes = registry.PAGES.routes(impl, interpret, table.dtype, int(table.shape[1]),
                                 array=table)
  return routes.run(lambda run: run(table, rows, block_ids, column=column))


def store_pages_reference(table, rows, block_ids, *, column: int = 0):
  """:func:`store_pages` as an XLA scatter of bits (no float passes through it)."""
  width, itemsize = int(table.shape[1]), table.dtype.itemsize
  bits = quant.to_bits(rows)    # sliced as bits: XLA:CPU slices bf16 through float32
  if rows.dtype.itemsize != itemsize:   # bytes
    start = column * itemsize
    bits = jax.lax.slice_in_dim(bits, start, start + width * itemsize, axis=1)
    if itemsize > 1:
      bits = jax.lax.bitcast_convert_type(bits.reshape(bits.shape[0], width, itemsize),
                                          quant.bits_dtype(table.dtype))
  else:
    bits = jax.lax.slice_in_dim(bits, column, column + width, axis=1)
  ids = jnp.asarray(block_ids, jnp.int32)
  # skipped rows go to distinct ids past the table, which the scatter drops
  ids = jnp.where(ids < 0, table.shape[0] + jnp.arange(ids.shape[0], dtype=jnp.int32), ids)
  out = quant.to_bits(table).at[ids].set(bits, unique_indices=True, mode="drop")
  return quant.from_bits(out, table.dtype)


__all__ = ["store_pages", "store_pages_reference"]
