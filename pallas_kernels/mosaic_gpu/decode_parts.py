"""Pieces of the Mosaic GPU decode kernel's body (:mod:`.decode_kernel`): which sequence a
query row belongs to, values read per query column, and interpret mode's staging of register
operands."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

#: Running max before any key: finite, so ``exp2(m - m_new)`` is never NaN.
M_INIT = -1e30


def row_sequence(qsl_ref, row, num_seqs: int):
  """(sequence, whether it has query row ``row``): the last s in ``[0, S]`` with
  ``query_start_loc[s] <= row`` (sequences without query rows repeat their start and are
  skipped); ``row >= query_start_loc[S]`` has none.

  The usual decode batch, one row per sequence, is answered by two independent scalar loads
  (``query_start_loc[row] == row`` and ``[row + 1] == row + 1``: sequence ``row``); other
  batches by a binary search, ``ceil(log2(S + 1))`` dependent loads."""
  at = jnp.minimum(row, num_seqs - 1)
  own = (row < num_seqs) & (qsl_ref[at] == row) & (qsl_ref[at + 1] == row + 1)

  def search():
    lo, hi = jnp.int32(0), jnp.int32(num_seqs + 1)      # the answer is in [lo, hi)
    for _ in range(int(num_seqs).bit_length()):
      mid = lax.div(lo + hi, 2)
      right = qsl_ref[mid] <= row
      lo = jnp.where(right, mid, lo)
      hi = jnp.where(right, hi, mid)
    return lo
  lo = lax.cond(own, lambda: at, search)
  return jnp.minimum(lo, num_seqs - 1), lo < num_seqs


def column_values(ref, row0, rows):
  """float32 ``(16,)`` values of the query columns (the layout of a WGMMA column reduction),
  column c read from ``ref[row0 + c]``: sinks (log2 domain), or the queries' sums."""
  wgmma_layout = plgpu.Layout.WGMMA
  cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, rows.shape, 1), wgmma_layout)
  tile = plgpu.layout_cast(jnp.full(rows.shape, M_INIT, jnp.float32), wgmma_layout)
  last = ref.shape[0] - 1            # columns past the end belong to no head: any value
  for c in range(rows.shape[1]):
    tile = jnp.where(cols == c, ref[jnp.minimum(row0 + c, last)], tile)
  return tile.max(axis=0)


def staged(products, k_staged):
  """Interpret mode: each register A operand of ``S^T``'s products stored to columns of the
  ``k_staged`` buffer (its wgmma takes them from there)."""
  staged, col = [], 0
  for a_op, b_op in products:
    width = a_op.shape[1]
    buf = k_staged.at[:, pl.ds(col, width)]
    buf[...] = a_op
    staged.append((buf, b_op))
    col += width
  plgpu.commit_smem()
  return staged
