"""The Mosaic GPU ragged kernel reading a quantized cache as it is stored (no plain copy).

For a format whose hooks say :attr:`.formats.Operands.ragged_direct`, the producer warpgroup
of :mod:`.kernel` copies each key step's K and V bytes with TMA into a landing slot per side
(the format's own dtype and swizzle, :meth:`.formats.Operands.landing`), turns them into the
values a plain cache of q's dtype would hold (:meth:`.formats.Operands.plain_values`, one
``(64, 64)`` chunk at a time: the producer keeps few registers), stores those into the
step's plain K/V slot and arrives on the slot's barrier itself. The consumers read the plain
slots as they read a plain cache's, so every kernel variant runs unchanged.

Per side the order is: wait until the consumers release the plain slot, wait for the landed
bytes, convert, then copy the next step's bytes into the same landing slot, so that a side's
next copy is in flight while the other side converts. The tensor scales (float32 ``[2, H]``,
:meth:`kvjax.codecs.Codec.tensor_scales`) are an operand read once per item.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

#: Rows and columns of one conversion chunk: the WGMMA layout's 64 rows, and the 128-byte
#: swizzle's 64 columns of the plain slot.
CHUNK = 64


def landing_scratch(st, tiled):
  """``(slots, barriers)`` of the landed bytes: one ``(block_kv, D)`` slot per side (index 0
  K, 1 V) in the format's storage, and a barrier per side that its TMA copies arrive on;
  ``(None, None)`` for a plain cache. ``tiled(shape, dtype, swizzle)`` makes a tiled buffer."""
  if st.ops is None:
    return None, None
  geo = st.geo
  slots = st.ops.landing(2, geo.block_kv, st.head_size, tiled)
  return slots, plgpu.Barrier(num_arrivals=geo.pieces_per_step, num_barriers=2)


def convert_side(land_ref, slot_ref, scale, st) -> None:
  """The plain values of one side's landed ``(block_kv, D)`` step into its plain slot."""
  for r0 in range(0, st.geo.block_kv, CHUNK):
    for c0 in range(0, st.head_size, CHUNK):
      rows, cols = pl.ds(r0, CHUNK), pl.ds(c0, CHUNK)
      slot_ref.at[rows, cols][...] = st.ops.plain_values(land_ref.at[rows, cols], scale,
                                                         st.dtype)


def produce_item(t, base, st, refs, block_ids, issue) -> None:
  """The producer's key steps of work item ``t`` (the block's steps ``base`` on) for a
  directly read format.

  refs: ``(scales_ref, landing, land_bars, slots, ready, free)``: the tensor scales, the
  landing slots and their barriers (:func:`landing_scratch`), the plain K and V slots, the
  barriers the consumers wait on for them and the ones they release them by (each a pair
  indexed by side). ``block_ids(j)`` gives step j's page ids, ``issue(j, dst, barrier,
  side, ids)`` issues its TMA copies of one side into ``dst``.
  """
  scales_ref, landing, land_bars, slots, ready, free = refs
  stages = st.geo.stages
  scales = [scales_ref[side, t.h] for side in (0, 1)]

  @pl.when(t.num_steps > 0)
  def _first_copies():
    ids = block_ids(t.j_lo)
    for side in (0, 1):
      issue(t.j_lo, landing.at[side], land_bars.at[side], side, ids)

  @pl.loop(t.j_lo, t.j_hi)
  def _steps(j):
    n = base + j - t.j_lo                      # the block's step: plain slot n % stages
    slot = lax.rem(n, stages)
    ids = block_ids(jnp.minimum(j + 1, t.j_hi - 1))
    for side in (0, 1):
      @pl.when(n >= stages)
      def _():
        plgpu.barrier_wait(free[side].at[slot])
      plgpu.barrier_wait(land_bars.at[side])
      convert_side(landing.at[side], slots[side].at[slot], scales[side], st)
      plgpu.commit_smem()      # stores seen by wgmma; every thread's reads of the landing done
      plgpu.barrier_arrive(ready[side].at[slot])

      @pl.when(j + 1 < t.j_hi)
      def _next_copy():
        issue(j + 1, landing.at[side], land_bars.at[side], side, ids)

