"""The K/V copies of the Mosaic GPU decode kernel (:mod:`.decode_kernel`): which GMEM box of the
cache (or of its view, :func:`.decode.cache_view_shape`) each TMA copy of a step reads, and
where in the format's landing slots (:meth:`.formats.Operands.landing`) it lands.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu.decode_geometry import DecodeStatics


def _kv_box(cache_ref, st: DecodeStatics, blk, h, row0, nrows, col0, ncols, layer=None):
  """``(nrows, ncols)`` GMEM box of head h: rows row0.. of page blk (tokens, or for
  row-scaled formats rows of ``tokens_per_row`` tokens), storage columns col0.. of a row (of
  ``layer`` in a layered cache)."""
  rows, cols = pl.ds(row0, nrows), pl.ds(col0, ncols)
  if st.ops.row_scaled:            # the cache_view: NHD heads are columns of a row
    if st.layout == "NHD":
      return cache_ref.at[blk, rows, cols]
    return cache_ref.at[blk, h, rows, cols]
  index = [blk, rows, h, cols] if st.layout == "NHD" else [blk, h, rows, cols]
  if st.layer_axis is not None:
    index.insert(st.layer_axis, layer)
  return cache_ref.at[tuple(index)]


def _group_boxes(cache_ref, st: DecodeStatics, blk, h, tok0, ntok, side: int):
  """Formats with group scales (``ops.scale_copies``, the view ``(B, 2, R, W)``): the GMEM
  boxes of head h's data rows and scale rows of tokens ``[tok0, tok0 + ntok)`` of page blk,
  one side."""
  n, per = st.geo.block_size, st.ops.tokens_per_scale_row
  head_row = h * n + tok0
  data = cache_ref.at[blk, side, pl.ds(head_row, ntok)]
  first = st.num_kv_heads * n + lax.div(head_row, per)
  return data, cache_ref.at[blk, side, pl.ds(first, ntok // per)]


class Copies:
  """The K/V copies of one block: step i of its split (``steps`` in all) lands in slot
  ``i % stages`` of ``k_land`` / ``v_land`` and arrives on that slot's barrier. refs: the
  kernel's GMEM refs (``bt``, ``cache``, ``layer``)."""

  def __init__(self, refs, st: DecodeStatics, seq, start, steps, lands, bars):
    self.refs, self.st, self.seq, self.start, self.steps = refs, st, seq, start, steps
    self.lands, self.bars = lands, bars
    self.h = lax.axis_index("head")
    self.layer = None if st.layer_axis is None else refs.layer[0]

  def first_key(self, i):
    """The first token of the cache step i's copies read (its span: ``st.step_span``)."""
    st, u = self.st, self.st.geo.round_steps
    round0 = (self.start + lax.div(i, u)) * st.span
    return round0 if st.tokens_per_row == 2 else round0 + lax.rem(i, u) * st.geo.block_kv

  def block_ids(self, i):
    """The block of each piece of step i's span (loaded together: the loads overlap; K and
    V of the step share them). Clamped: any i reads a valid entry."""
    st = self.st
    ids = []
    for p in range(st.copies_per_step):
      page = jnp.minimum(lax.div(self.first_key(i) + p * st.piece, st.geo.block_size),
                         st.max_blocks - 1)
      ids.append(jnp.clip(self.refs.bt[self.seq * st.max_blocks + page], 0,
                          st.num_blocks - 1))
    return ids

  def issue(self, i, side: int, ids):
    """Step i's copies of one side (0: K, 1: V) from blocks ``ids``."""
    st, d = self.st, self.st.geo.head_size
    if st.ops.scale_copies:
      self._issue_groups(i, side, ids)
      return
    r_tok = st.tokens_per_row
    rows_per_copy = st.piece // r_tok
    row_len = st.content_dim * (st.num_kv_heads if st.layout == "NHD" else 1)
    head_col = self.h * st.content_dim if st.layout == "NHD" and st.ops.row_scaled else 0
    slot = lax.rem(i, st.geo.stages)
    col = lax.rem(i, r_tok) * row_len + head_col + side * (st.side_dim or d)
    col = col - lax.rem(col, 16)      # a box starts on 16 bytes: see landing_offsets
    width = st.ops.landing_cols(d)
    for p, blk in enumerate(ids):
      row0 = lax.div(lax.rem(self.first_key(i) + p * st.piece, st.geo.block_size), r_tok)
      src = _kv_box(self.refs.cache, st, blk, self.h, row0, rows_per_copy, col, width,
                    self.layer)
      dst = self.lands[side].at[slot, pl.ds(p * rows_per_copy, rows_per_copy)]
      plgpu.copy_gmem_to_smem(src, dst, self.bars[side].at[slot])

  def _issue_groups(self, i, side: int, ids):
    """Step i's copies of one side of a format with group scales: per piece its data rows
    and its scale rows, both on the slot's barrier."""
    st = self.st
    slot = lax.rem(i, st.geo.stages)
    data, scales, _ = self.lands[side]
    per = st.ops.tokens_per_scale_row
    for p, blk in enumerate(ids):
      tok0 = lax.rem(self.first_key(i) + p * st.piece, st.geo.block_size)
      srcs = _group_boxes(self.refs.cache, st, blk, self.h, tok0, st.piece, side)
      dsts = (data.at[slot, pl.ds(p * st.piece, st.piece)],
              scales.at[slot, pl.ds(p * st.piece // per, st.piece // per)])
      for src, dst in zip(srcs, dsts):
        plgpu.copy_gmem_to_smem(src, dst, self.bars[side].at[slot])

  def refill(self, i, side: int, ids):
    """Step i's copies of one side into its slot, if the split has a step i."""
    pl.when(i < self.steps)(functools.partial(self.issue, i, side, ids))
